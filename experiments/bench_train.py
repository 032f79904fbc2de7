"""Benchmark: the full training step of the hybrid on one device, in tokens/s and MFU, with a
breakdown of where the time goes (KDA, Gated MLA attention, MoE, rest).

    python -m experiments.bench_train --gpu     # H200: `1b` preset, 4 rows x 4096 tokens,
                                                # bf16 compute, remat dots
                                                # -> benchmarks/train_h200.md
    python -m experiments.bench_train --smoke   # `tiny` preset at a tiny size (CPU check)

The step is the real one (`train.loop.Trainer`: forward, backward, AdamW, the QB router-bias
update, the non-finite check) on one reused synthetic batch (random bytes, four packed documents
per row), so the input pipeline is not measured. Time = median of `--steps` steps after
`--warmup` compiled ones. MFU = model FLOPs (`train.metrics.train_flops_per_token`: 6 per active
parameter plus the KDA recurrence and causal attention scores) per second over 989 TFLOP/s, the
H100/H200 dense bf16 peak.

Preflight: before any step runs, the step is compiled ahead of time and XLA's memory analysis is
printed (arguments, outputs, temporaries, the peak they add up to, and the device's limit), so a
run reports its memory even if it then fails; a peak over the limit stops the run there, and an
out-of-memory error names the options that shrink the step (`--remat full`, a smaller `--batch`).
The timed steps reuse that compiled program.

Why the `--gpu` setup uses remat `dots` (each layer keeps its matmul outputs and recomputes the
rest in the backward pass, `models.lm.REMAT`): with no remat the first H200 run failed, XLA asking
for 66.4 GiB of temporaries on top of the 41.6 GiB of arguments (float32 parameters, 13.9 GiB,
and AdamW moments, 27.7 GiB, of 3.72B parameters) against the 104 GiB that JAX's allocator takes
by default (75% of 139 GiB). Compiled on CPU at the same shapes, with the GPU kernels (KDA, grouped
matmuls, cuDNN attention) replaced by opaque calls with the same operands and results, XLA plans
these temporaries besides the arguments (float32 gradients included):

    remat            4 x 4096: backward / optimizer update     2 x 4096: backward
    none             133.5 GiB / -                             70.4 GiB
    dots              27.0 GiB / 28.8 GiB
    dots_no_batch     25.9 GiB / 28.8 GiB
    full              23.8 GiB / 28.8 GiB

XLA:CPU fuses less than XLA:GPU (with no remat it keeps every float32 intermediate of the norms,
gates and routing): for the step as it was then (moments copied, KDA preparation differentiated
in plain JAX) this estimate gives 180 GiB of temporaries where the GPU planned 66.4. So these are
upper bounds: with `dots` the step should need at most about 70 GiB, a clear margin under
104 GiB, where no remat needs up to 175 GiB at 4 rows (112 GiB at 2). Every policy recomputes
the kernels' forwards (custom VJPs are opaque to it); `dots` recomputes the least besides
(elementwise work, norms, routing), so of the policies that fit it costs the least speed. The
step also no longer copies the AdamW moments (27.7 GiB) for its non-finite-step check:
`train.step` applies the update under `lax.cond`.

Compile time: the layers are scanned (`scan_layers`; `models.lm.layer_plan`): in the `1b`
preset layers 1-12 are three repeats of one four-layer group, compiled once, so XLA compiles 8
layer bodies instead of 16. With every layer unrolled, XLA's compile of the step on the H200
took 3.5 min in the first run and had not ended after 190 s in the second.

Breakdown: one KDA, one Gated MLA and one MoE layer of the same configuration are timed alone
(forward and backward of a fixed random input and cotangent, under the same remat policy, median
of the same number of steps), times their number of layers; "rest" is the step minus those parts:
the dense FFN, the embedding and LM head, norms, AttnRes, the loss, the optimizer and the bias
update.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kda.layer import KDA
from models.attention import GatedMLA
from models.config import ModelConfig, count_params, format_count, preset
from models.lm import REMAT
from moe.experts import StableLatentMoE
from train.data import DataConfig
from train.loop import MeshConfig, TrainConfig, Trainer
from train.metrics import HOPPER_PEAK_FLOPS, train_flops_per_token
from train.optim import OptimConfig
from train.packing import finalize_batch

DOCUMENTS_PER_ROW = 4


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
    scan_layers: bool = True  # one compiled body per repeated layer group (see the docstring)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


# The module docstring says why the GPU setup recomputes with `dots`.
GPU = BenchSetup("1b", batch=4, seq_len=4096, steps=20, warmup=3, remat="dots")
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


def median_seconds(run: Callable[[], object], steps: int, warmup: int) -> float:
    """Median wall time of `run()` (which must return arrays to wait for) after warm-up calls."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compile_step(trainer: Trainer, batch: dict) -> tuple[jax.stages.Compiled, float]:
    """The training step compiled ahead of time for `batch` (placed on the mesh), and the
    seconds the compile took."""
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        compiled = trainer.train_step.lower(trainer.state, batch).compile()
    return compiled, time.perf_counter() - start


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
    if setup.batch > 1:
        options.append(f"--batch {setup.batch // 2}")
    if not options:
        return "the step is already at its smallest here; use a smaller preset or --seq-len"
    return "rerun with " + " or ".join(options)


