"""Benchmark: the full training step of the hybrid on one device, in tokens/s and MFU, with a
breakdown of where the time goes (KDA, Gated MLA attention, MoE, rest).

    python -m experiments.bench_train --gpu              # `1b`, 6 x 4096 tokens, bf16, remat
                                                         # dots_kernels, unrolled -> benchmarks/
    python -m experiments.bench_train --smoke            # `tiny` at a tiny size (CPU check)
    python -m experiments.bench_train --gpu --cpu-plan   # compile only, here: XLA's memory plan
    python -m experiments.bench_train --gpu --profile    # + device time by part and top ops
    python -m experiments.bench_train --gpu --versus model.kda.conv_kernels=false
                                                         # A/B of an override in one process
    python -m experiments.bench_train --gpu --set model.mla.implementation=cudnn
    python -m experiments.bench_train --gpu --long       # one row of 128K..1M tokens, the
                                                         # memory-lean policy -> benchmarks/

The step is the real one (`train.loop.Trainer`: forward, backward, AdamW, the QB router-bias
update, the non-finite check) on one reused synthetic batch (random bytes, four packed documents a
row), so the input pipeline is not measured. Step time is the median of `--steps` steps issued as
`train.loop` issues them, each dispatched before the previous one is waited for
(`pipelined_seconds`); the table also gives the waited median (`median_seconds`). MFU = model
FLOPs (`train.metrics.train_flops_per_token`) per second over the dense bf16 peak of the device.

Preflight: the step is compiled ahead of time and XLA's memory analysis printed (arguments,
outputs, temporaries, peak, the device's limit) before any step runs; a plan over the limit stops
there, and an out-of-memory error names the options that shrink the step (`--remat full`, a
smaller `--batch`). `--cpu-plan` compiles the same step on the CPU with abstract state and the GPU
kernels replaced by opaque stand-ins of the same operands and results (`gpu_kernel_stand_ins`), so a
memory plan for a GPU shape needs no GPU (an upper bound: XLA:CPU fuses less). Every number is
printed as soon as it is measured and the table and JSON rewritten each time, so a run cut short
keeps what it measured. Why the `--gpu` defaults (remat, rows, unrolled layers) are what they are,
with the plans and timings behind them: `benchmarks/train_notes.md`.

`--long` steps one row of each of `LONG_LENGTHS` tokens with the memory-lean policy (`LONG_POLICY`:
layer inputs offloaded to host, the loss, KDA and the MoE in token chunks): for each length the
planner's estimate (`models.memory`), XLA's plan, and, where the plan fits, the step's time and
measured peak; a length that does not fit is recorded with where its memory goes, and the next one
is still tried. `--preset small` for the fallback the million-token issue names.

Breakdown: one KDA, one Gated MLA and one MoE layer are timed alone (forward and backward under the
same remat policy) times their number of layers; "rest" is the step minus those. `--profile` traces
a few steps and sums each device op's time under the innermost named scope of
`models.lm.PROFILE_SCOPES` (`experiments.profiling.scope_times`): the parts inside the real step,
then the costliest ops and the device's idle time between ops.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.harness import (cell, command_line, gpu_table, median_seconds,
                                 pipelined_seconds, write_json, write_markdown)
from experiments.profiling import (idle_markdown, idle_summary_line, ops_markdown,
                                   profile_compiler_options, scope_ops_markdown, scopes_markdown,
                                   trace_device_ops)
from kda import api as kda_api
from kda import layer as kda_layer
from kda.kernels.mosaic_gpu import op as kda_mosaic_gpu
from kda.kernels.mosaic_gpu import sequence_parallel
from kda.kernels.path import kernel_kda
from kda.kernels.triton import short_conv
from kda.layer import KDA
from models import attention
from models import lm as models_lm
from models.attention import GatedMLA
from models.attention import causal_document_attention as _xla_attention
from models.config import ModelConfig, count_params, format_count, preset
from models.memory import plan_memory
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
# is set: JAX's default, 0.75, leaves too little for the `dots_kernels` step's plan
# (`benchmarks/train_notes.md`). Read when the backend starts, so set before the first device call.
GPU_MEMORY_FRACTION = "0.92"
SMOKE = BenchSetup("tiny", batch=2, seq_len=64, steps=3, warmup=1, remat="none")
# `--long`: one row per length, few steps (a million-token step takes seconds), no layer breakdown.
LONG_LENGTHS = (131072, 262144, 524288, 1048576)
LONG_SMOKE_LENGTHS = (256, 512)
LONG = BenchSetup("1b", batch=1, seq_len=LONG_LENGTHS[0], steps=3, warmup=1, remat="offload",
                  layers=False)
# The memory-lean settings of `--long` (`--set` adds to or overrides them), in tokens per chunk:
# the LM head and loss, KDA's recomputed segments, the MoE's per-token work.
LONG_POLICY = ("loss_chunk_tokens=8192", "model.kda.segment_tokens=65536",
               "model.moe.token_chunk=65536")
LONG_SMOKE_POLICY = ("loss_chunk_tokens=128", "model.kda.segment_tokens=128",
                     "model.moe.token_chunk=128")


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


def _packed_cudnn_fwd(q, k, v, offsets, lengths):
    """The shapes of cuDNN's packed flash attention forward rule (`jax._src.cudnn`): out
    [B, T, H, D] and residuals q, k, v, out and the softmax statistics [B * M, H, T] float32."""
    out = jnp.zeros_like(q)
    stats = jnp.zeros((q.shape[0] * lengths.shape[1], q.shape[2], q.shape[1]), jnp.float32)
    return out, (q, k, v, out, stats)


def _packed_cudnn_stand_in(q, k, v, segments, *, scale, causal=True):
    """`models.attention.packed_cudnn_attention`, stood in."""
    return opaque_stand_in(_packed_cudnn_fwd)(q, k, v, segments.offsets, segments.lengths)


def _grouped_matmul_fwd(lhs, rhs, group_sizes):
    """The shapes of the Mosaic GPU grouped GEMM's forward rule (`moe.grouped_matmul`): out
    [M, N]; its residuals are its operands."""
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype), (lhs, rhs, group_sizes)


def _attention_stand_in(q, k, v, *, scale, segment_ids=None, implementation=None,
                        max_segments=None):
    """`models.attention.causal_document_attention` as a Hopper GPU runs it: cuDNN's packed layout
    for 16-bit inputs (stood in) with its plain-JAX fallback, XLA otherwise."""
    if q.dtype in (jnp.bfloat16, jnp.float16) and segment_ids is not None:
        implementation = "cudnn_segments"
    return _xla_attention(q, k, v, scale=scale, segment_ids=segment_ids,
                          implementation=implementation, max_segments=max_segments)


def _conv_silu_fwd(x, weight, document, widths):
    """The shapes of the short convolution's Triton kernels' forward rule (`kda.layer`): the
    parts [B, T, width] of x's dtype; its residuals are its operands."""
    parts = tuple(jnp.zeros(x.shape[:2] + (width,), x.dtype) for width in widths)
    return parts, (x, weight, document)


