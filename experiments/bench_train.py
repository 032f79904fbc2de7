"""Benchmark: the full training step of the hybrid on one device, in tokens/s and MFU, with a
breakdown of where the time goes (KDA, Gated MLA attention, MoE, rest).

    python -m experiments.bench_train --gpu     # H200: `1b` preset, 6 rows x 4096 tokens,
                                                # bf16 compute, remat dots_kernels, unrolled
                                                # -> benchmarks/train_h200.md
    python -m experiments.bench_train --smoke   # `tiny` preset at a tiny size (CPU check)
    python -m experiments.bench_train --gpu --cpu-plan   # compile only, here: memory plan
    python -m experiments.bench_train --gpu --profile    # + device time by part and top ops
    python -m experiments.bench_train --gpu --no-layers --versus model.kda.conv_kernels=false
                                                # the step, then the step with the override,
                                                # in one process (an A/B on one machine)
    python -m experiments.bench_train --gpu --set model.mla.implementation=cudnn
                                                # any TrainConfig field (`train.cli`); this
                                                # one: the dense-mask attention

The step is the real one (`train.loop.Trainer`: forward, backward, AdamW, the QB router-bias
update, the non-finite check) on one reused synthetic batch (random bytes, four packed documents
per row), so the input pipeline is not measured. Step time = the median of `--steps` steps after
`--warmup` compiled ones, issued as `train.loop` issues them: each step dispatched before waiting
for the previous one (`experiments.profiling.pipelined_seconds`), so the host's dispatch overlaps
the device's work; tokens/s and MFU come from it. The table also gives the median of steps each
waited for before the next is issued (`median_seconds`: dispatch included; this benchmark's only
step time before 2026-11-30's ninth session). MFU = model FLOPs (`train.metrics.train_flops_per_token`: 6 per active
parameter plus the KDA recurrence and causal attention scores) per second over 989 TFLOP/s, the
H100/H200 dense bf16 peak.

Preflight: before any step runs, the step is compiled ahead of time and XLA's memory analysis is
printed (arguments, outputs, temporaries, the peak they add up to, and the device's limit), so a
run reports its memory even if it then fails; a peak over the limit stops the run there, and an
out-of-memory error names the options that shrink the step (`--remat full`, a smaller `--batch`).
The timed steps reuse that compiled program. Every number is printed as soon as it is measured
and the table and .json are rewritten each time, so a run cut short keeps the step time and MFU.

Why the `--gpu` setup uses remat `dots_kernels` (each layer keeps its matmul outputs and its GPU
kernels' outputs and recomputes the rest in the backward pass, `models.lm.REMAT`): with no remat
the first H200 run failed, XLA asking for 66.4 GiB of temporaries on top of the 41.6 GiB of arguments (float32 parameters, 13.9 GiB,
and AdamW moments, 27.7 GiB, of 3.72B parameters) against the 104 GiB that JAX's allocator takes
by default (75% of 139 GiB). `--cpu-plan` compiles the step on the CPU at the same shapes, its
state abstract, with the GPU kernels (Mosaic GPU KDA, grouped GEMMs, cuDNN attention) replaced
by opaque calls that read their operands and write their results and residuals
(`gpu_kernel_stand_ins`); XLA then plans these temporaries besides the arguments (float32
gradients included; CPU compile 24-31 s each):

    remat            layers      4 x 4096     2 x 4096     1 x 4096
    dots             unrolled     28.8 GiB     28.8 GiB
    dots             scanned      37.7 GiB     28.0 GiB     28.0 GiB
    dots_no_batch    scanned      37.7 GiB
    dots_kernels     scanned      61.2 GiB
    dots_kernels     unrolled     40.6 GiB
    full             scanned      29.6 GiB

(Before the AttnRes reads were written as reductions (`models.attn_res.attn_res_read`), the
scanned rows were 45.2, 30.9 and 28.0 GiB with `dots`, 41.2 with `dots_no_batch` and 33.0 with
`full`: each read wrote its normalised float32 candidates out for a batched matmul.)

Unrolled, the optimizer update's 28.8 GiB is the peak (the backward's was 27.0 GiB with `dots`
and 23.8 with `full` in an earlier estimate by the same method, where no remat needed 133.5 GiB
at 4 rows and 70.4 at 2). XLA:CPU fuses less than XLA:GPU (with no remat it keeps every float32
intermediate of the norms, gates and routing): for the step as it was then (moments copied, KDA
preparation differentiated in plain JAX) this estimate gave 180 GiB of temporaries where the GPU
planned 66.4, so these are upper bounds. The scanned step planned 69.8 GiB at 4 rows (42.5 at 2,
58.7 with `full`) while each scanned group of four layers was one checkpoint: its backward
rematerialised the four layers' intermediates together (8.5 GB of dtype conversions alone at
2 rows). Each layer is now its own checkpoint, scanned or not (`models.lm`). What the scanned plan
still has over the unrolled one is XLA:CPU's packing of the while loops' buffers, not live data:
at the peak of the 4-row plans (the end of the forward loop scanned, the optimizer update
unrolled) the buffers live add up to 71.3 GiB scanned and 70.6 GiB unrolled (XLA's live-range
dump), but the scanned program's allocation spanned 86.8 GiB and the unrolled one's 70.4 (79.2
GiB scanned since the AttnRes change). With `dots` (79.2 GiB scanned by this upper bound, the
H200's own plan 77.3 GiB) the backward pass ran every kernel's forward again (KDA's preparation
and recurrence, the MoE's grouped GEMMs, cuDNN attention): custom VJPs are opaque to the other
policies. `dots_kernels` keeps those outputs too (102.7 GiB scanned and 82.1 unrolled by this
estimate; the H200 planned 108.4 and 85.7), so `--gpu` gives JAX's allocator
`GPU_MEMORY_FRACTION` of the GPU (128 of 139 GiB) unless XLA_PYTHON_CLIENT_MEM_FRACTION says
otherwise. The step also no longer copies the AdamW moments (27.7 GiB) for its non-finite-step
check: `train.step` applies the update under `lax.cond`. Since the train state keeps the expert
weights' bf16 compute copies (`train.step.TrainState`), the arguments are 47.20 GiB (41.57
before); `--cpu-plan --batch` 4, 6 and 8 (`dots_kernels`, unrolled) planned 44.13, 63.33 and
81.97 GiB of temporaries, peaks of 91.3, 110.5 and 129.2 GiB (the H200's plan at 4 rows, before
the copies: 49.72 GiB of temporaries against the CPU's 44.13).

Why the `--gpu` setup runs 6 rows: the optimizer update and the non-finite check (~29 ms on the
H200) cost the same at any number of rows, and the router-bias update little more (2.3 ms at 4
rows, 3.0 at 6), so more rows spend a smaller share of the step on them. 6 is the most that fits:
the H200 planned a 113.3 GiB peak at 6 rows (91.3 at 4), and `--cpu-plan` 129.2 GiB at 8, over the
128.6 GiB the allocator is given. On one H200 (2026-11-30, ae618f8) 6 rows ran at 36.8% MFU and 4
rows at 35.0-35.1% (`--batch 4`).

Why the `--gpu` setup compiles every layer on its own: `--scanned` (`scan_layers`,
`models.lm.layer_plan`) runs layers 1-12 of the `1b` preset as three repeats of one four-layer
group under `lax.scan`, so XLA compiles 8 layer bodies instead of 16, but the backward pass then
reads what each layer saved from the while loop's stacked buffers. XLA fills those stacks with
zeros, copies every saved kernel output into them (a custom call cannot write into a slice) and
copies each back out for the backward's kernels. On the H200 (2026-11-30, same build, `--profile`)
the scanned step took 473.0 ms and the unrolled one 379.5 ms (-20%): the ops outside every named
part fell from 64.0 to 3.6 ms, the MoE from 166.4 to 134.9 ms and AttnRes from 35.1 to 24.8 ms;
the plan's peak fell from 108.4 to 85.7 GiB. The price is compile time: 330 s unrolled against
244-251 s scanned, so a GPU run needs about 6 minutes.

Breakdown: one KDA, one Gated MLA and one MoE layer of the same configuration are timed alone
(forward and backward of a fixed random input and cotangent, under the same remat policy, median
of the same number of steps), times their number of layers; "rest" is the step minus those parts:
the dense FFN, the embedding and LM head, norms, AttnRes, the loss, the optimizer and the bias
update. An estimate: each layer alone, compiled on its own.

In-step breakdown (`--profile`): a few steps are traced and every device op's time is summed
under the innermost named scope of `models.lm.PROFILE_SCOPES` in its HLO op_name
(`experiments.profiling.scope_times`; the model and `train.step` run each part under its scope):
the time each part takes inside the real step, all of it, "rest" included. The costliest device
ops follow, then the device's idle time in each traced step (the time between its ops, from the
trace's timestamps), its longest gaps with the ops on either side, and idle time grouped by the op
that ends each gap (`experiments.profiling.idle_summary`).
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from unittest import mock

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.profiling import (command_line, idle_markdown, idle_summary_line, median_seconds,
                                  ops_markdown, pipelined_seconds, profile_compiler_options,
                                  scope_ops_markdown, scopes_markdown, trace_device_ops)
from kda import api as kda_api
from kda.kernels.mosaic_gpu import op as kda_mosaic_gpu
from kda.kernels.mosaic_gpu import sequence_parallel
from kda.kernels.path import kernel_kda
from kda.layer import KDA
from models import attention
from models import lm as models_lm
from models.attention import GatedMLA, pad_head_dims
from models.attention import causal_document_attention as _xla_attention
from models.config import ModelConfig, count_params, format_count, preset
from models.lm import PROFILE_SCOPES, REMAT
from moe import grouped_matmul
from moe.experts import StableLatentMoE
from train.cli import apply_overrides
from train.data import DataConfig
from train.loop import MeshConfig, TrainConfig, Trainer
from train.metrics import HOPPER_PEAK_FLOPS, train_flops_per_token
from train.optim import OptimConfig
from train.packing import finalize_batch

DOCUMENTS_PER_ROW = 4
PROFILED_OPS = 40  # rows of the `--profile` table
PROFILED_OPS_PER_PART = 15  # rows of each part's table, each one op of every layer
PROFILED_STEPS = 3  # traced steps of `--profile`
IN_STEP_TITLE = (
    f"In-step device time by part (per step, {PROFILED_STEPS} steps traced): every device op "
    "summed under the innermost named scope of `models.lm.PROFILE_SCOPES` in its HLO op_name (a "
    "part's forward, recomputation and backward together); other = ops under no scope (copies "
    "and fusions XLA made without metadata, the scanned layers' slicing of stacked parameters, "
    "residual adds). This measures the parts inside the one compiled step, where XLA fuses and "
    "schedules them together; the breakdown above times each layer kind alone, compiled on its "
    "own, so the two measure different things and need not agree."
)


GIB = 2**30


@dataclasses.dataclass(frozen=True)
class BenchSetup:
    """One benchmark: a preset, rows x sequence length, timed and warm-up steps, and the
    recomputation policy of each layer (`models.lm.REMAT`)."""

    preset: str
    batch: int
    seq_len: int
    steps: int
    warmup: int
    remat: str
    scan_layers: bool = False  # one compiled body per repeated layer group (the docstring says
    # why the default compiles every layer on its own)
    settings: tuple[str, ...] = ()  # `--set key=value` overrides of the TrainConfig (`train.cli`)
    layers: bool = True  # after the step, time each layer kind alone (the breakdown)
    versus: tuple[str, ...] = ()  # then the same step with these settings too, same process

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


# The module docstring says why the GPU setup runs 6 rows, unrolled, with `dots_kernels`.
GPU = BenchSetup("1b", batch=6, seq_len=4096, steps=20, warmup=3, remat="dots_kernels")
# Of the GPU's memory, what `--gpu` lets JAX's allocator take unless XLA_PYTHON_CLIENT_MEM_FRACTION
# is set (JAX's default, 0.75, is 104 of the H200's 139 GiB; the step planned 85.7 GiB unrolled
# and 108.4 scanned with `dots_kernels`). Read when the backend starts, so set before the first
# device call.
GPU_MEMORY_FRACTION = "0.92"
SMOKE = BenchSetup("tiny", batch=2, seq_len=64, steps=3, warmup=1, remat="none")


def synthetic_batch(setup: BenchSetup, seed: int = 0) -> dict[str, np.ndarray]:
    """A training batch [batch, seq_len] of random bytes, DOCUMENTS_PER_ROW documents per row."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, setup.seq_len), (setup.batch, DOCUMENTS_PER_ROW - 1),
                              replace=False), axis=1)
    segment_ids = 1 + (np.arange(setup.seq_len)[None, :, None] >= cuts[:, None, :]).sum(-1)
    starts = np.concatenate([np.zeros((setup.batch, 1), int), cuts], axis=1)
    positions = np.arange(setup.seq_len)[None] - np.take_along_axis(starts, segment_ids - 1, 1)
    rows = {
        "tokens": rng.integers(0, 256, (setup.batch, setup.seq_len)).astype(np.int32),
        "target_mask": np.ones((setup.batch, setup.seq_len), np.float32),
        "tokens_segment_ids": segment_ids.astype(np.int32),
        "tokens_positions": positions.astype(np.int32),
    }
    return finalize_batch(rows)


