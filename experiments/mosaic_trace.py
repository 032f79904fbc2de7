"""Reads the in-kernel traces Mosaic GPU writes, per named region: where a kernel's cycles go.

    python -m experiments.mosaic_trace TRACE.json[.gz] [--period REGION]

How to take one: in a copy of the kernel's module, put `with jax.named_scope("name"):` around the
steps to time, and give the launch's `plgpu.CompilerParams` `profile_space=S` (ranges recorded a
warpgroup; a scope in a loop records one range an iteration) and `profile_dir=DIR`. Each call
then writes a Perfetto trace per kernel into DIR. The region times are `%clock` cycles in
thousands although the trace labels them microseconds (only each program's start uses the
global timer), so this module reports cycles. The KDA notes (`benchmarks/kda_notes.md`) read the
preparation and recurrence kernels' traces this way.

For each region it gives the median and mean cycles over all its ranges (every program, every
iteration); for each pair of consecutive regions in one warpgroup's stream the median gap
between them (what no region covers: the code between scopes, or a wait outside them); and with
`--period REGION` the median cycles from one start of REGION to the next (a loop's step).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

CYCLES_PER_UNIT = 1000  # the trace's "us" are thousands of %clock cycles


class RegionStats(NamedTuple):
    median_cycles: float
    mean_cycles: float
    count: int


class TraceSummary(NamedTuple):
    """Cycles per named region, per gap between consecutive regions ("a -> b"), and per period
    of a region (start to start, within a warpgroup), with the number of warpgroup streams."""

    regions: dict[str, RegionStats]
    gaps: dict[str, RegionStats]
    periods: dict[str, RegionStats]
    streams: int


def _stats(values: Sequence[float]) -> RegionStats:
    cycles = [value * CYCLES_PER_UNIT for value in values]
    return RegionStats(statistics.median(cycles), statistics.mean(cycles), len(cycles))


def summarize(events: Iterable[dict], period_regions: Sequence[str] = ()) -> TraceSummary:
    """Summarizes a Mosaic GPU trace's events ("B"/"E" pairs of named ranges, one stream per
    (pid, tid): a warpgroup of a program).

    Raises ValueError on an "E" without its "B" (a trace cut short by too small a
    `profile_space`).
    """
    streams = collections.defaultdict(list)
    for event in events:
        if event.get("ph") in ("B", "E"):
            streams[event["pid"], event["tid"]].append(event)
    durations, gaps = collections.defaultdict(list), collections.defaultdict(list)
    starts = collections.defaultdict(list)
    for stream, stream_events in streams.items():
        open_ranges, last_end = [], None
        for event in stream_events:
            if event["ph"] == "B":
                if last_end is not None and not open_ranges:
                    name, end = last_end
                    gaps[f"{name} -> {event['name']}"].append(event["ts"] - end)
                open_ranges.append(event)
                starts[stream, event["name"]].append(event["ts"])
                continue
            if not open_ranges:
                raise ValueError(f"an end of {event.get('name')!r} without its start in stream "
                                 f"{stream}: was profile_space too small for the trace?")
            begin = open_ranges.pop()
            durations[begin["name"]].append(event["ts"] - begin["ts"])
            last_end = (begin["name"], event["ts"])
    periods = {}
    for region in period_regions:
        steps = [later - earlier for (stream, name), times in starts.items() if name == region
                 for earlier, later in zip(times, times[1:])]
        if steps:
            periods[region] = _stats(steps)
    return TraceSummary({name: _stats(values) for name, values in durations.items()},
                        {name: _stats(values) for name, values in gaps.items()}, periods,
                        len(streams))


def load_events(path: Path) -> list[dict]:
    """The events of a trace file as Mosaic GPU writes it (JSON, or gzipped JSON)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def summary_markdown(summary: TraceSummary) -> list[str]:
    lines = [f"{summary.streams} warpgroup streams; cycles (median, mean, ranges):", "",
             "| region | median | mean | ranges |", "|---|---:|---:|---:|"]
    for kind, table in (("", summary.regions), ("gap ", summary.gaps),
                        ("period ", summary.periods)):
        for name, stats in table.items():
            lines.append(f"| {kind}{name} | {stats.median_cycles:.0f} | {stats.mean_cycles:.0f} "
                         f"| {stats.count} |")
    return lines


def main(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a trace Mosaic GPU wrote (.json or .json.gz)")
    parser.add_argument("--period", nargs="*", default=[], metavar="REGION",
                        help="also the cycles from one start of REGION to the next")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"trace: no such file {args.trace}")
    print("\n".join(summary_markdown(summarize(load_events(args.trace), args.period))))


if __name__ == "__main__":
    main()
