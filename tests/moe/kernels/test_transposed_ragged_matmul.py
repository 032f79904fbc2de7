"""`moe.kernels.mosaic_gpu.transposed_ragged_matmul`: the MoE's weight-gradient grouped GEMM.

On CPU the kernel runs in Mosaic GPU interpret mode (simulated Hopper, race detection on) at
small sizes with integer-valued bf16 operands, so every float32 sum is exact and the bf16 result
must equal the rounded VJP of `jax.lax.ragged_dot` (float32) bit for bit. Group boundaries fall
inside a pipeline step's rows (the rows of the neighbouring groups must contribute nothing), some
groups are empty (their output must be zeros) and the rows past sum(group_sizes) are NaN in both
operands (they must contribute nothing either). Few simulated SMs make each program walk several
tiles. Every shipped config is also lowered for Hopper at the benchmark's real shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Interpret mode has no public race report; jax is pinned, so the private one is stable here.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from experiments import bench_grouped_matmul
from experiments.harness import relative_error
from moe.kernels.mosaic_gpu.simulation import interpreted_on_cpu, simulated_hopper
from moe.kernels.mosaic_gpu.tiling import (
    TRANSPOSED_DEFAULT_CONFIG,
    TRANSPOSED_SWEEP_CONFIGS,
    TransposedRaggedMatmulConfig,
    transposed_config_for,
)
from moe.kernels.mosaic_gpu.transposed_ragged_matmul import transposed_ragged_matmul


def integer_operands(num_rows, contraction, columns, seed=0):
    """bf16 lhs [R, K] and out_grad [R, N] holding small integers: exact float32 sums."""
    rng = np.random.default_rng(seed)
    lhs = rng.integers(-3, 4, (num_rows, contraction))
    out_grad = rng.integers(-3, 4, (num_rows, columns))
    return jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(out_grad, jnp.bfloat16)


def ragged_dot_weight_gradient(lhs, out_grad, group_sizes):
    """[G, K, N] float32: the VJP of `jax.lax.ragged_dot(lhs, rhs, group_sizes)` w.r.t. rhs."""
    lhs, out_grad = lhs.astype(jnp.float32), out_grad.astype(jnp.float32)
    rhs = jnp.zeros((group_sizes.shape[0], lhs.shape[1], out_grad.shape[1]), jnp.float32)
    _, pullback = jax.vjp(lambda rhs: jax.lax.ragged_dot(lhs, rhs, group_sizes), rhs)
    return pullback(out_grad)[0]


# (config, R, K, N, group sizes, simulated SMs). Boundaries fall inside 64-row steps, on them
# (64, 128) and inside 128-row steps.
INTERPRETED_CASES = {
    # Boundaries at 64, 128, inside a step (258) and at the total (298 of 328 rows).
    "default, empty groups, R not a multiple of the step, rows past the total, two N blocks": (
        TRANSPOSED_DEFAULT_CONFIG, 328, 128, 512, [0, 64, 64, 0, 130, 40], 3),
    "default, one group holds every row, two K blocks": (
        TRANSPOSED_DEFAULT_CONFIG, 256, 256, 256, [0, 0, 256, 0], 2),
    "default, every group empty": (TRANSPOSED_DEFAULT_CONFIG, 128, 128, 256, [0, 0, 0], 2),
    **{
        f"{name}, boundaries inside steps": (config, 384, 256, 256, [70, 0, 100, 150, 1], 3)
        for name, config in TRANSPOSED_SWEEP_CONFIGS.items()
        if config != TRANSPOSED_DEFAULT_CONFIG
    },
}


@pytest.mark.parametrize("case", list(INTERPRETED_CASES))
def test_interpreted_kernel_equals_ragged_dot_vjp(case):
    config, num_rows, contraction, columns, sizes, num_sms = INTERPRETED_CASES[case]
    lhs, out_grad = integer_operands(num_rows, contraction, columns)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    expected = ragged_dot_weight_gradient(lhs, out_grad, group_sizes)
    expected = np.asarray(expected.astype(jnp.bfloat16).astype(jnp.float32))
    # Rows past the total must contribute nothing, even NaN (as unwritten rows may hold).
    lhs, out_grad = (operand.at[sum(sizes):].set(jnp.nan) for operand in (lhs, out_grad))
    gpu_interpret.reset_gpu_interpret_mode_state()
    with interpreted_on_cpu(num_sms=num_sms, detect_races=True):
        out = transposed_ragged_matmul(lhs, out_grad, group_sizes, config=config)
        out = np.asarray(out.astype(jnp.float32))
    assert not gpu_interpret.get_races().races_found, "the kernel has a data race"
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_array_equal(out, expected)
    assert not out[np.asarray(sizes) == 0].any(), "an empty group's output is not zero"


def test_transposed_config_for_takes_the_default_where_its_tiles_divide():
    assert transposed_config_for(2048) == transposed_config_for(1024) == TRANSPOSED_DEFAULT_CONFIG
    assert transposed_config_for(384).tile_n == 128
    assert transposed_config_for(384) in TRANSPOSED_SWEEP_CONFIGS.values()


def test_every_shipped_config_is_interpreted_here():
    interpreted_configs = {case[0] for case in INTERPRETED_CASES.values()}
    assert set(TRANSPOSED_SWEEP_CONFIGS.values()) <= interpreted_configs
    assert TRANSPOSED_DEFAULT_CONFIG in TRANSPOSED_SWEEP_CONFIGS.values()


def test_output_dtype_is_the_bundled_kernels():
    """JAX's bundled transposed_ragged_dot returns lhs.dtype: ours is a drop-in replacement."""
    args = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32))
    with simulated_hopper():
        out = jax.eval_shape(transposed_ragged_matmul, *args)
    assert out == jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)