def compile_step(trainer: Trainer, batch: dict, compiler_options: dict | None = None
                 ) -> tuple[jax.stages.Compiled, dict[str, float]]:
    """The training step compiled ahead of time for `batch` (placed on the mesh), and the seconds
    it took: {compile_seconds: all of it, lowering_seconds: the part before XLA's compile (tracing
    and lowering, the Mosaic GPU kernels' lowering included)}."""
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        lowered = trainer.train_step.lower(trainer.state, batch)
        lowering_seconds = time.perf_counter() - start
        compiled = lowered.compile(compiler_options)
    return compiled, dict(compile_seconds=time.perf_counter() - start,
                          lowering_seconds=lowering_seconds)


def memory_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's memory plan of a compiled program per device, in GiB: arguments, outputs, the part of
    the outputs written into donated arguments (alias), temporaries, and their peak sum."""
    stats = compiled.memory_analysis()
    gib = {name: getattr(stats, f"{name}_size_in_bytes") / GIB
           for name in ("argument", "output", "alias", "temp")}
    gib["peak"] = gib["argument"] + gib["output"] - gib["alias"] + gib["temp"]
    return gib


def device_memory_limit() -> float | None:
    """GiB the default device's allocator may hand out (None where the backend does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_limit"] / GIB if "bytes_limit" in stats else None