def _conv_silu_stand_in(x, weight, document, widths):
    """`kda.layer._conv_silu_kernels`, stood in."""
    return opaque_stand_in(functools.partial(_conv_silu_fwd, widths=widths))(x, weight, document)


def _kda_stand_in(q, k, v, g, beta, initial_state, segment_ids, options):
    """The Mosaic GPU bounded-gate KDA (`kda.kernels.mosaic_gpu.op`), stood in."""
    fwd_rule = functools.partial(kda_mosaic_gpu._bounded_kda_fwd, options=options)
    return opaque_stand_in(fwd_rule)(q, k, v, g, beta, initial_state, segment_ids)


def _stand_in_kda_kernel(q, k, v, g, beta, **kwargs):
    path = kda_mosaic_gpu._PATH._replace(bounded_kda=_kda_stand_in)
    return kernel_kda(path, q, k, v, g, beta, **kwargs)


@contextlib.contextmanager
def gpu_kernel_stand_ins():
    """Within: KDA, its short convolution, the MoE grouped matmuls and attention take opaque
    stand-ins of their H200 kernels (Mosaic GPU KDA, Triton, Mosaic GPU grouped GEMMs, cuDNN
    flash attention) on any backend."""
    with contextlib.ExitStack() as stack:
        patch = lambda *args: stack.enter_context(mock.patch.object(*args))  # noqa: E731
        patch(kda_api, "_KERNELS", [])  # a registry of the stand-in alone, restored on exit
        kda_api.register_kernel("gpu_stand_in", _stand_in_kda_kernel,
                                kda_mosaic_gpu.covers_shapes)
        # The recurrence's split into segments follows the H200's SMs, not this machine's cores.
        patch(sequence_parallel, "_multiprocessor_count", lambda: sequence_parallel.HOPPER_SM_COUNT)
        patch(kda_layer, "short_conv_kernel_runs",
              lambda shape, widths, width: short_conv.refusal(shape, widths, width) is None)
        patch(kda_layer, "_conv_silu_kernels", _conv_silu_stand_in)
        patch(grouped_matmul, "_on_hopper", lambda: True)
        patch(grouped_matmul, "_mosaic_grouped_matmul", opaque_stand_in(_grouped_matmul_fwd))
        patch(attention, "causal_document_attention", _attention_stand_in)
        patch(attention, "_require_packed_cudnn", lambda q: None)
        patch(attention, "packed_cudnn_attention", _packed_cudnn_stand_in)
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