@pytest.mark.parametrize("name", list(TRANSPOSED_SWEEP_CONFIGS))
def test_config_lowers_for_hopper_at_the_benchmark_shapes(name):
    """Layout inference, wgmma/TMA checks and the 227 KiB shared-memory limit, without a GPU."""
    size = bench_grouped_matmul.GPU_SIZE
    for product in size.weight_gradients:
        args = (
            jax.ShapeDtypeStruct((size.rows, product.lhs_width), jnp.bfloat16),
            jax.ShapeDtypeStruct((size.rows, product.out_width), jnp.bfloat16),
            jax.ShapeDtypeStruct((size.groups,), jnp.int32),
        )
        kernel = jax.jit(lambda lhs, out_grad, sizes: transposed_ragged_matmul(
            lhs, out_grad, sizes, config=TRANSPOSED_SWEEP_CONFIGS[name]))
        with simulated_hopper():
            lowered = kernel.trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_oversized_config_is_refused_at_lowering():
    """The shared-memory check the lowering test relies on does fire for this kernel."""
    args = (
        jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    too_big = TransposedRaggedMatmulConfig(max_concurrent_steps=5)  # 5 x 48 KiB of stages
    kernel = jax.jit(lambda lhs, out_grad, sizes: transposed_ragged_matmul(
        lhs, out_grad, sizes, config=too_big))
    with simulated_hopper(), pytest.raises(ValueError, match="shared memory"):
        kernel.trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("lhs_shape,out_grad_shape,sizes_shape,dtype,match", [
    ((64, 128), (32, 256), (4,), jnp.bfloat16, "same rows"),
    ((64, 128), (64, 256, 1), (4,), jnp.bfloat16, "out_grad \\[R, N\\]"),
    ((64, 128), (64, 256), (4, 1), jnp.bfloat16, "group_sizes"),
    ((64, 128), (64, 256), (4,), jnp.float32, "bfloat16"),
    ((64, 192), (64, 256), (4,), jnp.bfloat16, "K=192"),
    ((64, 128), (64, 128), (4,), jnp.bfloat16, "tile_n=256"),
    ((64, 128), (64, 256), (0,), jnp.bfloat16, "a group"),
])
def test_unsupported_calls_raise_value_errors(lhs_shape, out_grad_shape, sizes_shape, dtype,
                                              match):
    with pytest.raises(ValueError, match=match):
        transposed_ragged_matmul(jnp.zeros(lhs_shape, dtype), jnp.zeros(out_grad_shape, dtype),
                                 jnp.zeros(sizes_shape, jnp.int32))


@pytest.mark.parametrize("options,match", [
    (dict(tile_n=384), "tile_n"),
    (dict(tile_n=64), "tile_n"),
    (dict(tile_rows=32), "tile_rows"),
    (dict(epilogue_tile_n=48), "epilogue_tile_n"),
    (dict(max_concurrent_steps=1), "max_concurrent_steps"),
])
def test_bad_configs_raise_value_errors(options, match):
    with pytest.raises(ValueError, match=match):
        TransposedRaggedMatmulConfig(**options)


def test_benchmark_reference_equals_ragged_dot_vjp():
    """The GPU test's and the benchmark's reference (a dense product a group) is the VJP's."""
    sizes = np.asarray([0, 70, 1, 100, 0], np.int32)
    lhs, out_grad = integer_operands(200, 128, 64)
    expected = ragged_dot_weight_gradient(lhs, out_grad, jnp.asarray(sizes))
    reference = bench_grouped_matmul.weight_gradient_reference(lhs, out_grad, sizes)
    np.testing.assert_array_equal(np.asarray(reference), np.asarray(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRANSPOSED_SWEEP_CONFIGS))
def test_real_sizes_on_gpu_match_xla(name):
    size = bench_grouped_matmul.GPU_SIZE
    sizes = bench_grouped_matmul.routed_group_sizes(size.rows, size.groups)
    for product in size.weight_gradients:
        lhs, out_grad = bench_grouped_matmul.weight_gradient_operands(size, product)
        out = transposed_ragged_matmul(lhs, out_grad, jnp.asarray(sizes),
                                       config=TRANSPOSED_SWEEP_CONFIGS[name])
        expected = bench_grouped_matmul.weight_gradient_reference(lhs, out_grad, sizes)
        error = relative_error(out, expected, norm="max")
        assert error <= bench_grouped_matmul.AGREEMENT_TOLERANCE, (product, error)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRANSPOSED_SWEEP_CONFIGS))
def test_boundaries_and_nan_rows_past_the_total_on_gpu(name):
    """The swizzled SMEM zeroing on real hardware: boundaries inside steps, empty groups, NaN in
    both operands past the total."""
    sizes = np.asarray([0, 1000, 37, 0, 2500, 3001, 1, 500], np.int32)
    num_rows = 8192
    lhs_key, out_grad_key = jax.random.split(jax.random.key(1))
    lhs = jax.random.normal(lhs_key, (num_rows, 256), jnp.bfloat16)
    out_grad = jax.random.normal(out_grad_key, (num_rows, 256), jnp.bfloat16)
    expected = bench_grouped_matmul.weight_gradient_reference(lhs, out_grad, sizes)
    lhs, out_grad = (operand.at[sizes.sum():].set(jnp.nan) for operand in (lhs, out_grad))
    out = transposed_ragged_matmul(lhs, out_grad, jnp.asarray(sizes),
                                   config=TRANSPOSED_SWEEP_CONFIGS[name])
    out = np.asarray(out.astype(jnp.float32))
    assert not out[sizes == 0].any()
    error = relative_error(out, expected, norm="max")
    assert error <= bench_grouped_matmul.AGREEMENT_TOLERANCE, error
