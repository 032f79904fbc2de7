"""Where a step spends its device time, read from a `jax.profiler` trace of a few calls.

`profile_device_ops` / `trace_device_ops` trace the calls, read the trace back with
`jax.profiler.ProfileData` and sum the device ops' time per op, each labelled with its HLO
opcode, shape and JAX source op (`hlo_instructions`), and per named scope of the program and pass
(forward, recompute, backward: `scope_times`). `step_idle` and `idle_summary` give when the device
runs nothing: the idle gaps between its op events within each traced step, with the ops on either
side. The `*_markdown` functions render these for the benchmarks' `--profile` tables; wall-clock
timing lives in `experiments.harness`."""

from __future__ import annotations

import bisect
import collections
import functools
import glob
import itertools
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax


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


STEP_ANNOTATION = "profiled_step"  # the host-side trace annotation of each traced call


def trace_device_ops(run: Callable[[], object], compiled: jax.stages.Compiled, steps: int,
                     top: int = 25, scopes: Sequence[str] = (), top_per_scope: int = 8,
                     top_gaps: int = 15) -> dict:
    """Device ops of `steps` traced calls of `run()`, which calls `compiled` (compiled with
    `profile_compiler_options`), summed per op, the costliest first, and per named scope; and the
    device's idle time in each call.

    Returns dict(rows=[dict(op, calls, ms, share, hlo)], total_ms, source, scopes, passes,
    scope_rows, idle): per-step calls and ms; `hlo` = opcode, shape and JAX source op of the op in
    the compiled module; `scopes` = ms per step of each of `scopes` and "other" over all ops,
    `passes` the same split per pass, {scope: {pass: ms}} (`scope_times`); `scope_rows` = the
    `top_per_scope` costliest rows of each scope, each summing the ops of one HLO description (one
    op of every layer); `idle` = `idle_summary` of the calls (its
    `top_gaps` longest gaps), None where the trace does not mark each call or a call holds no
    device events. On a CPU the events of while loops and conditionals are left out of the op
    times: each spans the ops it runs, which count on their own. Falls back to the compiled
    module's `cost_analysis()` totals (rows and scopes empty, idle None) if the trace holds no op
    events.
    """
    jax.block_until_ready(run())
    op_events, busy_events, windows, source = [], [], [], "none"
    with tempfile.TemporaryDirectory() as trace_dir:
        # A profiler that cannot start (no CUPTI) or a trace that does not parse must not cost
        # the benchmark run its other numbers: the table then says why and gives the fallback.
        try:
            jax.profiler.start_trace(trace_dir)
            try:
                for step in range(steps):
                    with jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=step):
                        jax.block_until_ready(run())
            finally:
                jax.profiler.stop_trace()
            traces = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
            profile = jax.profiler.ProfileData.from_file(max(traces, key=os.path.getmtime))
            op_events, busy_events, source = _trace_events(profile)
            windows = _step_windows(profile)
        except Exception as error:  # noqa: BLE001 (reported in the table, see above)
            source = f"trace failed: {type(error).__name__}: {error}"
    if not op_events:
        cost = compiled.cost_analysis() or {}
        return dict(rows=[], total_ms=0.0, source=source, scopes={}, passes={}, scope_rows={},
                    idle=None, cost_analysis=dict(cost))
    instructions = hlo_instructions(compiled.as_text())
    times, calls = collections.Counter(), collections.Counter()
    for event in op_events:
        if source == "host threads" and event.op in instructions and (
                instructions[event.op].opcode in CONTROL_FLOW_OPCODES):
            continue
        times[event.op] += event.end_ns - event.start_ns
        calls[event.op] += 1
    total = sum(times.values())

    def row(op, nanos):
        return dict(op=op, calls=calls[op] / steps, ms=nanos / steps / 1e6, share=nanos / total,
                    hlo=instructions[op].description if op in instructions else "")

    op_names = {op: instruction.op_name for op, instruction in instructions.items()}
    passes = {scope: {name: nanos / steps / 1e6 for name, nanos in per_pass.items()}
              for scope, per_pass in scope_times(times, op_names, scopes).items()}
    # scope -> HLO description -> its ops, costliest first: one row sums an op over the layers
    # (they share a description: the same opcode, shape and source op).
    by_scope = collections.defaultdict(lambda: collections.defaultdict(list))
    for op, nanos in times.most_common():
        op_row = row(op, nanos)
        by_scope[scope_of(op_names.get(op, ""), scopes) or OTHER_SCOPE][
            op_row["hlo"] or op].append(op_row)
    idle = None
    if len(windows) == steps:
        per_step = split_steps(busy_events, [start for start, _ in windows])
        # A step without events means the device's clock and the host's do not line up here.
        if all(per_step):
            idle = idle_summary([step_idle(events) for events in per_step],
                                [end - start for start, end in windows], instructions, scopes,
                                top_gaps)
    return dict(rows=[row(op, nanos) for op, nanos in times.most_common(top)],
                total_ms=total / steps / 1e6, source=source, passes=passes,
                scopes={scope: sum(per_pass.values()) for scope, per_pass in passes.items()},
                scope_rows={scope: _grouped_rows(by_scope[scope])[:top_per_scope]
                            for scope in passes},
                idle=idle)


