"""Benchmark: forward+backward of one Stable LatentMoE layer against a dense SiTU-GLU FFN with the
same active FLOPs, in one process on one device.

    python -m experiments.bench_moe --gpu      # H200: d=2048, 64 experts, top-8, latent 1024,
                                               # expert width 1024, 16K tokens; writes
                                               # benchmarks/moe_h200.md
    python -m experiments.bench_moe --smoke    # the same code at a tiny size (CPU check)

Both layers use bf16 parameters and activations (router and norms in float32), the cotangent is a
fixed random array, and the time is the median of `--iters` jitted steps that return the input and
parameter gradients. TFLOP/s counts the matmul FLOPs of the active parameters (3x the forward:
forward, input gradient, weight gradient). On GPU the MoE layer is first checked against the same
layer with XLA's `ragged_dot` in place of the Mosaic GPU grouped matmul.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe.config import MoEConfig, active_matmul_flops
from moe.experts import DenseFFN, StableLatentMoE
from moe.grouped_matmul import resolve_backend
from moe.routing import max_violation


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """Sizes of one benchmark: tokens = batch x seq_len."""

    d_model: int
    num_experts: int
    top_k: int
    latent_dim: int
    expert_hidden: int
    batch: int
    seq_len: int
    hidden_multiple: int  # the dense FFN width is rounded to a multiple of this

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


GPU_SHAPE = BenchShape(2048, 64, 8, 1024, 1024, batch=8, seq_len=2048, hidden_multiple=128)
SMOKE_SHAPE = BenchShape(64, 8, 2, 32, 32, batch=2, seq_len=64, hidden_multiple=8)


def moe_config(shape: BenchShape, gmm_backend: str = "auto") -> MoEConfig:
    """The benchmarked layer: latent experts with latent RMSNorm, SiTU-GLU, no shared expert."""
    return MoEConfig(
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        expert_hidden=shape.expert_hidden,
        latent_dim=shape.latent_dim,
        latent_norm=True,
        activation="situ",
        gmm_backend=gmm_backend,
    )


def matched_dense_hidden(shape: BenchShape) -> int:
    """Dense FFN width whose matmul FLOPs (3·D·H per token) match the MoE layer's active FLOPs."""
    moe_macs = active_matmul_flops(shape.d_model, moe_config(shape)) // 2
    hidden = moe_macs / (3 * shape.d_model)
    return max(shape.hidden_multiple, round(hidden / shape.hidden_multiple) * shape.hidden_multiple)


def gradient_step(module: nnx.Module) -> tuple[Callable, nnx.State]:
    """Jitted `(params, x, cotangent) -> (x grad, param grads)` of a module returning y or (y, _)"""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def forward(params, x):
        out = nnx.merge(graphdef, params, rest)(x)
        return out[0] if isinstance(out, tuple) else out

    @jax.jit
    def step(params, x, cotangent):
        _, pullback = jax.vjp(forward, params, x)
        params_grad, x_grad = pullback(cotangent)
        return x_grad, params_grad

    return step, params