def shrink_hint(setup: BenchSetup) -> str:
    """The command-line options that make the step need less device memory."""
    options = [] if setup.remat == "full" else [
        "--remat full (each layer keeps only its input and recomputes its forward)"]
    if setup.remat == "dots_kernels":
        options.insert(0, "--remat dots (the kernels' forwards are recomputed)")
    if setup.batch > 1:
        options.append(f"--batch {setup.batch // 2}")
    if not options:
        return "the step is already at its smallest here; use a smaller preset or --seq-len"
    return "rerun with " + " or ".join(options)


def preflight(compiled: jax.stages.Compiled, times: dict[str, float], setup: BenchSetup) -> dict:
    """Prints XLA's memory plan of the compiled step and `compile_step`'s times; raises if the plan
    exceeds the device's limit."""
    memory = memory_analysis(compiled)
    limit = device_memory_limit()
    print(
        f"preflight: step compiled in {times['compile_seconds']:.1f} s "
        f"({times['lowering_seconds']:.1f} s of it tracing and lowering); XLA memory per device: "
        f"arguments {memory['argument']:.2f} GiB, outputs {memory['output']:.2f} GiB "
        f"({memory['alias']:.2f} GiB of them in donated arguments), temporaries "
        f"{memory['temp']:.2f} GiB; peak "
        f"{memory['peak']:.2f} GiB" + ("" if limit is None else f" of {limit:.2f} GiB"),
        flush=True,
    )
    if limit is not None and memory["peak"] > limit:
        raise RuntimeError(
            f"the {setup.preset} step at {setup.batch} x {setup.seq_len} tokens with remat "
            f"{setup.remat} needs {memory['peak']:.1f} GiB, more than the {limit:.1f} GiB the "
            f"device allocator has; {shrink_hint(setup)}"
        )
    return memory


