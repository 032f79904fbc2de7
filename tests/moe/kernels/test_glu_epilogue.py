"""The GLU fused into the grouped GEMMs' epilogues: `ragged_matmul_glu` (forward) and
`ragged_matmul_glu_grad` (the activation's VJP after GMM2's input gradient) of
`moe.kernels.mosaic_gpu.ragged_matmul`, and the custom-VJP expert MLP built on them
(`moe.dispatch.fused_expert_mlp`).

On CPU the kernels run in Mosaic GPU interpret mode with race detection (see
`tests/moe/kernels/test_ragged_matmul.py`). Operands are small integers (times 1/16 for the
weights, so the activation sees values of order 1): every float32 sum is exact, so the products'
bf16 roundings equal XLA's `ragged_dot` bit for bit and any difference comes from the activation
alone. Its float32 math may round differently from XLA's fused CPU code by an ulp of float32,
which can move the bf16 result by one bf16 ulp (2^-8 relative): that is the tolerance. Rows past
sum(group_sizes) must stay unwritten (interpret mode fills fresh buffers with NaN). Both
variants are also lowered for Hopper at the MoE layer's real shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# Interpret mode has no public race report; jax is pinned, so the private one is stable here.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from experiments import bench_grouped_matmul
from experiments.harness import relative_error
from moe import dispatch, experts
from moe.activations import GLUActivation
from moe.config import MoEConfig
from moe.kernels.mosaic_gpu.ragged_matmul import ragged_matmul_glu, ragged_matmul_glu_grad
from moe.kernels.mosaic_gpu.simulation import interpreted_on_cpu, simulated_hopper
from moe.kernels.mosaic_gpu.tiling import GLU_CONFIG, RaggedMatmulConfig

BF16_ULP = 2.0**-8  # relative spacing of bf16 values: one rounding step


def integer_valued(shape, seed, scale=1.0):
    """bf16 array of integers in [-3, 3] times `scale` (a power of two): exact float32 sums."""
    values = np.random.default_rng(seed).integers(-3, 4, shape) * scale
    return jnp.asarray(values, jnp.bfloat16)


def interpreted(kernel, *args, num_sms, **kwargs):
    """kernel(*args) in interpret mode, failing on any data race; outputs as numpy float32."""
    gpu_interpret.reset_gpu_interpret_mode_state()
    with interpreted_on_cpu(num_sms=num_sms, detect_races=True):
        outs = kernel(*args, **kwargs)
        outs = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), outs)
    assert not gpu_interpret.get_races().races_found, "the kernel has a data race"
    return outs


def assert_close_to_bf16(out, expected, covered):
    """Within one bf16 ulp of the reference on covered rows; NaN (unwritten) past them."""
    expected = np.asarray(expected.astype(jnp.float32))
    np.testing.assert_allclose(out[:covered], expected[:covered], rtol=BF16_ULP, atol=1e-6)
    assert np.isnan(out[covered:]).all(), "rows past sum(group_sizes) were written"


def ragged_dot_bf16(lhs, rhs, group_sizes):
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(jnp.bfloat16)


# (activation, config, M, K, N, group sizes, simulated SMs). Group boundaries inside row blocks
# and inside a consumer's 64 rows, empty groups, rows past the total, M not a multiple of tile_m.
CASES = {
    "situ, empty groups, rows past the total": (
        "situ", GLU_CONFIG, 256, 128, 128, [100, 0, 90, 30], 2),
    "swiglu, M not a multiple of tile_m, two column blocks": (
        "swiglu", GLU_CONFIG, 200, 256, 256, [64, 0, 70, 66], 3),
    "situ, no tile overlap, one group": (
        "situ", RaggedMatmulConfig(tile_n=128, overlap_tiles=False), 128, 128, 128, [0, 128], 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_writes_gate_up_and_the_activation(case):
    kind, config, num_rows, contraction, columns, sizes, num_sms = CASES[case]
    activation = GLUActivation(kind)
    lhs = integer_valued((num_rows, contraction), seed=0)
    rhs = integer_valued((len(sizes), contraction, 2 * columns), seed=1, scale=1 / 16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    gate_up, out = interpreted(ragged_matmul_glu, lhs, rhs, group_sizes, activation,
                               config=config, num_sms=num_sms)
    expected_gate_up = ragged_dot_bf16(lhs, rhs, group_sizes).reshape(num_rows, 2, columns)
    expected = activation(expected_gate_up[:, 0], expected_gate_up[:, 1]).astype(jnp.bfloat16)
    covered = sum(sizes)
    np.testing.assert_array_equal(gate_up[:covered], expected_gate_up[:covered].astype(float))
    assert np.isnan(gate_up[covered:]).all(), "rows past sum(group_sizes) were written"
    assert_close_to_bf16(out, expected, covered)


@pytest.mark.parametrize("case", list(CASES))
def test_backward_writes_the_activation_vjp(case):
    kind, config, num_rows, width, hidden, sizes, num_sms = CASES[case]
    activation = GLUActivation(kind)
    out_grad = integer_valued((num_rows, width), seed=2)
    w_out = integer_valued((len(sizes), hidden, width), seed=3, scale=1 / 16)
    gate_up = integer_valued((num_rows, 2, hidden), seed=4, scale=1 / 2)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    grad = interpreted(ragged_matmul_glu_grad, out_grad, w_out, group_sizes, gate_up, activation,
                       transpose_rhs=True, config=config, num_sms=num_sms)
    hidden_grad = ragged_dot_bf16(out_grad, jnp.swapaxes(w_out, 1, 2), group_sizes)
    _, pullback = jax.vjp(activation, gate_up[:, 0].astype(jnp.float32),
                          gate_up[:, 1].astype(jnp.float32))
    expected = jnp.stack(pullback(hidden_grad.astype(jnp.float32)), axis=1)
    assert_close_to_bf16(grad, expected.astype(jnp.bfloat16), sum(sizes))


@pytest.mark.parametrize("kind", ["situ", "swiglu", "clamped_swiglu"])
def test_both_variants_lower_for_hopper_at_the_real_shapes(kind):
    """131072 rows, 64 experts, width = hidden = 1024: layouts, wgmma, TMA and the 227 KiB SMEM."""
    rows, experts, width, hidden = 131072, 64, 1024, 1024
    activation = GLUActivation(kind)
    bf16 = jnp.bfloat16
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)
    forward = jax.jit(lambda x, w, s: ragged_matmul_glu(x, w, s, activation))
    backward = jax.jit(lambda dy, w, s, gate_up: ragged_matmul_glu_grad(
        dy, w, s, gate_up, activation, transpose_rhs=True))
    with simulated_hopper():
        lowered = [
            forward.trace(jax.ShapeDtypeStruct((rows, width), bf16),
                          jax.ShapeDtypeStruct((experts, width, 2 * hidden), bf16), sizes),
            backward.trace(jax.ShapeDtypeStruct((rows, width), bf16),
                           jax.ShapeDtypeStruct((experts, hidden, width), bf16), sizes,
                           jax.ShapeDtypeStruct((rows, 2, hidden), bf16)),
        ]
        lowered = [traced.lower(lowering_platforms=("cuda",)) for traced in lowered]
    assert all("mosaic_gpu" in program.as_text() for program in lowered)


def test_bad_glu_calls_raise_value_errors():
    lhs = jnp.zeros((64, 128), jnp.bfloat16)
    sizes = jnp.zeros((2,), jnp.int32)
    activation = GLUActivation("situ")
    with pytest.raises(ValueError, match="2N columns"):  # N = 64: not whole 128-column tiles
        ragged_matmul_glu(lhs, jnp.zeros((2, 128, 128), jnp.bfloat16), sizes, activation)
    with pytest.raises(ValueError, match="gate_up must be"):
        ragged_matmul_glu_grad(lhs, jnp.zeros((2, 128, 128), jnp.bfloat16), sizes,
                               jnp.zeros((64, 256), jnp.bfloat16), activation)


@pytest.mark.slow
def test_fused_expert_mlp_matches_the_unfused_xla_path_with_gradients():
    """Output and every gradient against `jax.vjp` of `expert_mlp(backend="xla")`, with SiTU-GLU
    (the custom VJP passes the activation through; the kernels' SwiGLU epilogues are checked
    against XLA in the forward and backward kernel tests above).

    Both paths round to bf16 at the same points (gate_up, h, y; d_h, d(gate_up), and each
    gradient) and differ only in float32 summation order, which can move a bf16 rounding by one
    step (2^-8 of the value); such a step in gate_up or d_h carries through one more product, so
    each result must agree within two steps of its largest element (2^-7).
    """
    rows, width, hidden, sizes = 256, 128, 128, [100, 0, 90, 30]
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, width), jnp.bfloat16)
    w_in = (jax.random.normal(keys[1], (len(sizes), width, 2, hidden)) * width**-0.5 * 2)
    w_out = jax.random.normal(keys[2], (len(sizes), hidden, width)) * hidden**-0.5
    w_in, w_out = w_in.astype(jnp.bfloat16), w_out.astype(jnp.bfloat16)
    out_grad = jax.random.normal(keys[3], (rows, width), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    activation = GLUActivation("situ")

    def fused(x, w_in, w_out):
        w_gate_up = w_in.reshape(len(sizes), width, 2 * hidden)
        return dispatch.fused_expert_mlp(activation, x, group_sizes, w_gate_up, w_out)

    def unfused(x, w_in, w_out):
        return dispatch.expert_mlp(x, group_sizes, w_in, w_out, activation, backend="xla")

    def value_and_grads(mlp):
        @jax.jit  # one program (eager, each op and interpreted kernel compiles on its own)
        def run(x, w_in, w_out, out_grad):
            out, pullback = jax.vjp(mlp, x, w_in, w_out)
            return out, *pullback(out_grad)

        return [np.asarray(a.astype(jnp.float32)) for a in run(x, w_in, w_out, out_grad)]

    expected = value_and_grads(unfused)
    gpu_interpret.reset_gpu_interpret_mode_state()
    with interpreted_on_cpu(num_sms=3, detect_races=True):
        ours = value_and_grads(fused)
    assert not gpu_interpret.get_races().races_found, "a kernel has a data race"
    covered = sum(sizes)  # rows past the groups: unwritten in y and d x, zeros in XLA's
    for name, out, ref in zip(["y", "d_x", "d_w_in", "d_w_out"], ours, expected):
        if name in ("y", "d_x"):
            out, ref = out[:covered], ref[:covered]
        error = relative_error(out, ref, norm="max")
        assert error <= 2.0**-7, (name, error)


def test_expert_mlp_fuses_only_where_the_kernels_run():
    """Off Hopper, fuse_glu_epilogues=True runs the unfused path unchanged."""
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (64, 128), jnp.bfloat16)
    w_in = jax.random.normal(keys[1], (2, 128, 2, 128), jnp.bfloat16)
    w_out = jax.random.normal(keys[2], (2, 128, 128), jnp.bfloat16)
    group_sizes = jnp.asarray([40, 24], jnp.int32)
    w_gate_up = w_in.reshape(2, 128, 256)
    assert dispatch.fused_epilogues_apply(x, w_gate_up, w_out, "auto") == (
        jax.default_backend() == "gpu" and dispatch.mosaic_gpu_supports(x, w_gate_up)
    )
    assert not dispatch.fused_epilogues_apply(x, w_gate_up, w_out, "xla")
    assert not dispatch.fused_epilogues_apply(x, w_gate_up[..., :192], w_out[:, :96], "auto")
    if jax.default_backend() != "gpu":
        mlp = [dispatch.expert_mlp(x, group_sizes, w_in, w_out, GLUActivation(),
                                   fuse_glu_epilogues=fuse) for fuse in (False, True)]
        np.testing.assert_array_equal(np.asarray(mlp[0]), np.asarray(mlp[1]))


def test_moe_layer_passes_the_config_field_to_the_dispatch(monkeypatch):
    seen = []

    def spy(*args, fuse_glu_epilogues, **kwargs):
        seen.append(fuse_glu_epilogues)
        return original(*args, fuse_glu_epilogues=fuse_glu_epilogues, **kwargs)

    original = experts.dropless_moe
    monkeypatch.setattr(experts, "dropless_moe", spy)
    x = jax.random.normal(jax.random.key(2), (1, 8, 32))
    for fuse in (False, True):
        cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, latent_dim=16,
                        fuse_glu_epilogues=fuse)
        experts.StableLatentMoE(32, cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))(x)
    assert seen == [False, True]


def test_config_field_defaults_off_and_is_validated():
    assert MoEConfig().fuse_glu_epilogues is False
    assert MoEConfig(fuse_glu_epilogues=True).fuse_glu_epilogues
    with pytest.raises(ValueError, match="fuse_glu_epilogues"):
        MoEConfig(fuse_glu_epilogues="yes")


@pytest.mark.slow
def test_expert_mlp_benchmark_smoke_writes_its_table(tmp_path):
    out = tmp_path / "expert_mlp_smoke.md"
    rows = bench_grouped_matmul.main(["--smoke", "--expert-mlp", "--out", str(out)])
    assert [(row["product"], row["kernel"] == bench_grouped_matmul.FUSED) for row in rows] == [
        (bench_grouped_matmul.FORWARD, False), (bench_grouped_matmul.FORWARD, True)]
    assert all(row["ms"] > 0 for row in rows)
    assert 0 < rows[1]["error"] <= bench_grouped_matmul.AGREEMENT_TOLERANCE
    assert not bench_grouped_matmul.disagreements(rows)
    assert out.read_text().count("| forward |") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_fused_expert_mlp_on_gpu_matches_the_unfused_kernels(kind):
    """On Hopper, expert_mlp with and without fuse_glu_epilogues (both on the Mosaic GPU GEMMs)."""
    size = bench_grouped_matmul.ExpertMLPSize(rows=16384, experts=8, width=1024, hidden=1024)
    x, w_in, w_out, out_grad, group_sizes = bench_grouped_matmul.expert_mlp_operands(size)
    w_gate_up = w_in.reshape(size.experts, size.width, 2 * size.hidden)
    assert dispatch.fused_epilogues_apply(x, w_gate_up, w_out, "auto")
    activation = GLUActivation(kind)

    def value_and_grads(fuse):
        mlp = jax.jit(lambda x, w_in, w_out: dispatch.expert_mlp(
            x, group_sizes, w_in, w_out, activation, fuse_glu_epilogues=fuse))
        out, pullback = jax.vjp(mlp, x, w_in, w_out)
        return [np.asarray(a.astype(jnp.float32)) for a in (out, *pullback(out_grad))]

    for ours, ref in zip(value_and_grads(True), value_and_grads(False)):
        assert relative_error(ours, ref, norm="max") <= bench_grouped_matmul.AGREEMENT_TOLERANCE