def median_seconds(fn: Callable, args: tuple, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compiled_bytes(fn: Callable, args: tuple) -> int:
    """Device memory of one compiled step: arguments + outputs + temporaries."""
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return 0
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def relative_error(a, b) -> float:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    worst = 0.0
    for leaf_a, leaf_b in zip(leaves_a, leaves_b):
        leaf_a = np.asarray(leaf_a, np.float32)
        leaf_b = np.asarray(leaf_b, np.float32)
        scale = max(float(np.max(np.abs(leaf_b))), 1e-30)
        worst = max(worst, float(np.max(np.abs(leaf_a - leaf_b))) / scale)
    return worst


def run(shape: BenchShape, iters: int, check_backend: bool) -> dict:
    """Times both layers at `shape`; returns the measurements."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (shape.batch, shape.seq_len, shape.d_model), jnp.bfloat16)
    cotangent = jax.random.normal(keys[1], x.shape, jnp.bfloat16)
    common = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cfg = moe_config(shape)
    hidden = matched_dense_hidden(shape)
    with nnx.use_eager_sharding(False):
        moe_layer = StableLatentMoE(shape.d_model, cfg, rngs=nnx.Rngs(1), **common)
        dense_layer = DenseFFN(shape.d_model, hidden, "situ", rngs=nnx.Rngs(2), **common)

    expert_rows = jax.ShapeDtypeStruct((shape.tokens * shape.top_k, shape.latent_dim), jnp.bfloat16)
    results = dict(
        dense_hidden=hidden,
        backend=resolve_backend(cfg.gmm_backend, expert_rows, moe_layer.expert_w_out),
    )
    _, stats = nnx.jit(lambda m, x: m(x))(moe_layer, x)
    results["max_vio"] = float(max_violation(stats.expert_ids, cfg.num_experts))
    for name, module, flops_per_token in (
        ("moe", moe_layer, active_matmul_flops(shape.d_model, cfg)),
        ("dense", dense_layer, 2 * 3 * shape.d_model * hidden),
    ):
        step, params = gradient_step(module)
        seconds = median_seconds(step, (params, x, cotangent), iters)
        flops = 3 * flops_per_token * shape.tokens
        results[name] = dict(
            ms=seconds * 1e3,
            tflops=flops / seconds / 1e12,
            flops=flops,
            gib=compiled_bytes(step, (params, x, cotangent)) / 2**30,
        )
    results["ratio"] = results["moe"]["tflops"] / results["dense"]["tflops"]
    if check_backend:
        results["xla_check"] = compare_with_xla_backend(moe_layer, cfg, shape, x, cotangent)
    return results


def compare_with_xla_backend(moe_layer, cfg, shape, x, cotangent) -> float:
    """Largest relative difference of output and gradients: chosen backend vs XLA ragged_dot."""
    with nnx.use_eager_sharding(False):
        reference = StableLatentMoE(
            shape.d_model,
            dataclasses.replace(cfg, gmm_backend="xla"),
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            rngs=nnx.Rngs(1),
        )
    nnx.update(reference, nnx.state(moe_layer))
    outputs = []
    for module in (moe_layer, reference):
        step, params = gradient_step(module)
        outputs.append(step(params, x, cotangent))
    return relative_error(outputs[0], outputs[1])


def markdown(shape: BenchShape, results: dict, command: str) -> str:
    moe_row, dense_row = results["moe"], results["dense"]
    device = jax.devices()[0]
    lines = [
        "# MoE layer vs dense SiTU-GLU FFN, forward + backward",
        "",
        f"Command: `{command}`",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- device: {device.device_kind} ({jax.default_backend()}), {jax.device_count()} device(s)",
        f"- versions: jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
        f"flax {flax.__version__}, python {platform.python_version()}",
        f"- XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`",
        f"- shape: d={shape.d_model}, {shape.num_experts} experts, top-{shape.top_k}, latent "
        f"{shape.latent_dim}, expert width {shape.expert_hidden}, {shape.tokens} tokens "
        f"({shape.batch} x {shape.seq_len}), bf16 parameters and activations",
        f"- dense FFN width {results['dense_hidden']} (same active matmul FLOPs, rounded to "
        f"{shape.hidden_multiple})",
        f"- grouped matmul backend: {results['backend']}",
        f"- MaxVio of the benchmark batch (random router, no balancing): {results['max_vio']:.3f}",
    ]
    if "xla_check" in results:
        lines.append(
            "- max relative difference of y and all gradients vs the same layer on XLA "
            f"ragged_dot: {results['xla_check']:.2e}"
        )
    lines += [
        "",
        "| layer | fwd+bwd ms | model TFLOP | TFLOP/s | compiled memory GiB |",
        "|---|---:|---:|---:|---:|",
        f"| MoE (latent, dropless) | {moe_row['ms']:.3f} | {moe_row['flops'] / 1e12:.3f} | "
        f"{moe_row['tflops']:.1f} | {moe_row['gib']:.2f} |",
        f"| dense SiTU-GLU FFN | {dense_row['ms']:.3f} | {dense_row['flops'] / 1e12:.3f} | "
        f"{dense_row['tflops']:.1f} | {dense_row['gib']:.2f} |",
        "",
        f"MoE / dense achieved TFLOP/s: **{results['ratio']:.2f}** (target >= 0.60).",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench_moe",
        description="Forward+backward of one MoE layer vs a FLOP-matched dense SiTU-GLU FFN.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--gpu", action="store_true", help="the H200 benchmark size (item 6)")
    size.add_argument("--smoke", action="store_true", help="a tiny size that runs on CPU")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20 / 2)")
    parser.add_argument(
        "--out", default=None, help="markdown table (default benchmarks/moe_h200.md with --gpu)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.gpu and jax.default_backend() != "gpu":
        raise SystemExit("--gpu needs a CUDA device; use --smoke on CPU.")
    shape = GPU_SHAPE if args.gpu else SMOKE_SHAPE
    iters = args.iters or (20 if args.gpu else 2)
    results = run(shape, iters, check_backend=args.gpu)
    command = "python -m experiments.bench_moe " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(shape, results, command)
    print(table)
    out = args.out or ("benchmarks/moe_h200.md" if args.gpu else None)
    if out:
        with open(out, "w") as f:
            f.write(table)
    return results


if __name__ == "__main__":
    main()
