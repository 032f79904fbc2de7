"""Times the KDA layer's short convolution and SiLU (`kda.layer.conv_silu_parts`), its XLA path
and its Pallas kernels side by side, and writes a markdown table.

    python -m experiments.bench_short_conv --gpu     # H200: the `1b` layer's q|k|v,
                                                     # -> benchmarks/short_conv_<card>.md
    python -m experiments.bench_short_conv --smoke   # tiny CPU run, kernels interpreted (the test)
    python -m experiments.bench_short_conv --gpu --tiles 32x128/4 32x128/4/recompute
                                                     # other blocks or backward schemes

The input is what the `1b` preset's KDA layer convolves: the q|k|v projection [B, T, C] =
[4, 4096, 6144] bf16 (q, k and v of 2048 channels each), a float32 [4, C] filter, and four packed
documents a row. Forward (the three parts) and forward+backward (x's and the filter's cotangents
from the parts' cotangents), medians of `--repeats` calls; both paths are compared with the
float32 answer. Wall times include the host's dispatch of each call, a large part of a sub-ms
call; the device columns sum one call's device ops from a profiler trace. `--tiles` times the
kernels with other blocks (tokens x channels / warps) and backward schemes
(`kda.kernels.triton.short_conv.KernelOptions`), one row each; the first is the default,
`kda.kernels.triton.short_conv.OPTIONS`.
"""

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from experiments.harness import (cell, command_line, compiled_once, compiled_peak_mib, device_ms,
                                 gpu_or_smoke_args, median_seconds, package_version,
                                 relative_error, report_preamble, table_row, timing_cells,
                                 write_markdown)
from kda.common import document_index
from kda.layer import conv_silu_parts
from kda.kernels.triton import short_conv


@dataclasses.dataclass(frozen=True)
class Setup:
    batch: int
    length: int
    widths: tuple[int, ...]
    width: int  # taps of the filter
    documents: int  # packed documents a row

    def __str__(self):
        return (f"x [B, T, C] = [{self.batch}, {self.length}, {sum(self.widths)}] bf16 split "
                f"{'|'.join(map(str, self.widths))}, {self.width} taps, {self.documents} "
                "documents a row")


GPU_SETUP = Setup(4, 4096, (2048, 2048, 2048), 4, 4)
SMOKE_SETUP = Setup(1, 64, (128, 128, 128), 4, 2)


class PathTiming(NamedTuple):
    """Median wall ms of one path's forward and forward+backward, their device-op ms (one call's
    ops summed from a profiler trace: no host dispatch, which is a large part of a sub-ms call's
    wall time), and the forward+backward's compiled MiB."""

    forward_ms: float
    forward_backward_ms: float
    forward_device_ms: float | None
    forward_backward_device_ms: float | None
    peak_mib: float