def preflight(compiled: jax.stages.Compiled, seconds: float, setup: BenchSetup) -> dict:
    """Prints XLA's memory plan of the compiled step; raises if it exceeds the device's limit."""
    memory = memory_analysis(compiled)
    limit = device_memory_limit()
    print(
        f"preflight: step compiled in {seconds:.1f} s; XLA memory per device: arguments "
        f"{memory['argument']:.2f} GiB, outputs {memory['output']:.2f} GiB ({memory['alias']:.2f} "
        f"GiB of them in donated arguments), temporaries {memory['temp']:.2f} GiB; peak "
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


def time_train_step(trainer: Trainer, compiled: jax.stages.Compiled, batch: dict,
                    setup: BenchSetup) -> float:
    """Median seconds of the compiled step on the placed `batch` (the state advances)."""

    def run():
        with jax.set_mesh(trainer.mesh):
            trainer.state, metrics = compiled(trainer.state, batch)
        return metrics

    return median_seconds(run, setup.steps, setup.warmup)


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


def layer_breakdown(cfg: ModelConfig, setup: BenchSetup) -> dict[str, tuple[int, float]]:
    """{part: (number of layers, seconds of one layer's forward + backward)}."""
    dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.parameter_dtype)
    key_x, _ = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (setup.batch, setup.seq_len, cfg.d_model)).astype(
        cfg.compute_dtype)
    segment_ids = jnp.asarray(synthetic_batch(setup)["segment_ids"])
    rngs = nnx.Rngs(0)
    parts = {
        "kda": (len(cfg.kda_layers), KDA(cfg.d_model, cfg.kda, rngs=rngs, **dtypes),
                lambda m, x, s: m(x, segment_ids=s)),
        "attention": (len(cfg.full_attn_layers), GatedMLA(cfg.d_model, cfg.mla, rngs=rngs,
                                                          **dtypes),
                      lambda m, x, s: m(x, segment_ids=s)),
        "moe": (cfg.num_layers - cfg.first_k_dense,
                StableLatentMoE(cfg.d_model, cfg.moe, rngs=rngs, **dtypes),
                lambda m, x, s: m(x, s)[0]),
    }
    return {name: (count, time_layer(layer, call, x, segment_ids, setup))
            for name, (count, layer, call) in parts.items() if count}