@contextlib.contextmanager
def explained_out_of_memory(setup: BenchSetup, memory: dict):
    """Re-raises a device out-of-memory error with the options that shrink the step."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise RuntimeError(
            f"out of device memory running the {setup.preset} step at {setup.batch} x "
            f"{setup.seq_len} tokens with remat {setup.remat} (XLA planned a peak of "
            f"{memory['peak']:.1f} GiB); {shrink_hint(setup)}"
        ) from error


def step_runner(trainer: Trainer, compiled: jax.stages.Compiled,
                batch: dict) -> Callable[[], dict]:
    """A call of the compiled step on the placed `batch` that advances the trainer's state and
    returns the step's metrics."""

    def run():
        with jax.set_mesh(trainer.mesh):
            trainer.state, metrics = compiled(trainer.state, batch)
        return metrics

    return run


def time_layer(layer: nnx.Module, call: Callable, x: jax.Array, segment_ids: jax.Array,
               setup: BenchSetup) -> float:
    """Median seconds of one forward and backward of `call(layer, x, segment_ids)` [B, T, D],
    recomputed in the backward pass as `setup.remat` says (as the step does per layer)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    cotangent = jax.random.normal(jax.random.key(1), x.shape, x.dtype)
    policy = REMAT[setup.remat]

    @jax.jit
    def forward_backward(params, x):
        def loss(params, x):
            y = call(nnx.merge(graphdef, params, rest), x, segment_ids)
            return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

        if policy is not None:
            loss = jax.checkpoint(loss, policy=policy)
        return jax.grad(loss, argnums=(0, 1))(params, x)

    return median_seconds(lambda: forward_backward(params, x), setup.steps, setup.warmup)


def layer_breakdown(cfg: ModelConfig, setup: BenchSetup):
    """Yields (part, number of layers, seconds of one layer's forward + backward) for each of
    KDA, attention and MoE as soon as it is timed."""
    dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.parameter_dtype)
    key_x, _ = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (setup.batch, setup.seq_len, cfg.d_model)).astype(
        cfg.compute_dtype)
    segment_ids = jnp.asarray(synthetic_batch(setup)["segment_ids"])
    rngs = nnx.Rngs(0)
    parts = {
        "kda": (len(cfg.kda_layers), lambda: KDA(cfg.d_model, cfg.kda, rngs=rngs, **dtypes),
                lambda m, x, s: m(x, segment_ids=s)),
        "attention": (len(cfg.full_attn_layers),
                      lambda: GatedMLA(cfg.d_model, cfg.mla, rngs=rngs, **dtypes),
                      lambda m, x, s: m(x, segment_ids=s)),
        "moe": (cfg.num_layers - cfg.first_k_dense,
                lambda: StableLatentMoE(cfg.d_model, cfg.moe, rngs=rngs, **dtypes),
                lambda m, x, s: m(x, s)[0]),
    }
    for name, (count, build, call) in parts.items():
        if count:  # one layer alive at a time
            yield name, count, time_layer(build(), call, x, segment_ids, setup)


# XLA:CPU's memory plan of the GPU step (`--cpu-plan`). On CPU the GPU kernels would be replaced by
# XLA programs with other intermediates (the chunked KDA op, ragged_dot, attention that stores its
# [T, T] scores), so each kernel is replaced by an opaque stand-in that reads the kernel's operands
# and writes its results and residuals (keeping by reference the residuals that are operands, as
# the kernel's forward rule does), and whose backward reads the residuals and cotangents and writes
# the operands' cotangents. Only compiled, never run.


def _never_run(*_):
    raise RuntimeError("a GPU-kernel stand-in is compiled for XLA's memory plan, never run")


def _opaque(shapes, *operands):
    """Arrays shaped like `shapes` from a host call that XLA cannot see into, reading `operands`."""
    return jax.pure_callback(_never_run, shapes, *operands)


def opaque_stand_in(fwd_rule: Callable) -> Callable:
    """A differentiable stand-in of a kernel with the memory footprint of its `custom_vjp`.

    fwd_rule: the kernel's forward rule, `(*operands) -> (out, residuals)`, only traced (on any
    backend) for its shapes and for which residuals are operands or outputs.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def stand_in(avals, *operands):
        return _opaque(jax.eval_shape(fwd_rule, *operands)[0], *operands)

    def forward(avals, *operands):
        traced, (out_shape, residual_shape) = jax.make_jaxpr(fwd_rule, return_shape=True)(
            *operands)
        num_out = len(jax.tree.leaves(out_shape))
        out_vars = traced.jaxpr.outvars[:num_out]
        residual_vars = traced.jaxpr.outvars[num_out:]
        residual_shapes, residual_tree = jax.tree.flatten(residual_shape)
        # Where each residual comes from: an operand, an output, or the kernel's own write.
        sources = [("operand", traced.jaxpr.invars.index(v)) if v in traced.jaxpr.invars else
                   ("out", out_vars.index(v)) if v in out_vars else ("new", None)
                   for v in residual_vars]
        new_shapes = [s for s, (kind, _) in zip(residual_shapes, sources) if kind == "new"]
        out, new = _opaque((out_shape, new_shapes), *operands)
        flat_operands, flat_out, new = jax.tree.leaves(operands), jax.tree.leaves(out), iter(new)
        residuals = [flat_operands[i] if kind == "operand" else flat_out[i] if kind == "out"
                     else next(new) for kind, i in sources]
        return out, jax.tree.unflatten(residual_tree, residuals)

    def backward(avals, residuals, cotangent):
        floating = [aval is not None and jnp.issubdtype(aval[1], jnp.floating) for aval in avals]
        grads = iter(_opaque([jax.ShapeDtypeStruct(*aval) for aval, f in zip(avals, floating) if f],
                             residuals, cotangent))
        return tuple(next(grads) if f else None for f in floating)

    stand_in.defvjp(forward, backward)
    # An absent operand (None: no initial state, no segment ids) has no aval and no cotangent.
    return lambda *operands: stand_in(
        tuple(None if x is None else (x.shape, x.dtype) for x in operands), *operands)


