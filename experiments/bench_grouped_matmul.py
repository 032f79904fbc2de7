"""Benchmark: the MoE step's grouped GEMMs, ours against JAX's bundled kernels and dense XLA.

    python -m experiments.bench_grouped_matmul --gpu     # H200: 131072 rows (16384 tokens x
                                                         # top-8), 64 groups
                                                         # -> benchmarks/grouped_matmul_<card>.md
    python -m experiments.bench_grouped_matmul --smoke   # tiny sizes on CPU (interpret mode)
    python -m experiments.bench_grouped_matmul --gpu --expert-mlp   # the expert MLP, GLU fused
                                                         # or not -> benchmarks/expert_mlp_<card>.md

Row-ragged products (lhs [M, K] x rhs [G, K, N], rows grouped; the two forward products of the
expert MLP and their input gradients, rhs transposed): ours (`ragged_matmul`) under every config
of `SWEEP_CONFIGS`, JAX's bundled `ragged_dot_mgpu` with its best tiles at these shapes
(`BUNDLED_NARROW_TILES`, `BUNDLED_WIDE_TILES`), and XLA's dense `jnp.dot` of the same FLOPs.
Weight gradients (lhs [M, K]^T x out_grad [M, N] reduced per group, [G, K, N]): ours
(`transposed_ragged_matmul`) under every config of `TRANSPOSED_SWEEP_CONFIGS`, the bundled
`transposed_ragged_dot_mgpu` (`BUNDLED_WEIGHT_GRAD_TILES`; GPU only, it has no interpret mode) and
XLA's dense lhs^T x out_grad. Group sizes: one multinomial draw of M rows over G equal groups
(seed 0), as uniform routing gives. Every grouped result is checked (max-norm relative error,
`harness.relative_error`) against XLA's `ragged_dot` with float32 output on the covered rows, or
one dense float32 product a group for the weight gradients; `AGREEMENT_TOLERANCE` or the run fails.

`--expert-mlp`: `moe.dispatch.expert_mlp` (131072 rows, 64 experts, width = hidden = 1024,
SiTU-GLU) unfused (our GEMM, the Pallas GLU kernel, our GEMM) against `fused_expert_mlp` (the GLU
in the GEMMs' epilogues), forward and forward+backward, checked to agree on y and the three
gradients. On CPU only the forward runs, the unfused path on XLA.

On GPU a time is the median over `--iters` calls of the device time of the call's kernels (CUPTI
through `jax.experimental.mosaic.gpu.profiler`; our work-table preparation included), or of its
wall time where CUPTI is not available (the table says which). TFLOP/s counts 2 M K N.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from experiments.harness import (command_line, gpu_table, median_seconds, package_version,
                                 relative_error, report_preamble, write_markdown)
from moe import dispatch
from moe.activations import GLUActivation
from moe.kernels.mosaic_gpu.ragged_matmul import ragged_matmul, work_table
from moe.kernels.mosaic_gpu.simulation import interpreted_on_cpu
from moe.kernels.mosaic_gpu.tiling import SWEEP_CONFIGS, TRANSPOSED_SWEEP_CONFIGS
from moe.kernels.mosaic_gpu.transposed_ragged_matmul import transposed_ragged_matmul

# The bundled weight-gradient kernel's best tiles in sweeps at the GPU shapes (131072 rows, 64
# groups; widths 1024 and 2048).
BUNDLED_WEIGHT_GRAD_TILES = dict(
    block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
)
AGREEMENT_TOLERANCE = 8e-3  # bf16 outputs: a rounding is 2^-9 of the value at most
WORK_TABLE = "work_table alone (inside ours' times)"
BUNDLED = "bundled ragged_dot_mgpu"
BUNDLED_TRANSPOSED = "bundled transposed_ragged_dot_mgpu"
ROW_RAGGED, WEIGHT_GRADIENT = "row-ragged", "weight-gradient"
DENSE = "XLA dense jnp.dot"
# The bundled kernel's best tiles in a sweep at the GPU shapes: narrow for products whose widths
# are all at most 1024, wide otherwise.
BUNDLED_NARROW_TILES = dict(
    block_m=128, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=4
)
BUNDLED_WIDE_TILES = dict(
    block_m=128, block_n=192, block_k=64, max_concurrent_steps=4, grid_block_n=4
)


@dataclasses.dataclass(frozen=True)
class Product:
    """lhs [M, K] times rhs [G, K, N] (or [G, N, K] when transpose_rhs) with rows ragged."""

    contraction: int
    columns: int
    transpose_rhs: bool

    def label(self, rows: int, groups: int) -> str:
        if self.transpose_rhs:
            return f"[{rows},{self.contraction}] x [{groups},{self.columns},{self.contraction}]^T"
        return f"[{rows},{self.contraction}] x [{groups},{self.contraction},{self.columns}]"


@dataclasses.dataclass(frozen=True)
class WeightGradient:
    """lhs [M, K]^T times out_grad [M, N], reduced over each group's rows: [G, K, N]."""

    lhs_width: int
    out_width: int

    def label(self, rows: int, groups: int) -> str:
        return (f"[{rows},{self.lhs_width}]^T x [{rows},{self.out_width}] -> "
                f"[{groups},{self.lhs_width},{self.out_width}]")


