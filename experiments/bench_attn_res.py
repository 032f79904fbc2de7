"""Times the Block AttnRes bookkeeping of a whole model, the two layouts of the sealed snapshots
side by side, and writes a markdown table.

    python -m experiments.bench_attn_res --gpu     # H200: the `1b` model's stream, bf16
                                                   # -> benchmarks/attn_res_<card>.md
    python -m experiments.bench_attn_res --smoke   # tiny float32 CPU run (the test)

The walk is the `1b` model's: 16 layers (32 sub-layers) sealing every 8 sub-layers, a read
before every sub-layer and one before the final norm, on a [B, T, D] = [4, 4096, 2048] bf16
stream. Each sub-layer is a stand-in, its input times a learned [D] vector, so the time is the
reads, seals and adds. Layouts (`models.attn_res.ResidualStream`):

- "planes": the tuple of exactly the filled snapshots, what layers in a Python loop use;
- "buffer": the fixed [S, B, T, D] buffer with unfilled slots masked, what scanned layers use.

Forward, and forward+backward (gradients in the embedding, every read's gain and query and every
stand-in's vector), medians of `--repeats` calls after `--warmup`; the outputs and gradients of
the layouts are compared (the largest relative L2 difference over them, `harness.relative_error`).
"""

import dataclasses
import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments.harness import (cell, command_line, compiled_once, compiled_peak_mib,
                                 gpu_or_smoke_args, median_seconds, package_version,
                                 relative_error, report_preamble, table_row, timing_cells,
                                 write_markdown)
from models.attn_res import (ResidualStream, attn_res_read, num_seal_slots, seal_period,
                             sublayer_input)

EPS = 1e-6
LAYOUTS = ("buffer", "planes")


@dataclasses.dataclass(frozen=True)
class Setup:
    batch: int
    length: int
    d_model: int
    num_layers: int
    block_size: int  # transformer layers per AttnRes block
    dtype: str

    def __str__(self):
        return (f"[B, T, D] = [{self.batch}, {self.length}, {self.d_model}] {self.dtype}, "
                f"{self.num_layers} layers, blocks of {self.block_size}")


GPU_SETUP = Setup(4, 4096, 2048, 16, 4, "bfloat16")
SMOKE_SETUP = Setup(1, 16, 32, 4, 1, "float32")


def walk(layout: str, setup: Setup):
    """(embedding [B, T, D], params) -> the final read [B, T, D], through every sub-layer."""
    period = seal_period("block_attn_res", setup.block_size)
    num_sublayers = 2 * setup.num_layers

    def run(embedding, params):
        stream = ResidualStream.start(embedding)
        if layout == "buffer":
            stream = stream.stacked(num_seal_slots(num_sublayers, period))
        for sublayer, (gain, query, scale) in enumerate(params["sublayers"]):
            read = functools.partial(attn_res_read, gain=gain, query=query, eps=EPS)
            x, stream = sublayer_input(stream, read, sublayer, period)
            stream = stream.add(x * scale.astype(x.dtype))
        return attn_res_read(stream, *params["final"], EPS)

    return run


class LayoutTiming(NamedTuple):
    """Median ms of one layout's forward and forward+backward, and the latter's compiled MiB."""

    forward_ms: float
    forward_backward_ms: float
    peak_mib: float


def make_inputs(setup: Setup, seed: int = 0):
    keys = iter(jax.random.split(jax.random.key(seed), 3 * 2 * setup.num_layers + 4))
    d = setup.d_model

    def vector():
        return 0.1 * jax.random.normal(next(keys), (d,), jnp.float32)

    params = {"sublayers": [(1.0 + vector(), vector(), 0.5 + vector())
                            for _ in range(2 * setup.num_layers)],
              "final": (1.0 + vector(), vector())}
    embedding = jax.random.normal(next(keys), (setup.batch, setup.length, d), setup.dtype)
    cotangent = jax.random.normal(next(keys), embedding.shape, setup.dtype)
    return embedding, params, cotangent


def forward_backward(run):
    def grads(embedding, params, cotangent):
        out, pullback = jax.vjp(run, embedding, params)
        return out, pullback(cotangent)
    return grads


def measure(setup: Setup, repeats: int, warmup: int) -> tuple[dict, float]:
    """{layout: LayoutTiming} and the largest relative difference of the planes layout's output
    and gradients from the buffer's."""
    embedding, params, cotangent = make_inputs(setup)
    results, outputs = {}, {}
    for layout in LAYOUTS:
        run = walk(layout, setup)
        forward = compiled_once(run, embedding, params)
        both = compiled_once(forward_backward(run), embedding, params, cotangent)
        outputs[layout] = both(embedding, params, cotangent)
        results[layout] = LayoutTiming(
            forward_ms=1e3 * median_seconds(lambda: forward(embedding, params), repeats, warmup),
            forward_backward_ms=1e3 * median_seconds(
                lambda: both(embedding, params, cotangent), repeats, warmup),
            peak_mib=compiled_peak_mib(both),
        )
        print(f"{layout}: {results[layout]}", flush=True)
    return results, relative_error(outputs["planes"], outputs["buffer"])


def write_table(path: Path, results: dict, difference: float, setup: Setup, command: str):
    base = results["buffer"]
    lines = report_preamble("Block AttnRes bookkeeping, snapshot layouts", command,
                            f"jaxlib {package_version('jaxlib')}") + [
        f"- Walk: {setup}; every sub-layer a read, a stand-in product and an add",
        f"- Planes vs buffer, largest relative L2 difference of output and gradients: "
        f"{difference:.1e}",
        "",
        "| layout | forward ms | fwd+bwd ms | fwd speedup | fwd+bwd speedup | peak MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layout, timing in results.items():
        lines.append(table_row(layout, *timing_cells(timing, base, ".3f"),
                               cell(timing.peak_mib, ".0f")))
    write_markdown(path, lines)


def main(argv=None):
    args = gpu_or_smoke_args(argv, __doc__.split("\n\n")[0], "attn_res",
                             gpu_help="the 1b model's stream, bf16",
                             smoke_help="a tiny float32 run (CPU check)")
    setup = GPU_SETUP if args.gpu else SMOKE_SETUP
    results, difference = measure(setup, args.repeats, args.warmup)
    print(f"planes vs buffer: largest relative difference {difference:.1e}")
    if args.out is not None:
        command = command_line("experiments.bench_attn_res", argv)
        write_table(args.out, results, difference, setup, command)
        print(f"wrote {args.out}")
    return results, difference


if __name__ == "__main__":
    main()
