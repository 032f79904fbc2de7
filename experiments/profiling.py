"""How long a step takes (`median_seconds`) and where it spends its device time
(`profile_device_ops`: a `jax.profiler` trace of a few calls, read back with
`jax.profiler.ProfileData`, summed per op and labelled with the op's HLO opcode, shape and JAX
source op). Used by the benchmarks, and by their `--profile` options."""

from __future__ import annotations

import collections
import glob
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable

import jax


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


def profile_compiler_options() -> dict:
    """Compiler options for a profiled executable: on GPUs no command buffers (CUDA graphs),
    which would show up in the trace as one opaque op, so that each kernel is its own event."""
    return {"xla_gpu_enable_command_buffer": ""} if jax.default_backend() == "gpu" else {}


def profile_device_ops(step: Callable, args: tuple, steps: int, top: int = 25) -> dict:
    """Device ops of `steps` traced calls of a jitted step (compiled here with
    `profile_compiler_options`), summed per op, the costliest first (`trace_device_ops`)."""
    compiled = step.lower(*args).compile(compiler_options=profile_compiler_options())
    return trace_device_ops(lambda: compiled(*args), compiled, steps, top)


def trace_device_ops(run: Callable[[], object], compiled: jax.stages.Compiled, steps: int,
                     top: int = 25) -> dict:
    """Device ops of `steps` traced calls of `run()`, which calls `compiled` (compiled with
    `profile_compiler_options`), summed per op, the costliest first.

    Returns dict(rows=[dict(op, calls, ms, share, hlo)], total_ms, source): per-step calls and ms;
    `hlo` = opcode, shape and JAX source op of the op in the compiled module. Falls back to the
    compiled module's `cost_analysis()` totals (rows empty) if the trace holds no op events.
    """
    jax.block_until_ready(run())
    times, calls, source = collections.Counter(), collections.Counter(), "none"
    with tempfile.TemporaryDirectory() as trace_dir:
        # A profiler that cannot start (no CUPTI) or a trace that does not parse must not cost
        # the benchmark run its other numbers: the table then says why and gives the fallback.
        try:
            jax.profiler.start_trace(trace_dir)
            try:
                for _ in range(steps):
                    jax.block_until_ready(run())
            finally:
                jax.profiler.stop_trace()
            traces = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
            profile = jax.profiler.ProfileData.from_file(max(traces, key=os.path.getmtime))
            times, calls, source = _op_times(profile)
        except Exception as error:  # noqa: BLE001 (reported in the table, see above)
            source = f"trace failed: {type(error).__name__}: {error}"
    if not times:
        cost = compiled.cost_analysis() or {}
        return dict(rows=[], total_ms=0.0, source=source, cost_analysis=dict(cost))
    described = _hlo_descriptions(compiled.as_text())
    total = sum(times.values())
    rows = [
        dict(
            op=op,
            calls=calls[op] / steps,
            ms=nanos / steps / 1e6,
            share=nanos / total,
            hlo=described.get(op, ""),
        )
        for op, nanos in times.most_common(top)
    ]
    return dict(rows=rows, total_ms=total / steps / 1e6, source=source)


def _op_times(profile) -> tuple[collections.Counter, collections.Counter, str]:
    """Per-op total ns and call counts of a trace: the GPU's "XLA Ops" line where there is one,
    else the kernels on its stream lines; on CPU the host threads' events that name an HLO op."""
    times, calls = collections.Counter(), collections.Counter()
    device_planes = [plane for plane in profile.planes if plane.name.startswith("/device:")]
    if device_planes:
        lines = [line for plane in device_planes for line in plane.lines]
        op_lines = [line for line in lines if line.name == "XLA Ops"]
        source = "XLA Ops" if op_lines else "device streams"
        lines = op_lines or [line for line in lines if line.name.startswith("Stream")]
    else:
        source = "host threads"
        host_planes = [plane for plane in profile.planes if plane.name == "/host:CPU"]
        lines = [line for plane in host_planes for line in plane.lines]
    for line in lines:
        for event in line.events:
            stats = dict(event.stats)
            if source == "host threads" and "hlo_op" not in stats:
                continue
            name = str(stats.get("hlo_op", event.name)).lstrip("%")
            times[name] += event.duration_ns
            calls[name] += 1
    return times, calls, source


MAX_SHAPE_CHARS = 160
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s(?P<opcode>[a-z][a-z0-9\-]*)\("
)


def _hlo_descriptions(hlo_text: str) -> dict[str, str]:
    """Instruction name -> "opcode shape (kind, custom-call target) source-op" of an HLO module."""
    described = {}
    for line in hlo_text.splitlines():
        match = _HLO_INSTRUCTION.match(line)
        if not match:
            continue
        shape = re.sub(r"\{[^}]*\}", "", match["shape"])
        # A while loop's tuple carries every buffer of its body: its head says enough.
        parts = [match["opcode"], shape if len(shape) <= MAX_SHAPE_CHARS
                 else shape[:MAX_SHAPE_CHARS] + "…"]
        for key in ("kind", "custom_call_target"):
            found = re.search(rf"{key}=\"?([\w.\-]+)", line)
            if found:
                parts.append(found.group(1))
        source = re.search(r'op_name="([^"]*)"', line)
        if source:
            parts.append(source.group(1).split("/", 1)[-1])
        described[match["name"]] = " ".join(parts)
    return described


def ops_markdown(ops: dict, title: str) -> list[str]:
    """Markdown lines for `profile_device_ops`' result under the sentence `title`."""
    lines = [f"{title} (trace: {ops['source']}).", ""]
    if not ops["rows"]:
        return lines + [
            "The trace held no op events; cost analysis of the compiled step instead: "
            f"{ops['cost_analysis']}",
            "",
        ]
    lines += [
        f"Total op time per step: {ops['total_ms']:.3f} ms.",
        "",
        "| op | calls/step | ms/step | share | HLO (opcode shape kind source) |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [
        f"| {row['op']} | {row['calls']:g} | {row['ms']:.3f} | {row['share']:.1%} | "
        f"{row['hlo'].replace('|', '/')} |"
        for row in ops["rows"]
    ]
    return lines + [""]