def _grouped_rows(groups: Mapping[str, list[dict]]) -> list[dict]:
    """One row per group of op rows (`trace_device_ops`), costliest first: calls, ms and share
    summed, `op` naming the costliest op and how many more the row holds."""
    rows = [dict(op=ops[0]["op"] + (f" (+{len(ops) - 1})" if len(ops) > 1 else ""),
                 calls=sum(op["calls"] for op in ops), ms=sum(op["ms"] for op in ops),
                 share=sum(op["share"] for op in ops), hlo=ops[0]["hlo"])
            for ops in groups.values()]
    return sorted(rows, key=lambda row: -row["ms"])


class OpEvent(NamedTuple):
    """One op's event in a trace: when it ran (ns on the trace's clock) and the HLO instruction
    it ran for (the event's own name where it names none)."""

    start_ns: float
    end_ns: float
    op: str


def _trace_events(profile) -> tuple[list[OpEvent], list[OpEvent], str]:
    """(op events, busy events, source) of a trace.

    Op events, summed per op: the GPU's "XLA Ops" line where there is one, else the kernels and
    copies on its stream lines; on a CPU the host threads' events that name an HLO op. Busy
    events, whose union is the time the device runs something: the stream lines' events, each
    kernel and copy on its own (an "XLA Ops" event spans all kernels of its op and the gaps
    between them); on a CPU the same host events, control flow included (nested, they add no
    time to a union).
    """
    device_lines = [line for plane in profile.planes if plane.name.startswith("/device:")
                    for line in plane.lines]
    if device_lines:
        streams = _line_events(line for line in device_lines if line.name.startswith("Stream"))
        op_lines = [line for line in device_lines if line.name == "XLA Ops"]
        if op_lines:
            return _line_events(op_lines), streams, "XLA Ops"
        return streams, streams, "device streams"
    host_lines = [line for plane in profile.planes if plane.name == "/host:CPU"
                  for line in plane.lines]
    events = _line_events(host_lines, with_hlo_op=True)
    return events, events, "host threads"


def _line_events(lines: Iterable, with_hlo_op: bool = False) -> list[OpEvent]:
    """The events of trace lines as `OpEvent`s, named by their "hlo_op" stat where they have one
    (only those, `with_hlo_op`)."""
    events = []
    for line in lines:
        for event in line.events:
            stats = dict(event.stats)
            if with_hlo_op and "hlo_op" not in stats:
                continue
            op = str(stats.get("hlo_op", event.name)).lstrip("%")
            events.append(OpEvent(event.start_ns, event.end_ns, op))
    return events


def _step_windows(profile) -> list[tuple[float, float]]:
    """(start, end) ns of each traced call (the host's `STEP_ANNOTATION` events), in order."""
    return sorted((event.start_ns, event.end_ns) for plane in profile.planes
                  if not plane.name.startswith("/device:") for line in plane.lines
                  for event in line.events if event.name == STEP_ANNOTATION)


def split_steps(events: Iterable[OpEvent], step_starts_ns: Sequence[float]) -> list[list[OpEvent]]:
    """The events of each step: an event belongs to the last step that started (on the host) at
    or before it starts; one that starts before every step, to the first. A step's device work
    starts after the host starts the step and ends before the next one starts (the host waits for
    it), so a host clock a little off the device's does not move an event across steps.

    step_starts_ns: [steps], ascending. Returns [steps] lists, each sorted by start.
    """
    if not step_starts_ns:
        raise ValueError("step_starts_ns must hold at least one step's start; got none")
    per_step = [[] for _ in step_starts_ns]
    for event in sorted(events):
        per_step[max(bisect.bisect_right(step_starts_ns, event.start_ns) - 1, 0)].append(event)
    return per_step


