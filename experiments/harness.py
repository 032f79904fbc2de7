"""What the benchmarks share: wall time, device time, compile once, compiled memory, the error
metric their rows (and the tests) check outputs with, and the tables and JSON they write.

Timing: `median_seconds` waits for each call before the next (dispatch included);
`pipelined_seconds` keeps one call in flight, as `train.loop` issues steps; `device_ms` sums the
device ops of one call from a profiler trace (`experiments.profiling`), the kernels' work without
the host's. `compiled_once` compiles a function for its arguments so that the timed executable is
the memory-analysed one (`compiled_peak_mib`: arguments + outputs + temporaries).

`relative_error` compares two arrays, or two pytrees leaf by leaf, in float32:

    norm="l2":  ||actual - expected||_2 / ||expected||_2        over all elements (fla's metric)
    norm="max": max |actual - expected| / max |expected|        the worst element, against the scale

For pytrees the worst leaf counts. An all-zero `expected` leaf is compared against 1e-30, so any
difference there shows as a huge error rather than a division by zero. A NaN or infinity on either
side gives inf, so that no comparison (`error <= tolerance` or `error > tolerance`) passes it.

Tables: `report_preamble` (title, device, command, date, versions), `table_row`, `cell`,
`timing_cells` (times and speedups over a baseline row), `write_markdown` and `write_json`, which
replace the file whole. `gpu_or_smoke_args` is the command line of a benchmark with a `--gpu`
size, whose table goes to `benchmarks/<subject>_<card>.md` by default (`gpu_table`), and a CPU
`--smoke` size.

Card names (`card_slug`): the device kind's first word holding a digit, its model number,
lowercased ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB"
-> "a100"); a kind with no such word gives all its words joined by "-" ("cpu"). So a run on an
H100 writes `*_h100.md` and never overwrites an H200's table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from experiments.profiling import profile_device_ops


def relative_error(actual, expected, *, norm: str = "l2") -> float:
    """Relative error of `actual` against `expected` (arrays or matching pytrees), float32."""
    if norm not in ("l2", "max"):
        raise ValueError(f"norm must be 'l2' or 'max', got {norm!r}")
    leaves_a, leaves_e = jax.tree.leaves(actual), jax.tree.leaves(expected)
    if len(leaves_a) != len(leaves_e):
        raise ValueError(f"actual has {len(leaves_a)} leaves, expected {len(leaves_e)}")
    worst = 0.0
    for a, e in zip(leaves_a, leaves_e):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        if a.shape != e.shape:
            raise ValueError(f"shapes differ: actual {a.shape}, expected {e.shape}")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(e))):
            return float("inf")
        if norm == "l2":
            error, scale = np.linalg.norm(a - e), np.linalg.norm(e)
        else:
            error, scale = np.max(np.abs(a - e), initial=0.0), np.max(np.abs(e), initial=0.0)
        worst = max(worst, float(error) / max(float(scale), 1e-30))
    return worst


def median_seconds(run: Callable[[], object], steps: int, warmup: int) -> float:
    """Median wall time of `run()` (which must return arrays to wait for) after `warmup` calls,
    each call waited for before the next is issued."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipelined_seconds(run: Callable[[], object], steps: int, warmup: int) -> float:
    """Median time between the ends of consecutive `run()` calls issued as `train.loop` issues
    training steps: each one dispatched before waiting for the one before it (one call in
    flight), so the host's dispatch of a call overlaps the device's work on the previous one.
    `median_seconds` waits for each call before issuing the next, so it counts the dispatch too.
    """
    for _ in range(warmup):
        jax.block_until_ready(run())
    jax.block_until_ready(run())
    last, in_flight = time.perf_counter(), run()
    intervals = []
    for _ in range(steps + 1):  # the first interval holds the dispatch of a call: dropped
        following = run()
        jax.block_until_ready(in_flight)
        now = time.perf_counter()
        intervals.append(now - last)
        last, in_flight = now, following
    jax.block_until_ready(in_flight)
    return statistics.median(intervals[1:])


def compiled_once(fn: Callable, *args) -> jax.stages.Compiled:
    """`fn` compiled once for `args`: timed and memory-analysed from the same executable. Every
    array is an argument, never a closed-over constant (XLA would fold it into the program)."""
    return jax.jit(fn).lower(*args).compile()