def make_inputs(setup: Setup, seed: int = 0):
    """x, the filter, segment ids (equal documents a row) and the parts' cotangents."""
    keys = jax.random.split(jax.random.key(seed), 2 + len(setup.widths))
    channels = sum(setup.widths)
    x = jax.random.normal(keys[0], (setup.batch, setup.length, channels), jnp.bfloat16)
    weight = jax.random.uniform(keys[1], (setup.width, channels), jnp.float32, -0.5, 0.5)
    segment_ids = jnp.broadcast_to(
        jnp.arange(setup.length) * setup.documents // setup.length, (setup.batch, setup.length))
    grads = tuple(jax.random.normal(k, (setup.batch, setup.length, w), jnp.bfloat16)
                  for k, w in zip(keys[2:], setup.widths))
    return x, weight, segment_ids, grads


def path_functions(options: short_conv.KernelOptions | None, widths, interpret: bool):
    """(forward, forward_backward) of the XLA path (options None) or of the kernels with
    `options`:
    (x, weight, segment_ids[, grads]) -> parts and, for the latter, (parts, (dx, d_weight))."""
    if options is None:
        def forward(x, weight, segment_ids):
            return conv_silu_parts(x, weight, segment_ids, widths, kernels=False)

        def forward_backward(x, weight, segment_ids, grads):
            parts, pullback = jax.vjp(lambda x, w: forward(x, w, segment_ids), x, weight)
            return parts, pullback(grads)
        return forward, forward_backward

    def kernel_forward(x, weight, segment_ids):
        document = document_index(segment_ids)
        return short_conv.conv_silu_forward(x, weight, document, widths, options=options,
                                            interpret=interpret)

    def kernel_forward_backward(x, weight, segment_ids, grads):
        document = document_index(segment_ids)  # as `conv_silu_parts`' custom VJP runs them
        parts = short_conv.conv_silu_forward(x, weight, document, widths, options=options,
                                             interpret=interpret)
        return parts, short_conv.conv_silu_backward(x, weight, document, grads, options=options,
                                                    interpret=interpret)
    return kernel_forward, kernel_forward_backward


def exact(x, weight, segment_ids, grads, widths):
    """The float32 answer: the XLA path on x in float32."""
    _, forward_backward = path_functions(None, widths, interpret=False)
    return forward_backward(x.astype(jnp.float32), weight, segment_ids,
                            tuple(g.astype(jnp.float32) for g in grads))


def measure(setup: Setup, repeats: int, warmup: int, interpret: bool,
            kernels: list[short_conv.KernelOptions]) -> dict:
    """{path: (PathTiming, largest relative error of its outputs and cotangents)}: "xla", then
    "pallas <options>" for each of `kernels`."""
    x, weight, segment_ids, grads = make_inputs(setup)
    truth = jax.jit(functools.partial(exact, widths=setup.widths))(x, weight, segment_ids, grads)
    results = {}
    for options in [None, *kernels]:
        path = "xla" if options is None else f"pallas {options}"
        forward, forward_backward = path_functions(options, setup.widths, interpret)
        fwd = compiled_once(forward, x, weight, segment_ids)
        both = compiled_once(forward_backward, x, weight, segment_ids, grads)
        error = relative_error(both(x, weight, segment_ids, grads), truth, norm="max")
        timing = PathTiming(
            forward_ms=1e3 * median_seconds(lambda: fwd(x, weight, segment_ids), repeats,
                                            warmup),
            forward_backward_ms=1e3 * median_seconds(
                lambda: both(x, weight, segment_ids, grads), repeats, warmup),
            forward_device_ms=device_ms(forward, (x, weight, segment_ids)),
            forward_backward_device_ms=device_ms(forward_backward,
                                                 (x, weight, segment_ids, grads)),
            peak_mib=compiled_peak_mib(both),
        )
        results[path] = (timing, error)
        print(f"{path}: {timing}, largest relative error {error:.1e}", flush=True)
    return results


def _device(timing: PathTiming) -> PathTiming:
    """The timing with its device ms where `timing_cells` reads the wall ms."""
    return timing._replace(forward_ms=timing.forward_device_ms,
                           forward_backward_ms=timing.forward_backward_device_ms)


def write_table(path: Path, results: dict, setup: Setup, command: str):
    base = results["xla"][0]
    lines = report_preamble("KDA short convolution + SiLU", command,
                            f"jaxlib {package_version('jaxlib')}") + [
        f"- Input: {setup}",
        "- Error: largest |difference| over the largest |value|, of the parts and both "
        "cotangents, against the float32 answer",
        "",
        "- Device ms: one call's device ops summed from a profiler trace (no host dispatch); "
        "speedups over the xla row",
        "",
        "| path | forward ms | fwd+bwd ms | fwd speedup | fwd+bwd speedup | forward device ms | "
        "fwd+bwd device ms | fwd device speedup | fwd+bwd device speedup | peak MiB | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (timing, error) in results.items():
        lines.append(table_row(name, *timing_cells(timing, base, ".3f"),
                               *timing_cells(_device(timing), _device(base), ".3f"),
                               cell(timing.peak_mib, ".0f"), cell(error, ".1e")))
    write_markdown(path, lines)


def parse_options(text: str) -> short_conv.KernelOptions:
    """"32x128/4" -> KernelOptions(tokens=32, channels=128, warps=4); a last "/recompute" (or
    "/two_pass") picks the backward scheme."""
    try:
        block, warps, *backward = text.split("/")
        tokens, channels = block.split("x")
        return short_conv.KernelOptions(int(tokens), int(channels), int(warps.rstrip("w")),
                                        *backward)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(
            f"kernel options are TOKENSxCHANNELS/WARPS[/BACKWARD], e.g. 32x128/4 or "
            f"32x128/4/recompute, got {text!r} ({error})") from None


def main(argv=None):
    def tiles_option(parser):
        parser.add_argument("--tiles", nargs="+", type=parse_options,
                            default=[short_conv.OPTIONS], metavar="TxC/W[/BACKWARD]",
                            help="kernels to time: tokens x channels / warps, and optionally "
                            f"the backward scheme, one of {short_conv.BACKWARDS} "
                            f"(default {short_conv.OPTIONS})")

    args = gpu_or_smoke_args(argv, __doc__.split("\n\n")[0], "short_conv",
                             gpu_help="the 1b layer's q|k|v, on the GPU",
                             smoke_help="a tiny run, kernels in interpret mode (CPU check)",
                             add_options=tiles_option)
    setup = GPU_SETUP if args.gpu else SMOKE_SETUP
    results = measure(setup, args.repeats, args.warmup, interpret=args.smoke,
                      kernels=args.tiles)
    if args.out is not None:
        command = command_line("experiments.bench_short_conv", argv)
        write_table(args.out, results, setup, command)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
