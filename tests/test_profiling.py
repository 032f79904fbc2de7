"""experiments.profiling: HLO instructions are described by opcode, shape, kind and source."""

from experiments import profiling


def test_hlo_descriptions_name_opcode_shape_kind_and_source():
    hlo = (
        '  %multiply_fusion.3 = bf16[8,4]{1,0} fusion(%p0), kind=kLoop, calls=%fc, '
        'metadata={op_name="jit(step)/transpose(jvp())/mul" source_file="x.py"}\n'
        '  ROOT %custom-call.1 = (f32[2], s32[2]) custom-call(%a), custom_call_target="TopK"\n'
    )
    described = profiling._hlo_descriptions(hlo)
    assert described["multiply_fusion.3"] == "fusion bf16[8,4] kLoop transpose(jvp())/mul"
    assert described["custom-call.1"] == "custom-call (f32[2], s32[2]) TopK"
    loop = f"  %while.7 = ({', '.join(['f32[64,64]{1,0}'] * 40)}) while(%t)\n"
    described = profiling._hlo_descriptions(loop)["while.7"]
    assert described.startswith("while (f32[64,64], f32[64,64]") and described.endswith("…")
    assert len(described) == len("while ") + profiling.MAX_SHAPE_CHARS + 1
