"""Benchmark: forward+backward of one Stable LatentMoE layer against a dense SiTU-GLU FFN with the
same active FLOPs, in one process on one device.

    python -m experiments.bench_moe --gpu      # H200: d=2048, 64 experts, top-8, latent 1024,
                                               # expert width 1024, 16K tokens; writes
                                               # benchmarks/moe_<card>.md
    python -m experiments.bench_moe --smoke    # the same code at a tiny size (CPU check)
    python -m experiments.bench_moe --gpu --profile   # also: the layer's parts timed one by one
                                                      # and the top device ops of a traced step

Both layers use bf16 parameters and activations (router and norms in float32), the cotangent is a
fixed random array, and the time is the median of `--iters` jitted steps that return the input and
parameter gradients. TFLOP/s counts the matmul FLOPs of the active parameters (3x the forward:
forward, input gradient, weight gradient). With `--gpu` the MoE layer's y and gradients are
checked against the same layer (same parameters) with XLA's `ragged_dot` in place of the Mosaic GPU
grouped matmuls (`compare_with_xla_backend`, max-norm relative, NaN-aware); the run fails past
`XLA_AGREEMENT_TOLERANCE`. On Hopper the difference can be exactly 0: our kernels and the cuBLAS
GEMMs XLA runs issue the same bf16 wgmma steps in the same K order with float32 accumulators, so
each product comes out bit for bit alike (`benchmarks/moe_notes.md`).

`--profile` adds three tables: each part of the MoE layer (router + top-k + plan, gathers, grouped
matmuls, activation, combine, norm and projections) jitted and timed on its own, forward and
forward+backward; the device ops of a `jax.profiler` trace of the layer's gradient step, read
back from the trace's `.xplane.pb` with `jax.profiler.ProfileData`, summed per op and labelled
with their HLO opcode, shape and JAX source op; and when in that trace the device runs nothing
(its idle time, longest gaps and the ops around them: `experiments.profiling.idle_summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from core.norms import rms_norm
from experiments.harness import (command_line, compiled_peak_mib, gpu_table, median_seconds,
                                 package_version, relative_error, report_preamble, write_markdown)
from experiments.profiling import idle_markdown, ops_markdown, profile_device_ops
from moe.activations import fused_glu
from moe.config import MoEConfig, active_matmul_flops
from moe.dispatch import gather_rows, plan_dispatch, unsort_combine
from moe.experts import DenseFFN, StableLatentMoE
from moe.grouped_matmul import grouped_matmul, resolve_backend
from moe.routing import max_violation, route, router_scores


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


# bf16 outputs and gradients, each through a few grouped matmuls and roundings of 2^-9 of the
# value: beyond this, the two backends compute different layers.
XLA_AGREEMENT_TOLERANCE = 2**-6
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


def gradient_step(module: nnx.Module, with_output: bool = False) -> tuple[Callable, nnx.State]:
    """Jitted `(params, x, cotangent) -> (x grad, param grads)` of a module returning y or (y, _),
    and its params; with `with_output`, `-> (y, x grad, param grads)`."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def forward(params, x):
        out = nnx.merge(graphdef, params, rest)(x)
        return out[0] if isinstance(out, tuple) else out

    @jax.jit
    def step(params, x, cotangent):
        y, pullback = jax.vjp(forward, params, x)
        params_grad, x_grad = pullback(cotangent)
        return (y, x_grad, params_grad) if with_output else (x_grad, params_grad)

    return step, params


