"""How long a step takes (`median_seconds`) and where it spends its device time
(`profile_device_ops`: a `jax.profiler` trace of a few calls, read back with
`jax.profiler.ProfileData`, summed per op and labelled with the op's HLO opcode, shape and JAX
source op, and summed per named scope of the program, `scope_times`). Used by the benchmarks, and
by their `--profile` options."""

from __future__ import annotations

import collections
import functools
import glob
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

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


def profile_device_ops(step: Callable, args: tuple, steps: int, top: int = 25,
                       scopes: Sequence[str] = ()) -> dict:
    """Device ops of `steps` traced calls of a jitted step (compiled here with
    `profile_compiler_options`), summed per op, the costliest first (`trace_device_ops`)."""
    compiled = step.lower(*args).compile(compiler_options=profile_compiler_options())
    return trace_device_ops(lambda: compiled(*args), compiled, steps, top, scopes)


def trace_device_ops(run: Callable[[], object], compiled: jax.stages.Compiled, steps: int,
                     top: int = 25, scopes: Sequence[str] = (), top_per_scope: int = 8) -> dict:
    """Device ops of `steps` traced calls of `run()`, which calls `compiled` (compiled with
    `profile_compiler_options`), summed per op, the costliest first, and per named scope.

    Returns dict(rows=[dict(op, calls, ms, share, hlo)], total_ms, source, scopes, passes,
    scope_rows): per-step calls and ms; `hlo` = opcode, shape and JAX source op of the op in the
    compiled module; `scopes` = ms per step of each of `scopes` and "other" over all ops, `passes`
    the same split per pass, {scope: {pass: ms}} (`scope_times`); `scope_rows` = the
    `top_per_scope` costliest rows of each scope. On a CPU the events of while loops and
    conditionals are left out: each spans the ops it runs, which count on their own. Falls back to the compiled module's `cost_analysis()` totals (rows and scopes empty) if
    the trace holds no op events.
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
        return dict(rows=[], total_ms=0.0, source=source, scopes={}, passes={}, scope_rows={},
                    cost_analysis=dict(cost))
    instructions = hlo_instructions(compiled.as_text())
    if source == "host threads":
        times = collections.Counter({
            op: nanos for op, nanos in times.items()
            if op not in instructions or instructions[op].opcode not in CONTROL_FLOW_OPCODES})
    total = sum(times.values())

    def row(op, nanos):
        return dict(op=op, calls=calls[op] / steps, ms=nanos / steps / 1e6, share=nanos / total,
                    hlo=instructions[op].description if op in instructions else "")

    op_names = {op: instruction.op_name for op, instruction in instructions.items()}
    passes = {scope: {name: nanos / steps / 1e6 for name, nanos in per_pass.items()}
              for scope, per_pass in scope_times(times, op_names, scopes).items()}
    by_scope = collections.defaultdict(list)  # scope -> its ops, costliest first
    for op, nanos in times.most_common():
        by_scope[scope_of(op_names.get(op, ""), scopes) or OTHER_SCOPE].append(row(op, nanos))
    return dict(rows=[row(op, nanos) for op, nanos in times.most_common(top)],
                total_ms=total / steps / 1e6, source=source, passes=passes,
                scopes={scope: sum(per_pass.values()) for scope, per_pass in passes.items()},
                scope_rows={scope: by_scope[scope][:top_per_scope] for scope in passes})


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
CONTROL_FLOW_OPCODES = ("while", "conditional", "call")
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s(?P<opcode>[a-z][a-z0-9\-]*)\("
)


class HloInstruction(NamedTuple):
    """What a compiled HLO module says of one instruction.

    opcode: the HLO opcode ("fusion", "while", ...).
    description: "opcode shape (kind, custom-call target) source-op", source-op being the op_name
      without its outermost `jit(...)`.
    op_name: the op_name metadata, JAX's name stack and primitive (e.g.
      "jit(step)/transpose(jvp())/while/body/eval_jaxpr/checkpoint/kda/mul"); "" where XLA left
      none (instructions it created itself, such as copies).
    """

    opcode: str
    description: str
    op_name: str


def hlo_instructions(hlo_text: str) -> dict[str, HloInstruction]:
    """Instruction name -> `HloInstruction` of every instruction of an HLO module's text.

    An instruction with no op_name of its own that calls a computation (`calls=`: the fusions
    XLA:CPU wraps around a library call or a copy, `ynn_fusion`, `wrapped_copy`) takes the op_name
    of the last instruction of that computation that has one (its root, where the root has one).
    """
    parsed = {}  # name -> (description parts, op_name, called computation or None)
    computations = collections.defaultdict(list)  # computation -> its instructions, in order
    computation = ""
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{"):
            computation = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            continue
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
        called = re.search(r"calls=%?([\w.\-]+)", line)
        parsed[match["name"]] = (parts, source.group(1) if source else "",
                                 called.group(1) if called else None)
        computations[computation].append(match["name"])

    @functools.cache
    def op_name_of(name: str) -> str:
        _, own, called = parsed[name]
        if own or called is None:
            return own
        return next(filter(None, map(op_name_of, reversed(computations[called]))), "")

    instructions = {}
    for name, (parts, _, _) in parsed.items():
        op_name = op_name_of(name)
        source = [op_name.split("/", 1)[-1]] if op_name else []
        instructions[name] = HloInstruction(parts[0], " ".join(parts + source), op_name)
    return instructions


OTHER_SCOPE = "other"
_TRANSFORM = re.compile(r"^[\w\-]*\((.*)\)$")  # "transpose(jvp(kda))": the scope inside


def scope_of(op_name: str, scopes: Sequence[str]) -> str | None:
    """The innermost of `scopes` that an op_name's name stack passes through; None if none does.

    op_name: "/"-separated JAX name stack ending in the primitive, as `HloInstruction.op_name`.
    A component may be wrapped in transformations, `transpose(jvp(kda))` or `vmap(jit(f))`; the
    name inside counts. In the backward pass a scope appears either so wrapped
    (`transpose(jvp(kda))/...`) or, under `jax.checkpoint` or in a scanned body, bare
    (`transpose(jvp())/while/body/eval_jaxpr/checkpoint/kda/...`). Innermost: an op under `moe`
    inside `layer` belongs to `moe`. XLA joins the op_names of instructions it merged with ";";
    the first that passes through a scope decides.
    """
    wanted = set(scopes)
    for path in op_name.split(";"):
        found = None
        for component in path.split("/")[:-1]:  # the last is the primitive, not a scope
            while (wrapped := _TRANSFORM.match(component)) is not None:
                component = wrapped.group(1)
            if component in wanted:
                found = component
        if found is not None:
            return found
    return None


PASSES = ("forward", "recompute", "backward")


def pass_of(op_name: str) -> str:
    """The pass of a training step an op_name belongs to: "recompute" (a forward that
    `jax.checkpoint` runs again in the backward pass: `.../rematted_computation/...`), "backward"
    (under `transpose(...)`), else "forward" (the undifferentiated rest, the optimizer's update
    too). Merged op_names (";"): the first decides."""
    path = op_name.split(";")[0]
    if "rematted_computation" in path:
        return "recompute"
    return "backward" if "transpose(" in path else "forward"


def scope_times(op_times: Mapping[str, float], op_names: Mapping[str, str],
                scopes: Sequence[str]) -> dict[str, dict[str, float]]:
    """The time of every op summed per scope (`scope_of` its op_name), in the order of `scopes`,
    then OTHER_SCOPE (the ops under none of them and those without an op_name), and within each
    per pass (`pass_of`, in the order of PASSES).

    op_times: op (HLO instruction name) -> time; op_names: op -> op_name metadata.
    """
    if OTHER_SCOPE in scopes:
        raise ValueError(f"scopes must not contain {OTHER_SCOPE!r}, the name of the rest; "
                         f"got {tuple(scopes)}")
    totals = {scope: dict.fromkeys(PASSES, 0.0) for scope in (*scopes, OTHER_SCOPE)}
    for op, time_taken in op_times.items():
        op_name = op_names.get(op, "")
        totals[scope_of(op_name, scopes) or OTHER_SCOPE][pass_of(op_name)] += time_taken
    return totals


def scopes_markdown(ops: dict, title: str) -> list[str]:
    """Markdown lines for the `scopes` of `trace_device_ops`' result under the sentence `title`:
    each scope that took time, its ms per step in each pass and in all, and its share of all ops'
    time (none without a trace)."""
    if not ops["scopes"]:
        return []
    lines = [title, "", "| part | " + " | ".join(PASSES) + " | ms per step | share of device time |",
             "|---|" + "---:|" * (len(PASSES) + 2)]
    lines += [
        f"| {scope} | " + " | ".join(f"{ops['passes'][scope][name]:.3f}" for name in PASSES)
        + f" | {ms:.3f} | {ms / ops['total_ms']:.1%} |"
        for scope, ms in ops["scopes"].items()
        if ms > 0
    ]
    return lines + [""]


def ops_markdown(ops: dict, title: str) -> list[str]:
    """Markdown lines for `profile_device_ops`' result under the sentence `title`."""
    lines = [f"{title} (trace: {ops['source']}).", ""]
    if not ops["rows"]:
        return lines + [
            "The trace held no op events; cost analysis of the compiled step instead: "
            f"{ops['cost_analysis']}",
            "",
        ]
    return lines + [f"Total op time per step: {ops['total_ms']:.3f} ms.", ""] + _rows_markdown(
        ops["rows"])


def scope_ops_markdown(ops: dict, title: str) -> list[str]:
    """Markdown lines for the costliest ops of each scope that took time (`trace_device_ops`'
    `scope_rows`) under the sentence `title`."""
    if not ops["scopes"]:
        return []
    lines = [title, ""]
    for scope, ms in ops["scopes"].items():
        if ms > 0:
            lines += [f"`{scope}` ({ms:.3f} ms per step):", ""]
            lines += _rows_markdown(ops["scope_rows"][scope])
    return lines


def _rows_markdown(rows: list[dict]) -> list[str]:
    """A markdown table of op rows (`trace_device_ops`), then a blank line."""
    lines = ["| op | calls/step | ms/step | share | HLO (opcode shape kind source) |",
             "|---|---:|---:|---:|---|"]
    lines += [
        f"| {row['op']} | {row['calls']:g} | {row['ms']:.3f} | {row['share']:.1%} | "
        f"{row['hlo'].replace('|', '/')} |"
        for row in rows
    ]
    return lines + [""]