class BusyRun(NamedTuple):
    """A stretch of time in which some event runs: it starts with `first`'s start and ends with
    `last`'s end, and no gap lies inside."""

    start_ns: float
    end_ns: float
    first: OpEvent
    last: OpEvent


def busy_runs(events: Iterable[OpEvent]) -> list[BusyRun]:
    """The union of the events' intervals as maximal busy runs, in order: overlapping or touching
    events (concurrent streams, an event nested in another) join one run. `first` is the event
    that starts the run, `last` the one that ends it; of those that tie, the outermost, then the
    first by op name, so that the runs do not depend on the order of `events`."""
    runs = []
    for event in sorted(events, key=lambda event: (event.start_ns, -event.end_ns, event.op)):
        if runs and event.start_ns <= runs[-1].end_ns:
            if event.end_ns > runs[-1].end_ns:
                runs[-1] = runs[-1]._replace(end_ns=event.end_ns, last=event)
        else:
            runs.append(BusyRun(event.start_ns, event.end_ns, event, event))
    return runs


class IdleGap(NamedTuple):
    """A time in which no event runs, between two busy runs: from `before`'s end to `after`'s
    start."""

    start_ns: float
    end_ns: float
    before: OpEvent
    after: OpEvent

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


class StepIdle(NamedTuple):
    """A step's device activity. span: from its first event's start to its last event's end;
    busy: the union of its events; gaps: the idle gaps inside the span, in order (together
    span - busy)."""

    span_ns: float
    busy_ns: float
    gaps: list[IdleGap]

    @property
    def idle_ns(self) -> float:
        return self.span_ns - self.busy_ns


def step_idle(events: Iterable[OpEvent]) -> StepIdle:
    """Span, busy time and idle gaps of one step's events (`busy_runs`); all zero if none."""
    runs = busy_runs(events)
    if not runs:
        return StepIdle(0.0, 0.0, [])
    gaps = [IdleGap(done.end_ns, next_run.start_ns, done.last, next_run.first)
            for done, next_run in itertools.pairwise(runs)]
    busy = sum(run.end_ns - run.start_ns for run in runs)
    return StepIdle(runs[-1].end_ns - runs[0].start_ns, busy, gaps)


def group_gaps(gaps: Iterable[IdleGap],
               key: Callable[[IdleGap], str]) -> list[tuple[str, int, float]]:
    """(key, number of gaps, their total ns) of the gaps grouped by `key`, the most idle first."""
    counts, totals = collections.Counter(), collections.Counter()
    for gap in gaps:
        counts[key(gap)] += 1
        totals[key(gap)] += gap.duration_ns
    return [(name, counts[name], total) for name, total in totals.most_common()]


SMALL_GAP_NS = 10_000  # gaps shorter than this: the launch latency of back-to-back kernels
NOT_IN_HLO = "not an HLO op"
MAX_EVENT_NAME_CHARS = 60  # of an event that names no HLO op (kernel names run long)


def op_kind(op: str, instructions: Mapping[str, HloInstruction]) -> str:
    """An op's opcode and its fusion kind or custom-call target ("fusion kLoop", "custom-call
    __cudnn", "conditional"); for an event that names no instruction of the module (a copy the
    runtime made, a kernel launched outside an op's annotation), its own name, so marked."""
    if op not in instructions:
        return f"{op[:MAX_EVENT_NAME_CHARS]} ({NOT_IN_HLO})"
    return " ".join(filter(None, (instructions[op].opcode, instructions[op].kind)))


