"""experiments.profiling: HLO instructions are described by opcode, shape, kind and source,
device time is summed per named scope of their op_name, and the device's idle gaps are found
between the union of its op events within each step and described by the ops around them."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from experiments import bench_moe, bench_train, profiling
from experiments.profiling import OpEvent


def test_hlo_instructions_name_opcode_shape_kind_and_source():
    hlo = (
        '  %multiply_fusion.3 = bf16[8,4]{1,0} fusion(%p0), kind=kLoop, calls=%fc, '
        'metadata={op_name="jit(step)/transpose(jvp())/mul" source_file="x.py"}\n'
        '  ROOT %custom-call.1 = (f32[2], s32[2]) custom-call(%a), custom_call_target="TopK"\n'
    )
    fusion, top_k = (profiling.hlo_instructions(hlo)[name]
                     for name in ("multiply_fusion.3", "custom-call.1"))
    assert fusion.description == "fusion bf16[8,4] kLoop transpose(jvp())/mul"
    assert fusion.opcode == "fusion" and fusion.op_name == "jit(step)/transpose(jvp())/mul"
    assert top_k.description == "custom-call (f32[2], s32[2]) TopK" and top_k.op_name == ""
    assert (fusion.kind, top_k.kind) == ("kLoop", "TopK")
    loop = f"  %while.7 = ({', '.join(['f32[64,64]{1,0}'] * 40)}) while(%t)\n"
    described = profiling.hlo_instructions(loop)["while.7"].description
    assert described.startswith("while (f32[64,64], f32[64,64]") and described.endswith("…")
    assert len(described) == len("while ") + profiling.MAX_SHAPE_CHARS + 1


def _instruction(name: str, opcode: str, op_name: str = "", calls: str = "") -> str:
    """One line of HLO text: f32[8] `opcode` of the parameter, calling `calls` if given."""
    call = f", kind=kLoop, calls=%{calls}" if calls else ""
    metadata = f', metadata={{op_name="{op_name}"}}' if op_name else ""
    return f"  %{name} = f32[8]{{0}} {opcode}(%p){call}{metadata}"


# A step as XLA prints it: a fusion XLA made without metadata around a dot that has some (its
# computation printed after it here, though XLA prints callees first), the forward and the
# backward of a scanned, rematerialised layer, an op XLA merged from two, and its own copy.
STEP_HLO = "\n".join([
    "HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}",
    "",
    "ENTRY %main.1 (p: f32[8]) -> f32[8] {",
    '  %p = f32[8]{0} parameter(0), metadata={op_name="state"}',
    _instruction("ynn_fusion.2", "fusion", calls="fused_computation.2"),
    _instruction("embed_fusion", "fusion", "jit(step)/jvp(embed)/jit(_take)/gather", "f0"),
    _instruction("fwd", "fusion", "jit(step)/jvp()/while/body/eval_jaxpr/moe/mul", "f1"),
    _instruction("bwd", "fusion", "jit(step)/transpose(jvp())/while/body/eval_jaxpr/checkpoint/"
                 "rematted_computation/kda/sin", "f2"),
    _instruction("head_grad", "dot", "jit(step)/transpose(jvp(kda))/transpose"),
    _instruction("merged", "add", "jit(step)/jvp()/add;jit(step)/jvp(moe)/jit(floor_divide)/div"),
    _instruction("adam", "fusion", "jit(step)/cond/branch_1_fun/optimizer/vmap(jit(clip))/max",
                 "f3"),
    _instruction("nested", "multiply", "jit(step)/jvp(kda)/moe/mul"),
    "  ROOT %copy.9 = f32[8]{0} copy(%p)",
    "}",
    "",
    "%fused_computation.2 (param_0: f32[8]) -> f32[8] {",
    "  %param_0 = f32[8]{0} parameter(0)",
    _instruction("dot.5", "dot", "jit(step)/transpose(jvp(jvp()))/checkpoint/attention/"
                 "dot_general").replace("  %", "  ROOT %"),
    "}",
])
SCOPES = ("embed", "kda", "attention", "moe", "optimizer")


def test_scope_of_finds_the_innermost_scope_forward_and_backward():
    ops = profiling.hlo_instructions(STEP_HLO)
    scope_of = {name: profiling.scope_of(op.op_name, SCOPES) for name, op in ops.items()}
    assert scope_of == {
        "p": None,
        "ynn_fusion.2": "attention",  # the op_name of the dot it calls
        "embed_fusion": "embed",
        "fwd": "moe",  # a scanned body
        "bwd": "kda",  # a scanned, rematerialised body, transposed
        "head_grad": "kda",  # transposed: the scope inside transpose(jvp(...))
        "merged": "moe",  # the first of the merged op_names under a scope
        "adam": "optimizer",
        "nested": "moe",  # innermost
        "copy.9": None,
        "param_0": None,
        "dot.5": "attention",
    }
    assert ops["ynn_fusion.2"].description == (
        "fusion f32[8] kLoop transpose(jvp(jvp()))/checkpoint/attention/dot_general")


def test_scope_times_sum_every_op_and_the_rest_is_other():
    op_names = {name: op.op_name for name, op in profiling.hlo_instructions(STEP_HLO).items()}
    times = {"ynn_fusion.2": 1.0, "embed_fusion": 2.0, "fwd": 4.0, "bwd": 8.0, "head_grad": 16.0,
             "merged": 32.0, "adam": 64.0, "nested": 128.0, "copy.9": 256.0,
             "not_in_hlo": 512.0}
    by_pass = lambda forward=0.0, recompute=0.0, backward=0.0: dict(  # noqa: E731
        forward=forward, recompute=recompute, backward=backward)
    assert profiling.scope_times(times, op_names, SCOPES) == {
        "embed": by_pass(2.0), "kda": by_pass(recompute=8.0, backward=16.0),
        "attention": by_pass(backward=1.0), "moe": by_pass(forward=164.0),
        "optimizer": by_pass(64.0), "other": by_pass(768.0)}
    assert profiling.scope_times(times, op_names, ()) == {
        "other": by_pass(sum(times.values()) - 25.0, recompute=8.0, backward=17.0)}
    with pytest.raises(ValueError, match="scopes"):
        profiling.scope_times(times, op_names, ("kda", "other"))


def test_cpu_trace_counts_a_loop_body_once_under_its_scope():
    # On CPU the while loop's own event spans its body's ops: counting both counted them twice.
    @jax.jit
    def step(x):
        def body(_, x):
            with jax.named_scope("body"):
                return jnp.tanh(x @ x)

        return jax.lax.fori_loop(0, 20, body, x)

    ops = profiling.profile_device_ops(step, (jnp.ones((128, 128)),), steps=2, top=100,
                                       scopes=("body",))
    if ops["source"] != "host threads":
        pytest.skip(f"the trace came from {ops['source']}, not a CPU's host threads")
    assert not any(row["hlo"].startswith("while") for row in ops["rows"])
    assert sum(row["ms"] for row in ops["rows"]) == pytest.approx(ops["total_ms"])
    # The matmul runs in a fusion XLA:CPU made without metadata: it takes its dot's op_name.
    assert ops["scopes"]["body"] > 0.5 * ops["total_ms"]


def test_a_parts_rows_sum_each_op_over_the_layers_that_run_it():
    @jax.jit
    def step(x):
        for _ in range(3):  # three unrolled "layers": the same ops, three instructions each
            with jax.named_scope("layer"):
                x = jnp.tanh(x @ x)
        return x

    ops = profiling.profile_device_ops(step, (jnp.ones((128, 128)),), steps=2, top=100,
                                       scopes=("layer",))
    rows = ops["scope_rows"]["layer"]
    if not rows:
        pytest.skip(f"the trace came from {ops['source']} and held no op events")
    assert len({row["hlo"] for row in rows}) == len(rows)  # one row a description
    assert sum(row["ms"] for row in rows) == pytest.approx(ops["scopes"]["layer"])
    assert any(row["calls"] == 3 and row["op"].endswith("(+2)") for row in rows), rows


def test_busy_runs_join_overlapping_streams_and_nested_events():
    events = [
        OpEvent(0, 10, "a"), OpEvent(5, 15, "b_other_stream"),  # concurrent: counted once
        OpEvent(20, 30, "c"), OpEvent(22, 25, "nested_in_c"),
        OpEvent(30, 40, "touching_c"),  # starts as c ends: no gap
        OpEvent(41, 42, "after_1ns"), OpEvent(41, 42, "twin"),
    ]
    runs = profiling.busy_runs(reversed(events))  # in any order
    assert [(run.start_ns, run.end_ns, run.first.op, run.last.op) for run in runs] == [
        (0, 15, "a", "b_other_stream"), (20, 40, "c", "touching_c"),
        (41, 42, "after_1ns", "after_1ns")]
    idle = profiling.step_idle(events)
    assert (idle.span_ns, idle.busy_ns, idle.idle_ns) == (42, 36, 6)
    assert [(gap.start_ns, gap.end_ns, gap.before.op, gap.after.op) for gap in idle.gaps] == [
        (15, 20, "b_other_stream", "c"), (40, 41, "touching_c", "after_1ns")]
    assert sum(gap.duration_ns for gap in idle.gaps) == idle.idle_ns
    # Of events that end together, the outermost ends the run: the one that started first.
    outer = profiling.busy_runs([OpEvent(5, 10, "inner"), OpEvent(0, 10, "outer")])
    assert [(run.first.op, run.last.op) for run in outer] == [("outer", "outer")]
    assert profiling.step_idle([]) == profiling.StepIdle(0.0, 0.0, [])


def test_split_steps_keeps_the_gap_between_steps_out_of_each_step():
    events = [OpEvent(-3, 5, "early_clock"), OpEvent(8, 20, "a0"), OpEvent(30, 50, "b0"),
              OpEvent(300, 310, "a1"), OpEvent(320, 330, "b1")]
    first, second = profiling.split_steps(reversed(events), [0, 100])
    assert [event.op for event in first] == ["early_clock", "a0", "b0"]
    assert [event.op for event in second] == ["a1", "b1"]
    idles = [profiling.step_idle(step) for step in (first, second)]
    assert [(idle.span_ns, idle.idle_ns) for idle in idles] == [(53, 13), (30, 10)]
    # The 250 ns between b0 and a1 (the host between steps) is no step's idle time.
    assert all(gap.duration_ns < 100 for idle in idles for gap in idle.gaps)
    with pytest.raises(ValueError, match="step_starts_ns"):
        profiling.split_steps(events, [])


GAP_HLO = "\n".join([
    "ENTRY %main (p: f32[8]) -> f32[8] {",
    '  %p = f32[8]{0} parameter(0), metadata={op_name="x"}',
    _instruction("loop_fusion", "fusion", "jit(step)/jvp(kda)/mul", "f0"),
    '  %mosaic.1 = bf16[8]{0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
    'metadata={op_name="jit(step)/jvp(moe)/mpmd_map"}',
    '  %conditional.3 = f32[8]{0} conditional(%p, %p, %p), branch_computations={%a, %b}, '
    'metadata={op_name="jit(step)/jvp(moe)/cond"}',
    "}",
])


def _gaps_in_order(*ops_and_gaps) -> list[OpEvent]:
    """Back-to-back 100 ns events of the ops named, separated by the idle ns between them."""
    events, time = [], 0
    for op, gap in zip(ops_and_gaps[::2], (*ops_and_gaps[1::2], 0)):
        events.append(OpEvent(time, time + 100, op))
        time += 100 + gap
    return events


def test_idle_summary_names_ops_around_longest_gaps_and_groups_rest():
    instructions = profiling.hlo_instructions(GAP_HLO)
    steps = [
        profiling.step_idle(_gaps_in_order("conditional.3", 50_000, "mosaic.1", 2_000,
                                           "loop_fusion", 30_000, "MemcpyD2H", 4_000,
                                           "loop_fusion")),
        profiling.step_idle(_gaps_in_order("conditional.3", 40_000, "mosaic.1", 3_000,
                                           "loop_fusion")),
    ]
    idle = profiling.idle_summary(steps, [200_000, 150_000], instructions, ("kda", "moe"),
                                  top_gaps=3)
    assert idle["host_ms"] == pytest.approx(0.175)
    assert idle["idle_ms"] == pytest.approx(129_000 / 2 / 1e6)
    assert idle["busy_ms"] == pytest.approx(8 * 100 / 2 / 1e6)  # 8 events of 100 ns
    assert idle["span_ms"] == pytest.approx(idle["idle_ms"] + idle["busy_ms"])
    assert [(gap["step"], gap["us"], gap["before"], gap["after"]) for gap in idle["gaps"]] == [
        (0, 50.0, "conditional.3", "mosaic.1"), (1, 40.0, "conditional.3", "mosaic.1"),
        (0, 30.0, "loop_fusion", "MemcpyD2H")]
    assert idle["gaps"][0]["before_hlo"] == "conditional f32[8] jvp(moe)/cond"
    assert idle["gaps"][0]["after_hlo"] == "custom-call bf16[8] mosaic_gpu_v2 jvp(moe)/mpmd_map"
    assert idle["gaps"][2]["after_hlo"] == profiling.NOT_IN_HLO

    def per_step(rows):  # (group, gaps per step, idle ns per step)
        return [(row["key"], row["gaps"], round(row["ms"] * 1e6)) for row in rows]

    assert per_step(idle["by_after_kind"]) == [
        ("custom-call mosaic_gpu_v2", 1.0, 45_000),
        (f"MemcpyD2H ({profiling.NOT_IN_HLO})", 0.5, 15_000), ("fusion kLoop", 1.5, 4_500)]
    assert per_step(idle["by_before_kind"]) == [
        ("conditional", 1.0, 45_000), ("fusion kLoop", 0.5, 15_000),
        ("custom-call mosaic_gpu_v2", 1.0, 2_500), (f"MemcpyD2H ({profiling.NOT_IN_HLO})", 0.5,
                                                     2_000)]
    assert per_step(idle["by_after_scope"]) == [("moe", 1.0, 45_000), ("other", 0.5, 15_000),
                                                ("kda", 1.5, 4_500)]
    assert idle["small_gaps"] == 1.5 and idle["small_ms"] == pytest.approx(9_000 / 2 / 1e6)
    assert profiling.idle_summary(steps[:1], [1.0], instructions)["by_after_scope"] == []
    with pytest.raises(ValueError, match="host_steps_ns"):
        profiling.idle_summary(steps, [1.0], instructions)


@pytest.fixture(scope="module")
def cpu_ops():
    """`profile_device_ops` of a small scanned step on this machine (host threads on a CPU)."""
    @jax.jit
    def step(x):
        def body(_, x):
            with jax.named_scope("body"):
                return jnp.tanh(x @ x)

        return jax.lax.fori_loop(0, 4, body, x)

    return profiling.profile_device_ops(step, (jnp.ones((64, 64)),), steps=2, scopes=("body",))


def test_a_cpu_trace_measures_idle_time_on_host_threads_and_says_so(cpu_ops):
    idle = cpu_ops["idle"]
    assert idle is not None and idle["span_ms"] > 0
    assert idle["busy_ms"] + idle["idle_ms"] == pytest.approx(idle["span_ms"])
    assert idle["busy_ms"] > 0 and idle["idle_ms"] >= 0
    assert 0 < idle["span_ms"] <= idle["host_ms"]
    text = "\n".join(profiling.idle_markdown(cpu_ops))
    if cpu_ops["source"] == "host threads":
        assert "On a CPU the ops run on host threads" in text
    assert f"idle {idle['idle_ms']:.3f} ms" in text and "| op after the gap |" in text
    assert profiling.idle_summary_line(cpu_ops).startswith(
        f"device idle per step: {idle['idle_ms']:.1f} ms of a {idle['span_ms']:.1f} ms span")
    missing = dict(cpu_ops, idle=None, source="trace failed: RuntimeError: no CUPTI")
    assert "Not measured" in "\n".join(profiling.idle_markdown(missing))
    assert profiling.idle_summary_line(missing).endswith("(trace: trace failed: RuntimeError: "
                                                         "no CUPTI)")


def test_both_benchmarks_render_the_idle_table(cpu_ops):
    result = dict(
        setup=dataclasses.asdict(bench_train.SMOKE), optimizer="adamw",
        params=dict(total=10, active=5, embedding=1), device="cpu", jax=jax.__version__,
        flax="0", date="2026-11-30", step_seconds=0.01, waited_step_seconds=0.02,
        tokens_per_second=1.0,
        model_tflops_per_second=1.0, mfu=0.1, breakdown={}, ops=cpu_ops)
    train_text = bench_train.markdown(result, "python -m experiments.bench_train --smoke")
    assert "### When the device runs nothing" in train_text
    assert (train_text.index("In-step device time by part") < train_text.index("When the device")
            < train_text.index("Top device ops"))
    moe_results = dict(parts=[dict(part="gathers", forward_ms=1.0, forward_backward_ms=2.0)],
                       moe=dict(ms=3.0), ops=cpu_ops)
    moe_text = "\n".join(bench_moe.profile_markdown(moe_results))
    assert "### When the device runs nothing" in moe_text and "| gap us |" in moe_text