def run(setup: BenchSetup, optimizer: str) -> dict:
    cfg = preset(setup.preset, remat=setup.remat, scan_layers=setup.scan_layers)
    config = TrainConfig(
        model=cfg,
        data=DataConfig(seq_len=setup.seq_len, batch_size=setup.batch),
        optim=OptimConfig(optimizer=optimizer),
        steps=1000,
        mesh=MeshConfig(data=1),
        progress=False,
    )
    trainer = Trainer.create(config)
    batch = trainer.place(synthetic_batch(setup))
    compiled, compile_seconds = compile_step(trainer, batch)
    memory = preflight(compiled, compile_seconds, setup)
    with explained_out_of_memory(setup, memory):
        step_seconds = time_train_step(trainer, compiled, batch, setup)
        del trainer, compiled, batch
        layers = layer_breakdown(cfg, setup)
    flops = train_flops_per_token(cfg, setup.seq_len)
    tokens_per_second = setup.tokens / step_seconds
    parts = {name: count * seconds for name, (count, seconds) in layers.items()}
    parts["rest"] = step_seconds - sum(parts.values())
    return {
        "setup": dataclasses.asdict(setup),
        "optimizer": optimizer,
        "params": {k: count_params(cfg)[k] for k in ("total", "active", "embedding")},
        "compile_seconds": compile_seconds,
        "memory_gib": memory,
        "step_seconds": step_seconds,
        "tokens_per_second": tokens_per_second,
        "model_tflops_per_second": tokens_per_second * flops["total"] / 1e12,
        "mfu": tokens_per_second * flops["total"] / HOPPER_PEAK_FLOPS,
        "breakdown": {
            name: {
                "layers": layers[name][0] if name in layers else None,
                "seconds_per_step": seconds,
                "share": seconds / step_seconds,
                "model_tflops_per_second": (setup.tokens * flops[name] / seconds / 1e12
                                            if seconds > 0 else None),
            }
            for name, seconds in parts.items()
        },
        "flops_per_token": flops,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": datetime.date.today().isoformat(),
    }


def markdown(result: dict, command: str) -> str:
    setup = result["setup"]
    params = result["params"]
    memory = result["memory_gib"]
    lines = [
        f"# Training step benchmark: `{setup['preset']}` preset, {setup['batch']} x "
        f"{setup['seq_len']} tokens",
        "",
        f"`{command}` on {result['device']} (jax {result['jax']}, flax {result['flax']}, "
        f"{result['date']}); {format_count(params['total'])} parameters, "
        f"{format_count(params['active'])} active per token (embedding excluded); optimizer "
        f"{result['optimizer']}, remat {setup['remat']}; median of {setup['steps']} steps.",
        "",
        f"Compile {result['compile_seconds']:.0f} s. XLA memory plan per device: arguments "
        f"{memory['argument']:.2f} GiB, temporaries {memory['temp']:.2f} GiB, peak "
        f"{memory['peak']:.2f} GiB.",
        "",
        "| step | tokens/s | model TFLOP/s | MFU (of 989 TFLOP/s) |",
        "|---|---|---|---|",
        f"| {1e3 * result['step_seconds']:.1f} ms | {result['tokens_per_second']:,.0f} | "
        f"{result['model_tflops_per_second']:.1f} | {100 * result['mfu']:.1f}% |",
        "",
        "Breakdown (one layer of each kind timed alone, forward + backward under the same remat, "
        "times its number of layers; rest = the step minus those):",
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
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--out", help="write the markdown table here (--gpu default: "
                        "benchmarks/train_h200.md) and the numbers next to it as .json")
    args = parser.parse_args(argv)
    setup = GPU if args.gpu else SMOKE
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len),
                                   ("steps", args.steps), ("remat", args.remat)) if v is not None}
    setup = dataclasses.replace(setup, **overrides)
    result = run(setup, args.optimizer)
    command = "python -m experiments.bench_train " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
    table = markdown(result, command)
    print(table)
    out = args.out or ("benchmarks/train_h200.md" if args.gpu else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(table)
        with open(os.path.splitext(out)[0] + ".json", "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