def compiled_trainer(config: TrainConfig, setup: BenchSetup, compiler_options: dict | None = None,
                     batch: dict | None = None):
    """A trainer of `config`, the placed `batch` (default: the synthetic batch of `setup`) and its
    step compiled ahead of time (the preflight printed), and {compile_seconds, lowering_seconds,
    memory_gib}."""
    trainer = Trainer.create(config)
    batch = trainer.place(synthetic_batch(setup) if batch is None else batch)
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
    kind time one program apart by more than many changes are worth)."""
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


def long_row(setup: BenchSetup, optimizer: str) -> dict:
    """One `--long` row: the planner's estimate and XLA's plan of the step at `setup` and, where
    the plan fits the device, its timing and the allocator's measured peak. A length that does not
    fit is recorded (with the planner's breakdown) rather than raised."""
    config = train_config(setup, optimizer)
    plan = plan_memory(config.model, {}, batch_size=setup.batch, seq_len=setup.seq_len,
                       loss_chunk_tokens=config.loss_chunk_tokens)
    print(plan.report(), flush=True)
    row = {"seq_len": setup.seq_len, "planned_gib": plan.total / GIB,
           "planned_host_gib": plan.host_offload / GIB, "plan": plan.report()}
    try:
        trainer, batch, compiled, compiled_result = compiled_trainer(config, setup)
    except RuntimeError as error:  # the preflight's "needs more than the device has"
        return {**row, "note": str(error)}
    row.update(compiled_result)
    try:
        with explained_out_of_memory(setup, compiled_result["memory_gib"]):
            flops = train_flops_per_token(config.model, setup.seq_len)["total"]
            row.update(timed_step(step_runner(trainer, compiled, batch), setup, flops))
    except RuntimeError as error:
        row["note"] = str(error)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        row["measured_peak_gib"] = stats["peak_bytes_in_use"] / GIB
    return row


def run_long(setup: BenchSetup, lengths: Sequence[int], optimizer: str,
             report: Callable[[dict], None]) -> dict:
    """`long_row` at each length, longest last, freeing each step's arrays before the next;
    `report(result so far)` after each row."""
    result = {"setup": dataclasses.asdict(setup), "optimizer": optimizer, "rows": [],
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "flax": flax.__version__, "date": datetime.date.today().isoformat()}
    for length in lengths:
        print(f"--long: {setup.preset} at 1 x {length} tokens", flush=True)
        result["rows"].append(long_row(dataclasses.replace(setup, seq_len=length), optimizer))
        gc.collect()
        report(result)
    return result


def long_markdown(result: dict, command: str) -> str:
    """The `--long` table: per length, planned and measured memory, step time, tokens/s, MFU."""
    setup = result["setup"]
    lines = [
        f"# Long-context training step: `{setup['preset']}` preset, one row a step",
        "",
        f"`{command}` on {result['device']} (jax {result['jax']}, flax {result['flax']}, "
        f"{result['date']}); optimizer {result['optimizer']}, remat {setup['remat']}, layers "
        f"{'scanned' if setup['scan_layers'] else 'unrolled'}; settings "
        + ", ".join(f"`{s}`" for s in setup["settings"]) + f"; median of {setup['steps']} steps.",
        "",
        "Planned: `models.memory`'s estimate for the device (host: the layer inputs offloaded). "
        "XLA peak: the compiled step's memory analysis (arguments + outputs - aliased + "
        "temporaries). Measured peak: the allocator's high-water mark after the steps.",
        "",
        "| tokens | planned GiB (host) | XLA peak GiB | measured peak GiB | step s | tokens/s | "
        "MFU | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        xla = row.get("memory_gib", {}).get("peak")
        lines.append(
            f"| {row['seq_len']:,} | {row['planned_gib']:.1f} ({row['planned_host_gib']:.1f}) | "
            f"{cell(xla, '.1f')} | {cell(row.get('measured_peak_gib'), '.1f')} | "
            f"{cell(row.get('step_seconds'), '.2f')} | "
            f"{cell(row.get('tokens_per_second'), ',.0f')} | "
            f"{cell(None if 'mfu' not in row else 100 * row['mfu'], '.1f')} | "
            f"{row.get('note', '').splitlines()[0] if row.get('note') else ''} |")
    for row in result["rows"]:
        if "step_seconds" not in row:
            lines += ["", f"Where the memory goes at {row['seq_len']:,} tokens (the planner):",
                      "", "```", row["plan"], "```"]
    return "\n".join(lines) + "\n"


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


def write_result(result: dict, command: str, out: str | Path) -> None:
    """The markdown table at `out`, the numbers next to it as .json (both replaced whole)."""
    write_markdown(out, markdown(result, command))
    write_json(os.path.splitext(out)[0] + ".json", result)


def write_long_result(result: dict, command: str, out: str | Path) -> None:
    """`write_result` for `--long`."""
    write_markdown(out, long_markdown(result, command))
    write_json(os.path.splitext(out)[0] + ".json", result)


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
                        "memory plan and the compile time (nothing is allocated or run); with "
                        "--long, at each of --lengths")
    parser.add_argument("--profile", action="store_true",
                        help="compile the step without command buffers and add its device time by "
                        "part (named scope), its top device ops and its idle gaps (a "
                        f"jax.profiler trace of {PROFILED_STEPS} steps) to the table")
    parser.add_argument("--versus", metavar="KEY=VALUE", action="append", default=[],
                        help="after the step, time it again with this TrainConfig override "
                        "added (repeatable), in the same process: an A/B on one machine")
    parser.add_argument("--no-layers", action="store_true",
                        help="time the step only, not each layer kind alone (the breakdown)")
    parser.add_argument("--long", action="store_true",
                        help="one row of each --lengths tokens with the memory-lean policy "
                        "(--gpu: benchmarks/long_context_<card>.md); with --smoke, tiny lengths")
    parser.add_argument("--lengths", type=int, nargs="+", metavar="T",
                        help=f"--long's tokens per row (--gpu: {' '.join(map(str, LONG_LENGTHS))})")
    parser.add_argument("--preset", help="the model preset (--gpu and --long: 1b, --smoke: tiny)")
    parser.add_argument("--out", help="write the markdown table here (--gpu default: "
                        "benchmarks/train_<card>.md) and the numbers next to it as .json, "
                        "rewritten as each number is measured")
    args = parser.parse_args(argv)
    if args.lengths and not args.long:
        parser.error("--lengths sets --long's lengths; add --long")
    if args.long and (args.versus or args.profile or args.seq_len):
        parser.error("--long runs its own lengths (--lengths); drop --versus, --profile and "
                     "--seq-len")
    if args.long:
        setup = LONG if args.gpu else dataclasses.replace(LONG, preset=SMOKE.preset)
        policy = LONG_POLICY if args.gpu else LONG_SMOKE_POLICY
        lengths = args.lengths or (LONG_LENGTHS if args.gpu else LONG_SMOKE_LENGTHS)
        settings = policy + tuple(args.set)
    else:
        setup = GPU if args.gpu else SMOKE
        settings = tuple(args.set)
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len),
                                   ("steps", args.steps), ("remat", args.remat),
                                   ("preset", args.preset)) if v is not None}
    setup = dataclasses.replace(setup, scan_layers=args.scanned, settings=settings,
                                layers=setup.layers and not args.no_layers,
                                versus=tuple(args.versus), **overrides)
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
    if args.cpu_plan:  # with --long, each of its lengths
        if not args.long:
            return cpu_plan(setup, args.optimizer)
        return [cpu_plan(dataclasses.replace(setup, seq_len=length), args.optimizer)
                for length in lengths]
    command = command_line("experiments.bench_train", argv)
    if args.long:
        out = args.out or (gpu_table("long_context") if args.gpu else None)
        report = (lambda result: None) if out is None else (
            lambda result: write_long_result(result, command, out))
        result = run_long(setup, lengths, args.optimizer, report)
        print(long_markdown(result, command))
        return result
    out = args.out or (gpu_table("train") if args.gpu else None)
    report = (lambda result: None) if out is None else (
        lambda result: write_result(result, command, out))
    result = run(setup, args.optimizer, report, profile=args.profile)
    print(markdown(result, command))
    return result


if __name__ == "__main__":
    main()