@dataclasses.dataclass(frozen=True)
class BenchSize:
    rows: int
    groups: int
    products: tuple[Product, ...]
    weight_gradients: tuple[WeightGradient, ...]


GPU_SIZE = BenchSize(
    rows=131072,
    groups=64,
    products=(
        Product(1024, 2048, False),  # forward, latent 1024 -> fused gate/up 2048
        Product(1024, 1024, False),  # forward, expert width 1024 -> latent 1024
        Product(2048, 1024, True),  # input gradient of the first
        Product(1024, 1024, True),  # input gradient of the second
    ),
    weight_gradients=(
        WeightGradient(1024, 2048),  # weight gradient of the first
        WeightGradient(1024, 1024),  # weight gradient of the second
    ),
)
SMOKE_SIZE = BenchSize(
    rows=384,
    groups=4,
    products=(Product(128, 256, False), Product(256, 256, True)),
    weight_gradients=(WeightGradient(128, 256),),
)


@dataclasses.dataclass(frozen=True)
class ExpertMLPSize:
    """The expert MLP: rows [R, W] through w_in [E, W, 2, M] and w_out [E, M, W]."""

    rows: int
    experts: int
    width: int
    hidden: int


EXPERT_MLP_GPU_SIZE = ExpertMLPSize(rows=131072, experts=64, width=1024, hidden=1024)
EXPERT_MLP_SMOKE_SIZE = ExpertMLPSize(rows=256, experts=4, width=128, hidden=128)
FUSED = "fused GLU epilogues"
FORWARD, FORWARD_BACKWARD = "forward", "forward+backward"