def idle_summary(steps: Sequence[StepIdle], host_steps_ns: Sequence[float],
                 instructions: Mapping[str, HloInstruction], scopes: Sequence[str] = (),
                 top_gaps: int = 15) -> dict:
    """Where the device idles in traced steps, per step (means over the steps), in ms.

    steps: `step_idle` of each traced step; host_steps_ns: each step's duration on the host (the
    wall time of the call). Returns dict(host_ms, span_ms, busy_ms, idle_ms, gaps: the `top_gaps`
    longest, dict(step, us, before, before_hlo, after, after_hlo, after_scope); by_after_kind,
    by_before_kind, by_after_scope: [dict(key, gaps, ms)] the idle time grouped by the `op_kind`
    of the op after the gap (what the device waited to start), of the op before it, and by the
    innermost of `scopes` of the op after (`scope_of`, else OTHER_SCOPE; empty without scopes),
    the most idle first; small_gaps, small_ms: the gaps under SMALL_GAP_NS).
    """
    if not steps or len(steps) != len(host_steps_ns):
        raise ValueError(f"steps and host_steps_ns must describe the same steps, at least one; got "
                         f"{len(steps)} and {len(host_steps_ns)}")
    count = len(steps)
    gaps = [(step, gap) for step, idle in enumerate(steps) for gap in idle.gaps]
    longest = sorted(gaps, key=lambda item: -item[1].duration_ns)[:top_gaps]

    def scope(op: str) -> str:
        instruction = instructions.get(op)
        return (scope_of(instruction.op_name, scopes) if instruction else None) or OTHER_SCOPE

    def described(op: str) -> str:
        return instructions[op].description if op in instructions else NOT_IN_HLO

    def grouped(key: Callable[[IdleGap], str]) -> list[dict]:
        return [dict(key=name, gaps=number / count, ms=total / count / 1e6)
                for name, number, total in group_gaps((gap for _, gap in gaps), key)]

    small = [gap.duration_ns for _, gap in gaps if gap.duration_ns < SMALL_GAP_NS]
    return dict(
        host_ms=sum(host_steps_ns) / count / 1e6,
        span_ms=sum(idle.span_ns for idle in steps) / count / 1e6,
        busy_ms=sum(idle.busy_ns for idle in steps) / count / 1e6,
        idle_ms=sum(idle.idle_ns for idle in steps) / count / 1e6,
        gaps=[dict(step=step, us=gap.duration_ns / 1e3, before=gap.before.op,
                   before_hlo=described(gap.before.op), after=gap.after.op,
                   after_hlo=described(gap.after.op), after_scope=scope(gap.after.op))
              for step, gap in longest],
        by_after_kind=grouped(lambda gap: op_kind(gap.after.op, instructions)),
        by_before_kind=grouped(lambda gap: op_kind(gap.before.op, instructions)),
        by_after_scope=grouped(lambda gap: scope(gap.after.op)) if scopes else [],
        small_gaps=len(small) / count,
        small_ms=sum(small) / count / 1e6,
    )


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
    kind: a fusion's kind or a custom call's target ("kLoop", "__cudnn", "mosaic_gpu_v2"); ""
      for other instructions.
    """

    opcode: str
    description: str
    op_name: str
    kind: str = ""


def hlo_instructions(hlo_text: str) -> dict[str, HloInstruction]:
    """Instruction name -> `HloInstruction` of every instruction of an HLO module's text.

    An instruction with no op_name of its own that calls a computation (`calls=`: the fusions
    XLA:CPU wraps around a library call or a copy, `ynn_fusion`, `wrapped_copy`) takes the op_name
    of the last instruction of that computation that has one (its root, where the root has one).
    """
    parsed = {}  # name -> (opcode and shape, kinds, op_name, called computation or None)
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
        head = [match["opcode"], shape if len(shape) <= MAX_SHAPE_CHARS
                else shape[:MAX_SHAPE_CHARS] + "…"]
        kinds = [found.group(1) for key in ("kind", "custom_call_target")
                 if (found := re.search(rf"{key}=\"?([\w.\-]+)", line))]
        source = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        parsed[match["name"]] = (head, kinds, source.group(1) if source else "",
                                 called.group(1) if called else None)
        computations[computation].append(match["name"])

    @functools.cache
    def op_name_of(name: str) -> str:
        *_, own, called = parsed[name]
        if own or called is None:
            return own
        return next(filter(None, map(op_name_of, reversed(computations[called]))), "")

    instructions = {}
    for name, (head, kinds, _, _) in parsed.items():
        op_name = op_name_of(name)
        source = [op_name.split("/", 1)[-1]] if op_name else []
        instructions[name] = HloInstruction(head[0], " ".join(head + kinds + source), op_name,
                                            " ".join(kinds))
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
    header = "| part | " + " | ".join(PASSES) + " | ms per step | share of device time |"
    lines = [title, "", header,
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
        f"{_cell(row['hlo'])} |"
        for row in rows
    ]
    return lines + [""]


IDLE_GROUP_ROWS = 6  # rows of each grouping in `idle_markdown`
IDLE_GROUPINGS = (
    ("by_after_kind", "op after the gap"),
    ("by_before_kind", "op before the gap"),
    ("by_after_scope", "scope of the op after"),
)


def idle_markdown(ops: dict) -> list[str]:
    """Markdown lines for the device's idle time of `trace_device_ops`' result (its `idle`): per
    step, the busy time against the span, the longest gaps with the ops on either side, and the
    idle time grouped by those ops."""
    idle = ops["idle"]
    lines = ["### When the device runs nothing", ""]
    if idle is None:
        return lines + [f"Not measured: the trace ({ops['source']}) held no op events, did not "
                        "mark each traced step, or left a step without device events (the host's "
                        "and the device's clocks not lined up).", ""]
    if ops["source"] == "host threads":
        lines += ["On a CPU the ops run on host threads and these are their events: idle is "
                  "time in which no host thread runs an op of the step (the runtime's own work "
                  "between ops), not a GPU's launch gaps or host synchronisations.", ""]
    lines += [
        f"Per step: host wall time {idle['host_ms']:.3f} ms; device span (first op's start to "
        f"last op's end) {idle['span_ms']:.3f} ms, busy (the union of its op events, concurrent "
        f"ones counted once) "
        f"{idle['busy_ms']:.3f} ms, idle {idle['idle_ms']:.3f} ms "
        f"({_share(idle['idle_ms'], idle['span_ms'])} of the span); outside the span "
        f"{idle['host_ms'] - idle['span_ms']:.3f} ms (dispatch before the first op, the wait "
        f"after the last). Gaps under {SMALL_GAP_NS / 1e3:g} us (launch latency): "
        f"{idle['small_gaps']:.1f} per step, {idle['small_ms']:.3f} ms.",
        "",
        f"The {len(idle['gaps'])} longest gaps over the traced steps:",
        "",
        "| step | gap us | op before | its HLO | op after | its HLO | scope after |",
        "|---:|---:|---|---|---|---|---|",
    ]
    lines += [
        f"| {gap['step']} | {gap['us']:.1f} | {gap['before']} | {_cell(gap['before_hlo'])} | "
        f"{gap['after']} | {_cell(gap['after_hlo'])} | {gap['after_scope']} |"
        for gap in idle["gaps"]
    ]
    lines += ["", "Idle time per step grouped by the op on either side of each gap (opcode and "
              f"kind; the {IDLE_GROUP_ROWS} most idle of each grouping):", "",
              "| grouped by | group | gaps/step | idle ms/step | share of idle |",
              "|---|---|---:|---:|---:|"]
    for key, grouping in IDLE_GROUPINGS:
        lines += [
            f"| {grouping} | {_cell(row['key'])} | {row['gaps']:.1f} | {row['ms']:.3f} | "
            f"{_share(row['ms'], idle['idle_ms'])} |"
            for row in idle[key][:IDLE_GROUP_ROWS]
        ]
    return lines + [""]


def idle_summary_line(ops: dict) -> str:
    """One line on the device's idle time per step of `trace_device_ops`' result, for a log."""
    idle = ops["idle"]
    if idle is None:
        return f"device idle per step: not measured (trace: {ops['source']})"
    waits = ", ".join(f"{row['key']} {row['ms']:.1f} ms" for row in idle["by_after_kind"][:3])
    return (f"device idle per step: {idle['idle_ms']:.1f} ms of a {idle['span_ms']:.1f} ms span "
            f"(busy {idle['busy_ms']:.1f} ms, host step {idle['host_ms']:.1f} ms; trace: "
            f"{ops['source']}); {idle['small_gaps']:.0f} gaps under {SMALL_GAP_NS / 1e3:g} us, "
            f"{idle['small_ms']:.1f} ms; most idle before: {waits or 'no gaps'}")


def _share(part: float, whole: float) -> str:
    """`part` as a percentage of `whole` ("-" for a zero whole)."""
    return f"{part / whole:.1%}" if whole > 0 else "-"


def _cell(text: str) -> str:
    """Text for a markdown table cell (no column separators)."""
    return text.replace("|", "/")