def run(shape: BenchShape, iters: int, check_backend: bool, profile: bool = False) -> dict:
    """Times both layers at `shape` (and, with `profile`, the MoE layer's parts and device ops);
    returns the measurements."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (shape.batch, shape.seq_len, shape.d_model), jnp.bfloat16)
    cotangent = jax.random.normal(keys[1], x.shape, jnp.bfloat16)
    common = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cfg = moe_config(shape)
    hidden = matched_dense_hidden(shape)
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
        seconds = median_seconds(lambda: step(params, x, cotangent), iters, warmup=3)
        flops = 3 * flops_per_token * shape.tokens
        results[name] = dict(
            ms=seconds * 1e3,
            tflops=flops / seconds / 1e12,
            flops=flops,
            gib=compiled_peak_mib(step.lower(params, x, cotangent).compile()) / 2**10,
        )
    results["ratio"] = results["moe"]["tflops"] / results["dense"]["tflops"]
    if profile:
        results["parts"] = time_moe_parts(moe_layer, x, iters)
        step, params = gradient_step(moe_layer)
        results["ops"] = profile_device_ops(step, (params, x, cotangent), steps=3)
    if check_backend:
        results["xla_check"] = compare_with_xla_backend(moe_layer, x, cotangent)
    return results


def time_forward_backward(fn: Callable, diff_args: tuple, other_args: tuple, iters: int):
    """Median ms of `fn(*diff_args, *other_args) -> (out, aux)` forward, and forward+backward
    (the pullback of a random cotangent to diff_args). Returns (forward ms, fwd+bwd ms, out, aux).
    """
    forward = jax.jit(fn)
    out, aux = forward(*diff_args, *other_args)
    cotangent = jax.random.normal(jax.random.key(5), out.shape, out.dtype)

    @jax.jit
    def forward_backward(diff_args, other_args, cotangent):
        _, pullback, _ = jax.vjp(lambda *d: fn(*d, *other_args), *diff_args, has_aux=True)
        return pullback(cotangent)

    forward_ms = median_seconds(lambda: forward(*diff_args, *other_args), iters, warmup=3) * 1e3
    both_ms = median_seconds(lambda: forward_backward(diff_args, other_args, cotangent), iters,
                             warmup=3) * 1e3
    return forward_ms, both_ms, out, aux


def time_moe_parts(layer: StableLatentMoE, x: jax.Array, iters: int) -> list[dict]:
    """Each stage of `StableLatentMoE.__call__` (dropless path) jitted and timed on its own.

    Every stage is fed the previous stage's real output, so the routing, and with it the group
    sizes of the grouped matmuls, are the benchmark's. Rows: part, forward ms, fwd+bwd ms.
    """
    cfg = layer.cfg
    k, backend, dtype = cfg.top_k, cfg.gmm_backend, layer.dtype
    tokens = x.reshape(-1, x.shape[-1]).astype(dtype)
    num_experts, width, _, hidden = layer.expert_w_in.shape
    w_in = layer.expert_w_in[...].astype(dtype).reshape(num_experts, width, 2 * hidden)
    w_out = layer.expert_w_out[...].astype(dtype)

    def router(tokens, router_weight, bias):
        scores = router_scores(tokens, router_weight)
        expert_ids, weights = route(scores, bias, k, cfg.routed_scaling_factor)
        return weights, plan_dispatch(expert_ids.reshape(-1), num_experts)

    def down(tokens, w_down):
        return tokens @ w_down, None

    def gather(z, order, inverse):
        return gather_rows(z, order // k, inverse, k), None

    def matmul(lhs, rhs, group_sizes):
        return grouped_matmul(lhs, rhs, group_sizes, backend=backend), None

    def activation(gate_up):
        return fused_glu(layer.activation, gate_up.reshape(gate_up.shape[0], 2, -1)), None

    def combine(y_sorted, weights, order, inverse):
        return unsort_combine(y_sorted, weights, order, inverse), None

    def norm_up(routed, gain, w_up):
        return rms_norm(routed, gain, cfg.norm_eps) @ w_up, None

    rows = []

    def timed(name, fn, diff_args, other_args=()):
        forward_ms, both_ms, out, aux = time_forward_backward(fn, diff_args, other_args, iters)
        rows.append(dict(part=name, forward_ms=forward_ms, forward_backward_ms=both_ms))
        return out, aux

    router_args = (tokens, layer.router[...])
    bias = (layer.router_bias[...],)
    weights, plan = timed("router, top-k, dispatch plan", router, router_args, bias)
    z, _ = timed("down projection W_down", down, (tokens, layer.w_down[...].astype(dtype)))
    plan_args = (plan.order, plan.inverse)
    x_sorted, _ = timed("gather rows into expert order", gather, (z,), plan_args)
    gate_up, _ = timed("grouped matmul 1 (gate, up)", matmul, (x_sorted, w_in), (plan.group_sizes,))
    hidden_act, _ = timed("activation SiTU-GLU", activation, (gate_up,))
    y_sorted, _ = timed("grouped matmul 2 (down)", matmul, (hidden_act, w_out), (plan.group_sizes,))
    routed, _ = timed("un-sort and combine", combine, (y_sorted, weights), plan_args)
    timed(
        "latent RMSNorm + up projection W_up",
        norm_up,
        (routed, layer.latent_gain[...], layer.w_up[...].astype(dtype)),
    )
    return rows


def compare_with_xla_backend(moe_layer: StableLatentMoE, x: jax.Array,
                             cotangent: jax.Array) -> float:
    """max |ours - xla| / max |xla| over y [B, T, D], the input gradient and every parameter
    gradient (the worst of them; NaN if either side has a non-finite value): `moe_layer` against
    a copy of it with `gmm_backend="xla"`, XLA's `ragged_dot` for every grouped matmul."""
    reference = StableLatentMoE(
        moe_layer.d_model,
        dataclasses.replace(moe_layer.cfg, gmm_backend="xla"),
        dtype=moe_layer.dtype,
        param_dtype=moe_layer.expert_w_in[...].dtype,  # the values are `moe_layer`'s (update)
        rngs=nnx.Rngs(0),
    )
    nnx.update(reference, nnx.state(moe_layer))
    outputs = []
    for module in (moe_layer, reference):
        step, params = gradient_step(module, with_output=True)
        outputs.append(step(params, x, cotangent))
    return relative_error(*outputs, norm="max")