def routed_group_sizes(rows: int, groups: int, seed: int = 0) -> np.ndarray:
    """[G] int32 rows per group: one multinomial draw of `rows` over `groups` equal groups."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(rows, np.full(groups, 1.0 / groups)).astype(np.int32)


def product_operands(size: BenchSize, product: Product, seed: int = 0):
    """lhs [M, K], rhs [G, K, N] (or [G, N, K]) bf16 normal, and a dense [K, N] for jnp.dot."""
    lhs_key, rhs_key = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(lhs_key, (size.rows, product.contraction), jnp.bfloat16)
    rhs_shape = (product.columns, product.contraction) if product.transpose_rhs else (
        product.contraction, product.columns)
    rhs = jax.random.normal(rhs_key, (size.groups, *rhs_shape), jnp.bfloat16)
    dense_rhs = jnp.swapaxes(rhs[0], 0, 1) if product.transpose_rhs else rhs[0]
    return lhs, rhs, dense_rhs


def timed_calls(product: Product, config_names, lhs, rhs, dense_rhs, group_sizes) -> list:
    """(kernel, its tiles, jitted f, its arguments) of every timed call, in timing order.

    The bundled kernel and the dense dot first, then our configs, those that do not overlap tiles
    first (the simplest pipeline): if a kernel hangs, the rows timed before it are kept.
    """
    bundled_tiles = (BUNDLED_NARROW_TILES if max(product.contraction, product.columns) <= 1024
                     else BUNDLED_WIDE_TILES)
    bundled = jax.jit(
        lambda lhs, rhs, sizes: ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=sizes, transpose_rhs=product.transpose_rhs, **bundled_tiles
        )
    )
    label = "{block_m}x{block_n} k{block_k} s{max_concurrent_steps} w{grid_block_n}"
    grouped_args = (lhs, rhs, group_sizes)
    calls = [
        (BUNDLED, label.format(**bundled_tiles), bundled, grouped_args),
        (DENSE, "same FLOPs", jax.jit(jnp.dot), (lhs, dense_rhs)),
    ]
    for name in sorted(config_names, key=lambda name: SWEEP_CONFIGS[name].overlap_tiles):
        ours = functools.partial(
            ragged_matmul, transpose_rhs=product.transpose_rhs, config=SWEEP_CONFIGS[name]
        )
        calls.append(("ours", name, jax.jit(ours), grouped_args))
    return calls


def weight_gradient_operands(size: BenchSize, product: WeightGradient, seed: int = 0):
    """lhs [M, K] and out_grad [M, N], bf16 normal."""
    lhs_key, out_grad_key = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(lhs_key, (size.rows, product.lhs_width), jnp.bfloat16)
    out_grad = jax.random.normal(out_grad_key, (size.rows, product.out_width), jnp.bfloat16)
    return lhs, out_grad


def weight_gradient_calls(config_names, lhs, out_grad, group_sizes, with_bundled: bool) -> list:
    """(kernel, its tiles, jitted f, its arguments) of every timed weight-gradient call: the
    bundled kernel (where `with_bundled`) and the dense dot first, then our configs."""
    label = "{block_m}x{block_n} k{block_k} s{max_concurrent_steps} w{grid_block_n}"
    grouped_args = (lhs, out_grad, group_sizes)
    calls = [(DENSE, "same FLOPs", jax.jit(lambda lhs, out_grad: lhs.T @ out_grad),
              (lhs, out_grad))]
    if with_bundled:
        bundled = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot,
                                    **BUNDLED_WEIGHT_GRAD_TILES)
        calls.insert(0, (BUNDLED_TRANSPOSED, label.format(**BUNDLED_WEIGHT_GRAD_TILES),
                         jax.jit(lambda lhs, out_grad, sizes: bundled(lhs, out_grad,
                                                                      group_sizes=sizes)),
                         grouped_args))
    for name in config_names:
        ours = functools.partial(transposed_ragged_matmul, config=TRANSPOSED_SWEEP_CONFIGS[name])
        calls.append(("ours", name, jax.jit(ours), grouped_args))
    return calls


def weight_gradient_reference(lhs, out_grad, group_sizes: np.ndarray) -> jax.Array:
    """[G, K, N] float32: one XLA dense lhs^T x out_grad a group, on its rows sliced statically
    (known group sizes; XLA's ragged_dot_general may expand the ragged reduction over every
    group's rows, 64x the work and memory at the benchmark's size)."""
    ends = np.cumsum(group_sizes)

    @jax.jit
    def per_group(lhs, out_grad):
        return jnp.stack([
            jnp.dot(lhs[end - size:end].T, out_grad[end - size:end],
                    preferred_element_type=jnp.float32)
            for size, end in zip(group_sizes, ends)
        ])

    return per_group(lhs, out_grad)


def reference(lhs, rhs, group_sizes, transpose_rhs: bool) -> jax.Array:
    """XLA's ragged_dot with float32 output: [M, N]."""
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def timed_ms(jitted, args: tuple, iters: int, use_cupti: bool) -> tuple[float, str]:
    """(median milliseconds of `jitted(*args)`, which timer): CUPTI device time where it works.

    `jitted` must be a `jax.jit` function: CUPTI's `measure` would otherwise jit a closure and
    bake the operands into it as constants.
    """
    jax.block_until_ready(jitted(*args))
    if use_cupti:
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, times = profiler.measure(jitted, iterations=iters)(*args)
            if times and all(t is not None for t in times):
                return statistics.median(times), "CUPTI device time"
        except Exception as error:  # CUPTI missing or busy: fall back to wall time
            print(f"CUPTI timing unavailable ({type(error).__name__}: {error}); using wall time")
    return median_seconds(lambda: jitted(*args), iters, warmup=0) * 1e3, "wall time"