def _cudnn_attention_fwd(q, k, v, bias):
    """The shapes of cuDNN flash attention's forward rule (`jax._src.cudnn`): out [B, T, H, Dv]
    and residuals q, k, v, the additive mask bias, the softmax statistics [B, H, T] float32 and
    out."""
    out = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    stats = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    return out, (q, k, v, bias, stats, out)


def _grouped_matmul_fwd(lhs, rhs, group_sizes):
    """The shapes of the Mosaic GPU grouped GEMM's forward rule (`moe.grouped_matmul`): out
    [M, N]; its residuals are its operands."""
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype), (lhs, rhs, group_sizes)


def _attention_stand_in(q, k, v, *, scale, segment_ids=None, implementation=None,
                        max_segments=None):
    """`models.attention.causal_document_attention` as the GPU runs it: cuDNN for 16-bit inputs
    (stood in with the dense document mask, whichever cuDNN path is configured: an upper bound
    for the packed one), XLA otherwise."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return _xla_attention(q, k, v, scale=scale, segment_ids=segment_ids,
                              implementation=implementation, max_segments=max_segments)
    v_dim = v.shape[-1]
    q, k, v = pad_head_dims(q, k, v)
    # cuDNN turns the document mask into an additive bias [B, 1, T, T] that its backward reads.
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    bias = jnp.where(same, jnp.asarray(0, q.dtype), jnp.finfo(q.dtype).min)
    return opaque_stand_in(_cudnn_attention_fwd)(q, k, v, bias)[..., :v_dim]


def _kda_stand_in(q, k, v, g, beta, initial_state, segment_ids, options):
    """The Mosaic GPU bounded-gate KDA (`kda.kernels.mosaic_gpu.op`), stood in."""
    fwd_rule = functools.partial(kda_mosaic_gpu._bounded_kda_fwd, options=options)
    return opaque_stand_in(fwd_rule)(q, k, v, g, beta, initial_state, segment_ids)


def _stand_in_kda_kernel(q, k, v, g, beta, **kwargs):
    path = kda_mosaic_gpu._PATH._replace(bounded_kda=_kda_stand_in)
    return kernel_kda(path, q, k, v, g, beta, **kwargs)


@contextlib.contextmanager
def gpu_kernel_stand_ins():
    """Within: KDA, the MoE grouped matmuls and attention take opaque stand-ins of their H200
    kernels (Mosaic GPU KDA, Mosaic GPU grouped GEMMs, cuDNN flash attention) on any backend."""
    with contextlib.ExitStack() as stack:
        patch = lambda *args: stack.enter_context(mock.patch.object(*args))  # noqa: E731
        patch(kda_api, "_KERNELS", [])  # a registry of the stand-in alone, restored on exit
        kda_api.register_kernel("gpu_stand_in", _stand_in_kda_kernel,
                                kda_mosaic_gpu.covers_shapes)
        # The recurrence's split into segments follows the H200's SMs, not this machine's cores.
        patch(sequence_parallel, "_multiprocessor_count", lambda: sequence_parallel.HOPPER_SM_COUNT)
        patch(grouped_matmul, "_on_hopper", lambda: True)
        patch(grouped_matmul, "_mosaic_grouped_matmul", opaque_stand_in(_grouped_matmul_fwd))
        patch(attention, "causal_document_attention", _attention_stand_in)
        # The stand-ins are host calls: `dots_kernels` keeps their outputs as it would the kernels'.
        patch(models_lm, "KERNEL_PRIMITIVES", models_lm.KERNEL_PRIMITIVES | {"pure_callback"})
        yield


def train_config(setup: BenchSetup, optimizer: str) -> TrainConfig:
    """The one-device training run of `setup`, its `settings` applied (ValueError for a bad
    one, `train.cli.apply_overrides`)."""
    return apply_overrides(TrainConfig(
        model=preset(setup.preset, remat=setup.remat, scan_layers=setup.scan_layers),
        data=DataConfig(seq_len=setup.seq_len, batch_size=setup.batch),
        optim=OptimConfig(optimizer=optimizer),
        steps=1000,
        mesh=MeshConfig(data=1),
        progress=False,
    ), setup.settings)


def cpu_plan(setup: BenchSetup, optimizer: str) -> dict:
    """Compiles the step of `setup` on this machine with the GPU kernels stood in
    (`gpu_kernel_stand_ins`), its state abstract (nothing allocated, nothing run), and prints
    XLA's memory plan and the compile time: {compile_seconds, lowering_seconds, memory_gib}."""
    trainer = Trainer.create(train_config(setup, optimizer), abstract=True)
    with gpu_kernel_stand_ins():
        compiled, times = compile_step(trainer, trainer.place(synthetic_batch(setup)))
    memory = memory_analysis(compiled)
    print(f"cpu plan ({jax.devices()[0].platform}, GPU kernels stood in): {setup.preset} step at "
          f"{setup.batch} x {setup.seq_len}, remat {setup.remat}, "
          f"{'scanned' if setup.scan_layers else 'unrolled'}: compiled in "
          f"{times['compile_seconds']:.1f} s; "
          + ", ".join(f"{name} {gib:.2f} GiB" for name, gib in memory.items()), flush=True)
    return {**times, "memory_gib": memory}


