"""experiments.profiling: HLO instructions are described by opcode, shape, kind and source, and
device time is summed per named scope of their op_name."""

import jax
import jax.numpy as jnp
import pytest

from experiments import profiling


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