def compiled_peak_mib(compiled: jax.stages.Compiled) -> float:
    """Arguments + outputs + temporaries of one compiled call, from XLA's memory analysis, in
    MiB (0 where the backend gives no analysis)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0.0
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return total / 2**20


def device_ms(fn: Callable, args: tuple) -> float | None:
    """The summed device-op time of one call of `fn(*args)`, from a profiler trace of three calls
    (`experiments.profiling.profile_device_ops`); None if the trace held no ops."""
    ops = profile_device_ops(jax.jit(fn), args, steps=3)
    return ops["total_ms"] if ops["rows"] else None


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command a benchmark was run with, for its table: `python -m <module> <arguments>`
    (argv None: this process's own arguments)."""
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


def package_version(package: str) -> str:
    """The installed version of `package`, or "not installed"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report_preamble(title: str, command: str, versions: str) -> list[str]:
    """A benchmark table's first lines: `title` and the device, the command, the date and the
    versions (python and jax, then `versions`)."""
    return [
        f"# {title} on {jax.devices()[0].device_kind}",
        "",
        f"- Command: `{command}`",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Versions: python {platform.python_version()}, jax {jax.__version__}, {versions}",
    ]


def cell(value, fmt: str) -> str:
    """`value` formatted with `fmt`, or "–" for None."""
    return "–" if value is None else format(value, fmt)


def table_row(*cells: str) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"


def speedup(ours, theirs):
    """theirs / ours (above 1: ours is faster), or None where either time is missing."""
    return None if ours is None or theirs is None else theirs / ours


def timing_cells(timing, base, fmt: str) -> list[str]:
    """A row's forward and forward+backward times (format `fmt`) and their speedups over the
    baseline row's `base` (any objects with `forward_ms` and `forward_backward_ms`)."""
    return [cell(timing.forward_ms, fmt), cell(timing.forward_backward_ms, fmt),
            cell(speedup(timing.forward_ms, base.forward_ms), ".2f"),
            cell(speedup(timing.forward_backward_ms, base.forward_backward_ms), ".2f")]


def write_markdown(path: Path | str, lines: Sequence[str] | str):
    """Replaces `path` (its folder made if missing) with `lines`, one a line, or with a text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(lines if isinstance(lines, str) else "\n".join(lines) + "\n")


def write_json(path: Path | str, data):
    """Replaces `path` (its folder made if missing) with `data` as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def card_slug(device_kind: str) -> str:
    """A short lowercase name of the card `device_kind` names (a `jax.Device.device_kind`): its
    first word holding a digit ("NVIDIA H100 80GB HBM3" -> "h100"), else all its words joined by
    "-" ("cpu"). Words are runs of letters and digits."""
    words = re.findall(r"[a-z0-9]+", device_kind.lower())
    if not words:
        raise ValueError(f"device_kind {device_kind!r} has no letters or digits to name a card by")
    return next((word for word in words if any(c.isdigit() for c in word)), "-".join(words))


def gpu_table(subject: str) -> Path:
    """`benchmarks/<subject>_<card>.md`, the default table of a `--gpu` run on this process's
    first device (`card_slug`): `gpu_table("moe")` is benchmarks/moe_h100.md on an H100."""
    return Path("benchmarks") / f"{subject}_{card_slug(jax.devices()[0].device_kind)}.md"


def gpu_or_smoke_args(argv, description: str, subject: str | Callable[[argparse.Namespace], str],
                      gpu_help: str, smoke_help: str,
                      add_options=lambda parser: None) -> argparse.Namespace:
    """The options of a small benchmark: --gpu or --smoke, --repeats, --warmup, --out (its
    markdown table; with --gpu, `gpu_table(subject)` unless given, `subject(args)` where the
    table depends on the options; with --smoke, none unless given), and what
    `add_options(parser)` adds. --gpu on a backend other than CUDA is refused."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--gpu", action="store_true", help=gpu_help)
    size.add_argument("--smoke", action="store_true", help=smoke_help)
    add_options(parser)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        help="markdown table (--gpu default: "
                        + (f"benchmarks/{subject}_<card>.md)" if isinstance(subject, str) else
                           "benchmarks/<subject>_<card>.md, the subject named for the options)"))
    args = parser.parse_args(argv)
    if args.gpu and jax.default_backend() != "gpu":
        parser.error(f"--gpu needs a CUDA backend, but JAX runs on {jax.default_backend()!r}")
    if args.out is None and args.gpu:
        args.out = gpu_table(subject(args) if callable(subject) else subject)
    return args