def compiled_trainer(config: TrainConfig, setup: BenchSetup, compiler_options: dict | None = None):
    """A trainer of `config`, the placed synthetic batch and its step compiled ahead of time
    (the preflight printed), and {compile_seconds, lowering_seconds, memory_gib}."""
    trainer = Trainer.create(config)
    batch = trainer.place(synthetic_batch(setup))
    compiled, times = compile_step(trainer, batch, compiler_options)
    return trainer, batch, compiled, {**times, "memory_gib": preflight(compiled, times, setup)}


def timed_step(step: Callable[[], dict], setup: BenchSetup, flops_per_token: float) -> dict:
    """Times `step` (`step_runner`) both ways, prints and returns {step_seconds (one in flight),
    waited_step_seconds, tokens_per_second, model_tflops_per_second, mfu}."""
    waited_step_seconds = median_seconds(step, setup.steps, setup.warmup)
    step_seconds = pipelined_seconds(step, setup.steps, warmup=0)  # warm already
    tokens_per_second = setup.tokens / step_seconds
    numbers = dict(
        step_seconds=step_seconds,
        waited_step_seconds=waited_step_seconds,
        tokens_per_second=tokens_per_second,
        model_tflops_per_second=tokens_per_second * flops_per_token / 1e12,
        mfu=tokens_per_second * flops_per_token / HOPPER_PEAK_FLOPS,
    )
    print(f"step: {1e3 * step_seconds:.1f} ms with one in flight ({1e3 * waited_step_seconds:.1f}"
          f" ms each waited for), {tokens_per_second:,.0f} tokens/s, "
          f"{numbers['model_tflops_per_second']:.1f} TFLOP/s, MFU {100 * numbers['mfu']:.1f}%",
          flush=True)
    return numbers


def versus_step(setup: BenchSetup, optimizer: str) -> dict:
    """The step with `setup.versus` applied on top of its settings, built, compiled and timed
    in this process after the first one is freed: an A/B on one machine (two machines of one
    kind have timed one program 10 ms apart)."""
    settings = setup.settings + setup.versus
    print("versus: the same step with --set " + " --set ".join(setup.versus), flush=True)
    config = train_config(dataclasses.replace(setup, settings=settings), optimizer)
    trainer, batch, compiled, compiled_result = compiled_trainer(config, setup)
    with explained_out_of_memory(setup, compiled_result["memory_gib"]):
        flops = train_flops_per_token(config.model, setup.seq_len)["total"]
        numbers = timed_step(step_runner(trainer, compiled, batch), setup, flops)
    return {"settings": list(setup.versus), **compiled_result, **numbers}