def markdown(shape: BenchShape, results: dict, command: str) -> str:
    moe_row, dense_row = results["moe"], results["dense"]
    lines = report_preamble(
        "MoE layer vs dense SiTU-GLU FFN, forward + backward", command,
        f"jaxlib {package_version('jaxlib')}, flax {package_version('flax')}") + [
        f"- Devices: {jax.device_count()}; XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`",
        f"- Shape: d={shape.d_model}, {shape.num_experts} experts, top-{shape.top_k}, latent "
        f"{shape.latent_dim}, expert width {shape.expert_hidden}, {shape.tokens} tokens "
        f"({shape.batch} x {shape.seq_len}), bf16 parameters and activations",
        f"- Dense FFN width {results['dense_hidden']} (same active matmul FLOPs, rounded to "
        f"{shape.hidden_multiple})",
        f"- Grouped matmul backend: {results['backend']}",
        f"- MaxVio of the benchmark batch (random router, no balancing): {results['max_vio']:.3f}",
    ]
    if "xla_check" in results:
        lines.append(
            "- Against the same layer on XLA ragged_dot, max |difference| / max |value| of y, the "
            f"input gradient and every parameter gradient, the worst: {results['xla_check']:.2e} "
            f"(agreement: <= {XLA_AGREEMENT_TOLERANCE:g})"
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
    if "parts" in results:
        lines += profile_markdown(results)
    return "\n".join(lines) + "\n"


def profile_markdown(results: dict) -> list[str]:
    """The `--profile` tables: the MoE layer's parts, and the top device ops of its step."""
    parts = results["parts"]
    lines = [
        "## Where the MoE layer's time goes (`--profile`)",
        "",
        "Each part jitted and timed on its own (median ms; launch overheads and the fusions XLA "
        "makes across part boundaries in the whole step are not in these numbers).",
        "",
        "| part | forward ms | forward+backward ms |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {row['part']} | {row['forward_ms']:.3f} | {row['forward_backward_ms']:.3f} |"
        for row in parts
    ]
    lines.append(
        f"| sum of the parts | {sum(row['forward_ms'] for row in parts):.3f} | "
        f"{sum(row['forward_backward_ms'] for row in parts):.3f} |"
    )
    lines.append(f"| whole layer, one jitted step | | {results['moe']['ms']:.3f} |")
    return lines + [""] + ops_markdown(
        results["ops"], "Device ops of the MoE layer's gradient step") + idle_markdown(
        results["ops"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench_moe",
        description="Forward+backward of one MoE layer vs a FLOP-matched dense SiTU-GLU FFN.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--gpu", action="store_true", help="the H200 benchmark size")
    size.add_argument("--smoke", action="store_true", help="a tiny size that runs on CPU")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20 / 2)")
    parser.add_argument(
        "--out", default=None, help="markdown table (default benchmarks/moe_<card>.md with --gpu)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also time the MoE layer's parts and list the top device ops of a traced step",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.gpu and jax.default_backend() != "gpu":
        raise SystemExit("--gpu needs a CUDA device; use --smoke on CPU.")
    shape = GPU_SHAPE if args.gpu else SMOKE_SHAPE
    iters = args.iters or (20 if args.gpu else 2)
    results = run(shape, iters, check_backend=args.gpu, profile=args.profile)
    command = command_line("experiments.bench_moe", argv)
    table = markdown(shape, results, command)
    print(table)
    out = args.out or (gpu_table("moe") if args.gpu else None)
    if out:
        write_markdown(out, table)
    if "xla_check" in results and not results["xla_check"] <= XLA_AGREEMENT_TOLERANCE:
        raise SystemExit(f"the MoE layer disagrees with its XLA ragged_dot twin: "
                         f"{results['xla_check']:.2e} > {XLA_AGREEMENT_TOLERANCE:g}")
    return results


if __name__ == "__main__":
    main()