def run(size: BenchSize, config_names, weight_grad_config_names, iters: int, use_cupti: bool,
        report=None) -> list[dict]:
    """One row per (product, kernel): ms, TFLOP/s, speed-up over the bundled kernel, error.

    The row-ragged products first, then the weight gradients; within each, kernels are the outer
    loop (`timed_calls` and `weight_gradient_calls` order), products the inner one;
    `report(rows)` is called after each row, so the GPU run writes its table as it goes and a
    hung or crashed kernel leaves every row timed before it.
    """
    sizes = jnp.asarray(routed_group_sizes(size.rows, size.groups))
    # (label, family, FLOPs, reference, leading rows the check compares, calls) of each product.
    products = []
    for product in size.products:
        lhs, rhs, dense_rhs = product_operands(size, product)
        expected = jax.jit(reference, static_argnums=3)(lhs, rhs, sizes, product.transpose_rhs)
        calls = timed_calls(product, config_names, lhs, rhs, dense_rhs, sizes)
        flops = 2 * size.rows * product.contraction * product.columns
        products.append((product.label(size.rows, size.groups), ROW_RAGGED, flops, expected,
                         int(sizes.sum()), calls))
    for product in size.weight_gradients:
        lhs, out_grad = weight_gradient_operands(size, product)
        expected = weight_gradient_reference(lhs, out_grad, np.asarray(sizes))
        calls = weight_gradient_calls(weight_grad_config_names, lhs, out_grad, sizes,
                                      with_bundled=jax.default_backend() == "gpu")
        flops = 2 * size.rows * product.lhs_width * product.out_width
        products.append((product.label(size.rows, size.groups), WEIGHT_GRADIENT, flops,
                         expected, size.groups, calls))
    rows, bundled_ms = [], {}
    # The row-ragged family first: the weight-gradient kernel is newer, and a hang there must not
    # cost the other family's numbers.
    schedule = [
        (index, position)
        for family in (ROW_RAGGED, WEIGHT_GRADIENT)
        for position in range(max(len(calls) for *_, calls in products))
        for index, (_, product_family, *_, calls) in enumerate(products)
        if product_family == family and position < len(calls)
    ]
    for index, position in schedule:
        label, family, flops, expected, checked, calls = products[index]
        name, config, kernel, args = calls[position]
        row = dict(product=label, family=family, kernel=name, config=config,
                   order=(index, position))
        try:
            out = kernel(*args)
            if name != DENSE:
                row["error"] = relative_error(out[:checked], expected[:checked], norm="max")
            del out
            row["ms"], row["timer"] = timed_ms(kernel, args, iters, use_cupti)
            use_cupti = use_cupti and row["timer"] != "wall time"  # fall back once
        except Exception as error:  # one failing config must not lose the others' numbers
            row["failure"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        else:
            if name in (BUNDLED, BUNDLED_TRANSPOSED):
                bundled_ms[index] = row["ms"]
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            row["speedup"] = bundled_ms.get(index, float("nan")) / row["ms"]
        rows.append(row)
        if report is not None:
            report(rows)
    table = jax.jit(work_table, static_argnums=(1, 2))
    for tile_m in sorted({SWEEP_CONFIGS[name].tile_m for name in config_names}):
        ms, timer = timed_ms(table, (sizes, size.rows, tile_m), iters, use_cupti)
        rows.append(dict(product="all", family=ROW_RAGGED, kernel=WORK_TABLE,
                         config=f"tile_m={tile_m}", ms=ms, timer=timer, order=(len(products), 0)))
    if report is not None:
        report(rows)
    return rows


def expert_mlp_operands(size: ExpertMLPSize, seed: int = 0):
    """x [R, W], w_in [E, W, 2, M], w_out [E, M, W] (scaled by fan-in) and an output cotangent
    [R, W], bf16 normal; group sizes as `routed_group_sizes`."""
    keys = jax.random.split(jax.random.key(seed), 4)
    bf16 = jnp.bfloat16
    x = jax.random.normal(keys[0], (size.rows, size.width), bf16)
    w_in = jax.random.normal(keys[1], (size.experts, size.width, 2, size.hidden)) * (
        size.width**-0.5)
    w_out = jax.random.normal(keys[2], (size.experts, size.hidden, size.width)) * (
        size.hidden**-0.5)
    out_grad = jax.random.normal(keys[3], (size.rows, size.width), bf16)
    group_sizes = jnp.asarray(routed_group_sizes(size.rows, size.experts))
    return x, w_in.astype(bf16), w_out.astype(bf16), out_grad, group_sizes


def expert_mlp_calls(size: ExpertMLPSize, unfused_backend: str, passes) -> list:
    """(path, pass, jitted f, arguments) of every timed call, the unfused path first.

    A forward returns y [R, W]; a forward+backward returns y and the gradients of x, w_in and
    w_out for a fixed output cotangent.
    """
    x, w_in, w_out, out_grad, group_sizes = expert_mlp_operands(size)
    activation = GLUActivation("situ")

    def fused(x, w_in, w_out, group_sizes):
        w_gate_up = w_in.reshape(size.experts, size.width, 2 * size.hidden)
        return dispatch.fused_expert_mlp(activation, x, group_sizes, w_gate_up, w_out)

    def unfused(x, w_in, w_out, group_sizes):
        return dispatch.expert_mlp(x, group_sizes, w_in, w_out, activation,
                                   backend=unfused_backend)

    def forward_backward(mlp, x, w_in, w_out, group_sizes, out_grad):
        y, pullback = jax.vjp(lambda *weights: mlp(*weights, group_sizes), x, w_in, w_out)
        return (y, *pullback(out_grad))

    calls = []
    for path, mlp in ((f"unfused (grouped_matmul backend={unfused_backend})", unfused),
                      (FUSED, fused)):
        if FORWARD in passes:
            calls.append((path, FORWARD, jax.jit(mlp), (x, w_in, w_out, group_sizes)))
        if FORWARD_BACKWARD in passes:
            calls.append((path, FORWARD_BACKWARD, jax.jit(functools.partial(forward_backward, mlp)),
                          (x, w_in, w_out, group_sizes, out_grad)))
    return calls


def run_expert_mlp(size: ExpertMLPSize, unfused_backend: str, passes, iters: int,
                   use_cupti: bool, report=None) -> list[dict]:
    """One row per (path, pass): ms, the unfused path's ms / ms, and for the fused path the
    max-norm relative error (`harness.relative_error`, the worst of y and the gradients) of its
    outputs against the unfused path's."""
    rows, results, unfused_ms = [], {}, {}
    for path, pass_name, jitted, args in expert_mlp_calls(size, unfused_backend, passes):
        row = dict(product=pass_name, kernel=path, config="situ", order=(0, len(rows)))
        try:
            outs = jax.tree.map(lambda a: a.astype(jnp.float32), jitted(*args))
            if pass_name in results:
                row["error"] = relative_error(outs, results[pass_name], norm="max")
            else:
                results[pass_name] = outs
            del outs
            row["ms"], row["timer"] = timed_ms(jitted, args, iters, use_cupti)
            use_cupti = use_cupti and row["timer"] != "wall time"
        except Exception as error:  # a failing path must not lose the other's numbers
            row["failure"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        else:
            unfused_ms.setdefault(pass_name, row["ms"])
            row["speedup"] = unfused_ms[pass_name] / row["ms"]
        rows.append(row)
        if report is not None:
            report(rows)
    return rows


def expert_mlp_markdown(size: ExpertMLPSize, rows: list[dict], command: str) -> str:
    sizes = routed_group_sizes(size.rows, size.experts)
    timers = sorted({row["timer"] for row in rows if "timer" in row})
    lines = report_preamble(
        "Expert MLP: the GLU fused into the grouped GEMMs' epilogues vs unfused", command,
        f"jaxlib {package_version('jaxlib')}") + [
        f"- x [{size.rows}, {size.width}], w_in [{size.experts}, {size.width}, 2, {size.hidden}], "
        f"w_out [{size.experts}, {size.hidden}, {size.width}] bf16, SiTU-GLU; group sizes "
        f"{sizes.min()}-{sizes.max()} (multinomial, seed 0)",
        f"- timer: {', '.join(timers)} (median)",
        f"- error: the fused path's largest max |out - unfused| / max |unfused| over y and (with "
        f"the backward) d x, d w_in, d w_out; agreement means <= {AGREEMENT_TOLERANCE:g}",
    ]
    if jax.default_backend() != "gpu":
        lines.append("- CPU: the fused kernels ran in Mosaic GPU interpret mode, the unfused path "
                     "on XLA; the times say nothing about GPU speed")
    lines += ["", "| pass | path | ms | unfused ms / ms | error |", "|---|---|---:|---:|---:|"]
    for row in sorted(rows, key=lambda row: (row["product"], row["order"])):
        if "failure" in row:
            lines.append(f"| {row['product']} | {row['kernel']} | failed: {row['failure']} | | |")
            continue
        error = f"{row['error']:.1e}" if "error" in row else ""
        lines.append(f"| {row['product']} | {row['kernel']} | {row['ms']:.3f} | "
                     f"{row['speedup']:.3f} | {error} |")
    return "\n".join(lines + [""])


def markdown(size: BenchSize, rows: list[dict], command: str) -> str:
    sizes = routed_group_sizes(size.rows, size.groups)
    timers = sorted({row["timer"] for row in rows if "timer" in row})
    lines = report_preamble(
        "Grouped GEMMs of the MoE: ours (moe.kernels.mosaic_gpu) vs JAX's bundled kernels",
        command, f"jaxlib {package_version('jaxlib')}") + [
        f"- groups: {size.groups}, multinomial over {size.rows} rows (seed 0): sizes "
        f"{sizes.min()}-{sizes.max()}, {sizes.sum()} rows covered",
        f"- timer: {', '.join(timers)} (median); TFLOP/s = 2 M K N / time",
        f"- error: max |out - ref| / max |ref| against XLA ragged_dot (a dense product a group "
        f"for the weight gradients; float32 output); "
        f"agreement means <= {AGREEMENT_TOLERANCE:g}",
    ]
    if jax.default_backend() != "gpu":
        lines.append("- CPU: the grouped kernels ran in Mosaic GPU interpret mode; their times "
                     "say nothing about GPU speed; the bundled weight-gradient kernel has no "
                     "interpret mode and was not run")
    lines += [
        "",
        "| product | kernel | config | ms | TFLOP/s | bundled ms / ms | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda row: row["order"]):
        if "failure" in row:
            lines.append(
                f"| {row['product']} | {row['kernel']} | {row['config']} | failed: "
                f"{row['failure']} | | | |"
            )
            continue
        error = f"{row['error']:.1e}" if "error" in row else ""
        tflops = f"{row['tflops']:.1f}" if "tflops" in row else ""
        speedup = f"{row['speedup']:.3f}" if "speedup" in row else ""
        lines.append(
            f"| {row['product']} | {row['kernel']} | {row['config']} | {row['ms']:.3f} | "
            f"{tflops} | {speedup} | {error} |"
        )
    return "\n".join(lines + [""] + totals_markdown(rows))


def totals_markdown(rows: list[dict]) -> list[str]:
    """Each kernel's time summed over the products of a family (row-ragged, weight-gradient)
    that every kernel of the family finished: the step's view."""
    lines = []
    for family in (ROW_RAGGED, WEIGHT_GRADIENT):
        lines += family_totals_markdown(family, [row for row in rows if row["family"] == family])
    return lines


def family_totals_markdown(family: str, rows: list[dict]) -> list[str]:
    products = {row["product"] for row in rows if row["kernel"] != WORK_TABLE}
    times: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        if row["kernel"] == WORK_TABLE:
            continue
        times.setdefault((row["kernel"], row["config"]), {})[row["product"]] = row.get("ms")
    complete = [
        product for product in products
        if all(by_product.get(product) is not None for by_product in times.values())
    ]
    if not complete:
        return []
    totals = {key: sum(by_product[p] for p in complete) for key, by_product in times.items()}
    bundled = next((total for (kernel, _), total in totals.items()
                    if kernel in (BUNDLED, BUNDLED_TRANSPOSED)), float("nan"))
    lines = [
        f"Summed over the {len(complete)} {family} product(s) every kernel finished:",
        "",
        "| kernel | config | total ms | bundled total / total |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {kernel} | {config} | {total:.3f} | {bundled / total:.3f} |"
        for (kernel, config), total in totals.items()
    ]
    return lines + [""]


def disagreements(rows: list[dict]) -> list[str]:
    """The kernels whose output differs from the reference beyond bf16 rounding, or failed."""
    return [
        f"{row['product']} {row['kernel']} {row['config']}: {row.get('failure') or row['error']}"
        for row in rows
        if "failure" in row or row.get("error", 0.0) > AGREEMENT_TOLERANCE
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench_grouped_matmul",
        description="Row-ragged grouped GEMMs: ours vs JAX's bundled Mosaic GPU kernel vs dense.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--gpu", action="store_true", help="the H200 sizes (131072 rows, 64 groups)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode on CPU")
    parser.add_argument(
        "--expert-mlp", action="store_true",
        help="time the expert MLP with the GLU fused into the GEMM epilogues against unfused",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 20 / 1)")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=sorted(SWEEP_CONFIGS),
        default=list(SWEEP_CONFIGS),
        help="our configs to time (default: all of SWEEP_CONFIGS)",
    )
    parser.add_argument(
        "--weight-grad-configs",
        nargs="+",
        choices=sorted(TRANSPOSED_SWEEP_CONFIGS),
        default=list(TRANSPOSED_SWEEP_CONFIGS),
        help="our weight-gradient configs to time (default: all of TRANSPOSED_SWEEP_CONFIGS)",
    )
    parser.add_argument(
        "--out", default=None, help="markdown table (default with --gpu: "
        "benchmarks/grouped_matmul_<card>.md, with --expert-mlp benchmarks/expert_mlp_<card>.md)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.gpu and jax.default_backend() != "gpu":
        raise SystemExit("--gpu needs a CUDA device; use --smoke on CPU.")
    command = command_line("experiments.bench_grouped_matmul", argv)
    iters = args.iters or (20 if args.gpu else 1)
    if args.expert_mlp:
        size = EXPERT_MLP_GPU_SIZE if args.gpu else EXPERT_MLP_SMOKE_SIZE
        if args.gpu:
            check_fused_path_applies(size)
        passes = (FORWARD, FORWARD_BACKWARD) if args.gpu else (FORWARD,)
        unfused_backend = "mosaic_gpu" if args.gpu else "xla"

        def measure(report):
            return run_expert_mlp(size, unfused_backend, passes, iters, use_cupti=args.gpu,
                                  report=report)

        def render(rows):
            return expert_mlp_markdown(size, rows, command)

        subject, complaint = "expert_mlp", "the fused path disagrees with the unfused one"
    else:
        size = GPU_SIZE if args.gpu else SMOKE_SIZE

        def measure(report):
            return run(size, args.configs, args.weight_grad_configs, iters, use_cupti=args.gpu,
                       report=report)

        def render(rows):
            return markdown(size, rows, command)

        subject, complaint = "grouped_matmul", "outputs disagree with the reference"
    out = args.out or (gpu_table(subject) if args.gpu else None)

    def write_table(rows):
        if out:
            write_markdown(out, render(rows))

    with contextlib.nullcontext() if args.gpu else interpreted_on_cpu(num_sms=4):
        rows = measure(write_table)
    print(render(rows))
    if bad := disagreements(rows):
        raise SystemExit(f"{complaint}:\n" + "\n".join(bad))
    return rows


def check_fused_path_applies(size: ExpertMLPSize) -> None:
    """Exits unless `expert_mlp` would take the fused path at `size` on this device."""
    gate_up_weights = jax.ShapeDtypeStruct(
        (size.experts, size.width, 2 * size.hidden), jnp.bfloat16)
    rows_in = jax.ShapeDtypeStruct((size.rows, size.width), jnp.bfloat16)
    out_weights = jax.ShapeDtypeStruct((size.experts, size.hidden, size.width), jnp.bfloat16)
    if not dispatch.fused_epilogues_apply(rows_in, gate_up_weights, out_weights, "auto"):
        raise SystemExit("expert_mlp would not take the fused path here (needs Hopper).")


if __name__ == "__main__":
    main()