def run(setup: BenchSetup, optimizer: str,
        report: Callable[[dict], None] = lambda result: None, profile: bool = False) -> dict:
    """Compiles and times the step, then the step with `setup.versus` (if any), then the layers
    (if `setup.layers`); calls `report(result so far)` whenever a number is added, so a run cut
    short keeps what it measured. With `profile`, the step is compiled for profiling
    (`experiments.profiling.profile_compiler_options`) and its top device ops are traced after
    it is timed."""
    config = train_config(setup, optimizer)
    cfg = config.model
    flops = train_flops_per_token(cfg, setup.seq_len)
    result = {
        "setup": dataclasses.asdict(setup),
        "optimizer": optimizer,
        "params": {k: count_params(cfg)[k] for k in ("total", "active", "embedding")},
        "flops_per_token": flops,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "profiled": profile,
        "date": datetime.date.today().isoformat(),
    }
    trainer, batch, compiled, compiled_result = compiled_trainer(
        config, setup, profile_compiler_options() if profile else None)
    result.update(compiled_result)
    report(result)
    with explained_out_of_memory(setup, result["memory_gib"]):
        step = step_runner(trainer, compiled, batch)
        result.update(timed_step(step, setup, flops["total"]), breakdown={})
        report(result)
        if profile:
            result["ops"] = trace_device_ops(step, compiled, PROFILED_STEPS, PROFILED_OPS,
                                             scopes=PROFILE_SCOPES,
                                             top_per_scope=PROFILED_OPS_PER_PART)
            print("in-step device time by part: " + ", ".join(
                f"{scope} {ms:.1f} ms" for scope, ms in result["ops"]["scopes"].items() if ms > 0
            ), flush=True)
            print(idle_summary_line(result["ops"]), flush=True)
            report(result)
        del trainer, compiled, batch, step
    if setup.versus:
        result["versus"] = versus_step(setup, optimizer)
        report(result)
    if not setup.layers:
        return result
    step_seconds = result["step_seconds"]
    with explained_out_of_memory(setup, result["memory_gib"]):
        for name, count, seconds in layer_breakdown(cfg, setup):
            result["breakdown"][name] = _part(count, count * seconds, step_seconds,
                                              setup.tokens * flops[name])
            print(f"layer {name}: {1e3 * seconds:.2f} ms x {count} layers", flush=True)
            report(result)
    rest = step_seconds - sum(part["seconds_per_step"] for part in result["breakdown"].values())
    result["breakdown"]["rest"] = _part(None, rest, step_seconds, setup.tokens * flops["rest"])
    report(result)
    return result


def _part(layers: int | None, seconds: float, step_seconds: float, flops: float) -> dict:
    """One row of the breakdown: a part's seconds per step, share, and model FLOP rate."""
    return {
        "layers": layers,
        "seconds_per_step": seconds,
        "share": seconds / step_seconds,
        "model_tflops_per_second": flops / seconds / 1e12 if seconds > 0 else None,
    }


def markdown(result: dict, command: str) -> str:
    """The result as a markdown table; the parts a run cut short did not measure are left out."""
    setup = result["setup"]
    params = result["params"]
    lines = [
        f"# Training step benchmark: `{setup['preset']}` preset, {setup['batch']} x "
        f"{setup['seq_len']} tokens",
        "",
        f"`{command}` on {result['device']} (jax {result['jax']}, flax {result['flax']}, "
        f"{result['date']}); {format_count(params['total'])} parameters, "
        f"{format_count(params['active'])} active per token (embedding excluded); optimizer "
        f"{result['optimizer']}, remat {setup['remat']}, layers "
        f"{'scanned' if setup['scan_layers'] else 'unrolled'}"
        + "".join(f", --set {setting}" for setting in setup["settings"])
        + f"; median of {setup['steps']} steps.",
        "",
    ]
    if "memory_gib" in result:
        memory = result["memory_gib"]
        lines += [
            f"Compile {result['compile_seconds']:.0f} s ({result['lowering_seconds']:.0f} s of it "
            f"tracing and lowering). XLA memory plan per device: arguments "
            f"{memory['argument']:.2f} GiB, temporaries {memory['temp']:.2f} GiB, peak "
            f"{memory['peak']:.2f} GiB.",
            "",
        ]
    if "step_seconds" not in result:
        return "\n".join(lines + ["The run stopped before the step was timed."]) + "\n"
    lines += [
        "| step, one in flight | step, each waited for | tokens/s | model TFLOP/s | MFU (of 989 "
        "TFLOP/s) |",
        "|---|---|---|---|---|",
        f"| {1e3 * result['step_seconds']:.1f} ms | {1e3 * result['waited_step_seconds']:.1f} ms "
        f"| {result['tokens_per_second']:,.0f} | {result['model_tflops_per_second']:.1f} | "
        f"{100 * result['mfu']:.1f}% |",
        "",
        "Steps with one in flight are issued as `train.loop` issues them (the next dispatched "
        "before waiting for the last); tokens/s and MFU come from them.",
    ]
    if "versus" in result:
        versus = result["versus"]
        lines += [
            "",
            "The same step with `--set " + " --set ".join(versus["settings"]) + "`, built, "
            f"compiled ({versus['compile_seconds']:.0f} s, peak "
            f"{versus['memory_gib']['peak']:.2f} GiB) and timed after it in this process:",
            "",
            "| step | one in flight | each waited for | tokens/s | MFU |",
            "|---|---|---|---|---|",
        ]
        for name, run_result in (("as above", result), ("with the settings", versus)):
            lines.append(
                f"| {name} | {1e3 * run_result['step_seconds']:.1f} ms | "
                f"{1e3 * run_result['waited_step_seconds']:.1f} ms | "
                f"{run_result['tokens_per_second']:,.0f} | {100 * run_result['mfu']:.1f}% |")
    if result["setup"]["layers"]:
        lines += [
            "",
            "Breakdown (one layer of each kind timed alone, forward + backward under the same "
            "remat, times its number of layers; rest = the step minus those):",
            "",
            "| part | layers | ms per step | share of step | model TFLOP/s in the part |",
            "|---|---|---|---|---|",
        ]
        for name, part in result["breakdown"].items():
            rate = part["model_tflops_per_second"]
            lines.append(
                f"| {name} | {part['layers'] or ''} | {1e3 * part['seconds_per_step']:.1f} | "
                f"{100 * part['share']:.0f}% | {'' if rate is None else f'{rate:.1f}'} |"
            )
        if "rest" not in result["breakdown"]:
            lines += ["", "The run stopped before every layer was timed."]
    if "ops" in result:
        lines += ["", "## Where the step's device time goes (`--profile`)", ""]
        lines += scopes_markdown(result["ops"], IN_STEP_TITLE)
        lines += idle_markdown(result["ops"])
        lines += ops_markdown(
            result["ops"], "Top device ops of the step, compiled without command buffers (the "
            "timed step above was compiled the same way)")
        lines += scope_ops_markdown(
            result["ops"], "The costliest device ops of each part, each row one op summed over "
            "the layers that run it (the same opcode, shape and source op; `+n`: how many more):")
    return "\n".join(lines) + "\n"


def write_result(result: dict, command: str, out: str) -> None:
    """The markdown table at `out`, the numbers next to it as .json (both replaced whole)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(markdown(result, command))
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(result, f, indent=2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_train",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--gpu", action="store_true",
                      help=f"the {GPU.preset} preset at {GPU.batch} x {GPU.seq_len} tokens")
    size.add_argument("--smoke", action="store_true", help="a tiny size, for a CPU check")
    parser.add_argument("--batch", type=int, help="rows per step (overrides the size's)")
    parser.add_argument("--seq-len", type=int, help="tokens per row (overrides the size's)")
    parser.add_argument("--steps", type=int, help="timed steps (overrides the size's)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--remat", choices=tuple(REMAT),
                        help=f"recomputation policy of each layer (--gpu: {GPU.remat}, --smoke: "
                        f"{SMOKE.remat})")
    parser.add_argument("--scanned", action="store_true",
                        help="scan repeated layer groups (compiles faster, steps slower) instead "
                        "of compiling every layer on its own")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a field of the run's TrainConfig, e.g. --set "
                        "model.mla.implementation=cudnn (repeatable; the preset, batch, "
                        "length and remat come from the options above)")
    parser.add_argument("--cpu-plan", action="store_true",
                        help="only compile the step here, GPU kernels stood in, and print XLA's "
                        "memory plan and the compile time (nothing is allocated or run)")
    parser.add_argument("--profile", action="store_true",
                        help="compile the step without command buffers and add its device time by "
                        "part (named scope), its top device ops and its idle gaps (a "
                        f"jax.profiler trace of {PROFILED_STEPS} steps) to the table")
    parser.add_argument("--versus", metavar="KEY=VALUE", action="append", default=[],
                        help="after the step, time it again with this TrainConfig override "
                        "added (repeatable), in the same process: an A/B on one machine")
    parser.add_argument("--no-layers", action="store_true",
                        help="time the step only, not each layer kind alone (the breakdown)")
    parser.add_argument("--out", help="write the markdown table here (--gpu default: "
                        "benchmarks/train_h200.md) and the numbers next to it as .json, "
                        "rewritten as each number is measured")
    args = parser.parse_args(argv)
    setup = GPU if args.gpu else SMOKE
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len),
                                   ("steps", args.steps), ("remat", args.remat)) if v is not None}
    setup = dataclasses.replace(setup, scan_layers=args.scanned, settings=tuple(args.set),
                                layers=not args.no_layers, versus=tuple(args.versus),
                                **overrides)
    if args.gpu:  # before anything starts the backend, which reads it once
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    try:
        train_config(setup, args.optimizer)
    except ValueError as error:
        parser.error(f"--set {error}")
    try:
        train_config(dataclasses.replace(setup, settings=setup.settings + setup.versus),
                     args.optimizer)
    except ValueError as error:
        parser.error(f"--versus {error}")
    if args.cpu_plan:
        return cpu_plan(setup, args.optimizer)
    command = command_line("experiments.bench_train", argv)
    out = args.out or ("benchmarks/train_h200.md" if args.gpu else None)
    report = (lambda result: None) if out is None else (
        lambda result: write_result(result, command, out))
    result = run(setup, args.optimizer, report, profile=args.profile)
    print(markdown(result, command))
    return result


if __name__ == "__main__":
    main()
