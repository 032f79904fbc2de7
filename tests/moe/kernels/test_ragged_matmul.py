"""`moe.kernels.mosaic_gpu.ragged_matmul`: the warp-specialized row-ragged grouped GEMM for Hopper.

On CPU the kernel runs in Mosaic GPU interpret mode (simulated Hopper: three warpgroups, TMA,
barriers, wgmma; race detection on) at small sizes, with integer-valued bf16 operands so that
every float32 sum is exact and the bf16 result must equal `jax.lax.ragged_dot`'s bit for bit; the
rows past sum(group_sizes) must stay unwritten (interpret mode fills fresh buffers with NaN). Few
simulated SMs make each program walk several tiles, which exercises the tile-to-tile pipeline.
Every shipped config is also lowered for Hopper at the benchmark's real shapes, which runs Mosaic
GPU's layout, wgmma, TMA and shared-memory checks without a GPU. The `gpu` test runs the real
sizes against XLA's ragged_dot.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Interpret mode has no public race report; jax is pinned, so the private one is stable here.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from experiments import bench_grouped_matmul
from experiments.harness import relative_error
from moe.kernels.mosaic_gpu.ragged_matmul import ragged_matmul, work_table
from moe.kernels.mosaic_gpu.simulation import interpreted_on_cpu, simulated_hopper
from moe.kernels.mosaic_gpu.tiling import (
    DEFAULT_CONFIG,
    SWEEP_CONFIGS,
    TRANSPOSED_DEFAULT_CONFIG,
    TRANSPOSED_SWEEP_CONFIGS,
    RaggedMatmulConfig,
    config_for,
)


def integer_operands(num_rows, contraction, columns, num_groups, transpose_rhs, seed=0):
    """bf16 lhs [M, K] and rhs [G, K, N] (or [G, N, K]) holding small integers: exact sums."""
    rng = np.random.default_rng(seed)
    lhs = rng.integers(-3, 4, (num_rows, contraction))
    rhs_shape = (columns, contraction) if transpose_rhs else (contraction, columns)
    rhs = rng.integers(-3, 4, (num_groups, *rhs_shape))
    return jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)


def interpreted(lhs, rhs, group_sizes, transpose_rhs, config, num_sms):
    """ragged_matmul in interpret mode, failing on any data race: [M, N] as numpy float32."""
    gpu_interpret.reset_gpu_interpret_mode_state()
    with interpreted_on_cpu(num_sms=num_sms, detect_races=True):
        out = ragged_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, config=config)
        out = np.asarray(out.astype(jnp.float32))
    assert not gpu_interpret.get_races().races_found, "the kernel has a data race"
    return out


def assert_matches_ragged_dot(out, lhs, rhs, group_sizes, transpose_rhs):
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    expected = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    expected = np.asarray(expected.astype(jnp.bfloat16).astype(jnp.float32))
    covered = int(np.sum(group_sizes))
    np.testing.assert_array_equal(out[:covered], expected[:covered])
    assert np.isnan(out[covered:]).all(), "rows past sum(group_sizes) were written"


# (config, M, K, N, group sizes, transpose_rhs, simulated SMs). Group boundaries fall inside row
# blocks and inside a consumer's 64 rows, on a consumer boundary (64) and on a block boundary.
INTERPRETED_CASES = {
    # Boundaries at 64, 128, inside a block (258) and at the total (298 of 328 rows).
    "default, empty groups, M not a multiple of tile_m, rows past the total": (
        DEFAULT_CONFIG, 328, 128, 256, [0, 64, 64, 0, 130, 40], False, 3),
    "default, transposed rhs, 4 steps a tile": (
        DEFAULT_CONFIG, 384, 256, 256, [100, 0, 156, 1, 63], True, 2),
    "default, one group holds every row": (
        DEFAULT_CONFIG, 256, 128, 256, [0, 0, 256, 0], True, 2),
    # Bands one column block wide: the tile order snakes down and up the work items.
    "128x128, four column blocks in bands of one": (
        RaggedMatmulConfig(tile_n=128, epilogue_tile_n=64, grid_tile_width=1),
        256, 128, 512, [90, 100, 40], False, 3),
    # What `config_for` picks for widths the default does not divide (moe.grouped_matmul's
    # GPU test): 128-column tiles and no tile overlap at K / 64 = 6 steps.
    "config_for(384, 384), transposed rhs": (
        config_for(384, 384), 256, 384, 384, [0, 100, 60, 96], True, 2),
    **{
        f"{name}, boundaries inside blocks": (config, 384, 256, 256, [70, 0, 100, 150], True, 3)
        for name, config in SWEEP_CONFIGS.items()
        if config != DEFAULT_CONFIG
    },
}


@pytest.mark.parametrize("case", list(INTERPRETED_CASES))
def test_interpreted_kernel_equals_ragged_dot(case):
    config, num_rows, contraction, columns, sizes, transpose_rhs, num_sms = INTERPRETED_CASES[case]
    lhs, rhs = integer_operands(num_rows, contraction, columns, len(sizes), transpose_rhs)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = interpreted(lhs, rhs, group_sizes, transpose_rhs, config, num_sms)
    assert_matches_ragged_dot(out, lhs, rhs, group_sizes, transpose_rhs)


def test_config_for_takes_the_default_where_its_tiles_divide():
    assert config_for(1024, 2048) == config_for(2048, 1024) == DEFAULT_CONFIG
    narrow = config_for(256, 384)
    assert narrow.tile_n == 128 and narrow.overlap_tiles
    assert not config_for(384, 384).overlap_tiles and config_for(384, 384).tile_n == 128
    assert not config_for(384, 512).overlap_tiles and config_for(384, 512).tile_n == 256


def test_every_shipped_config_is_interpreted_here():
    interpreted_configs = {case[0] for case in INTERPRETED_CASES.values()}
    assert set(SWEEP_CONFIGS.values()) <= interpreted_configs
    assert DEFAULT_CONFIG in SWEEP_CONFIGS.values()


@pytest.mark.parametrize("name", list(SWEEP_CONFIGS))
def test_config_lowers_for_hopper_at_the_benchmark_shapes(name):
    """Layout inference, wgmma/TMA checks and the 227 KiB shared-memory limit, without a GPU."""
    size = bench_grouped_matmul.GPU_SIZE
    for product in size.products:
        rhs_shape = (product.columns, product.contraction) if product.transpose_rhs else (
            product.contraction, product.columns)
        args = (
            jax.ShapeDtypeStruct((size.rows, product.contraction), jnp.bfloat16),
            jax.ShapeDtypeStruct((size.groups, *rhs_shape), jnp.bfloat16),
            jax.ShapeDtypeStruct((size.groups,), jnp.int32),
        )
        kernel = jax.jit(lambda lhs, rhs, sizes: ragged_matmul(
            lhs, rhs, sizes, transpose_rhs=product.transpose_rhs, config=SWEEP_CONFIGS[name]))
        with simulated_hopper():
            lowered = kernel.trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_identical_launches_share_one_lowered_kernel():
    """Two grouped GEMMs of one shape in one program lower one Mosaic GPU kernel between them."""
    lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    twice = jax.jit(lambda lhs, rhs, other, sizes: ragged_matmul(lhs, rhs, sizes)
                    + ragged_matmul(lhs, other, sizes))
    with simulated_hopper():
        text = twice.trace(lhs, rhs, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 1


def test_oversized_config_is_refused_at_lowering():
    """The shared-memory check the lowering test relies on does fire."""
    args = (
        jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    too_big = RaggedMatmulConfig(max_concurrent_steps=4, epilogue_tile_n=64)
    kernel = jax.jit(lambda lhs, rhs, sizes: ragged_matmul(lhs, rhs, sizes, config=too_big))
    with simulated_hopper(), pytest.raises(ValueError, match="shared memory"):
        kernel.trace(*args).lower(lowering_platforms=("cuda",))


def work_items_by_brute_force(sizes, num_rows, tile_m):
    """[(group, first row, end row)] of every (group, row block) pair with rows, in row order."""
    items, start = [], 0
    for group, size in enumerate(sizes):
        end = min(start + size, num_rows)
        for block in range(num_rows // tile_m + 1):
            first, last = max(start, block * tile_m), min(end, (block + 1) * tile_m)
            if first < last:
                items.append((group, first, last))
        start = end
    return items


@settings(deadline=None, max_examples=15)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 64, 100, 128, 130]), min_size=5, max_size=5),
    tile_m=st.sampled_from([64, 128]),
)
def test_work_table_lists_each_group_row_block_once(sizes, tile_m):
    num_rows = 400  # some draws cover fewer rows, some more (their last groups are clipped)
    table, count = work_table(jnp.asarray(sizes, jnp.int32), num_rows, tile_m)
    table, count = np.asarray(table), int(count[0])
    assert table.shape == (3, -(-num_rows // tile_m) + len(sizes) - 1)
    expected = work_items_by_brute_force(sizes, num_rows, tile_m)
    assert count == len(expected)
    assert [tuple(item) for item in table[:, :count].T] == expected
    assert (table[1:, count:] == 0).all()  # the unused items hold no rows


@pytest.mark.parametrize("lhs_shape,rhs_shape,sizes_shape,transpose_rhs,dtype,config,match", [
    ((64, 128), (4, 256, 256), (4,), False, jnp.bfloat16, DEFAULT_CONFIG, "transpose_rhs=True"),
    ((64, 128), (4, 128), (4,), False, jnp.bfloat16, DEFAULT_CONFIG, "lhs \\[M, K\\]"),
    ((64, 128), (4, 128, 256), (3,), False, jnp.bfloat16, DEFAULT_CONFIG, "group_sizes"),
    ((64, 128), (4, 128, 256), (4,), False, jnp.float32, DEFAULT_CONFIG, "bfloat16"),
    ((64, 128), (4, 128, 128), (4,), False, jnp.bfloat16, DEFAULT_CONFIG, "tile_n=256"),
    ((64, 96), (4, 96, 256), (4,), False, jnp.bfloat16, DEFAULT_CONFIG, "tile_k=64"),
    ((64, 320), (4, 320, 256), (4,), False, jnp.bfloat16, DEFAULT_CONFIG, "overlap_tiles"),
])
def test_unsupported_calls_raise_value_errors(lhs_shape, rhs_shape, sizes_shape, transpose_rhs,
                                              dtype, config, match):
    with pytest.raises(ValueError, match=match):
        ragged_matmul(jnp.zeros(lhs_shape, dtype), jnp.zeros(rhs_shape, dtype),
                      jnp.zeros(sizes_shape, jnp.int32), transpose_rhs=transpose_rhs,
                      config=config)


@pytest.mark.parametrize("options,match", [
    (dict(tile_m=64), "tile_m"),
    (dict(tile_n=384), "tile_n"),
    (dict(tile_k=32), "tile_k"),
    (dict(epilogue_tile_n=48), "epilogue_tile_n"),
    (dict(max_concurrent_steps=1), "max_concurrent_steps"),
    (dict(grid_tile_width=0), "grid_tile_width"),
])
def test_bad_configs_raise_value_errors(options, match):
    with pytest.raises(ValueError, match=match):
        RaggedMatmulConfig(**options)


@pytest.mark.slow
def test_benchmark_smoke_writes_its_table(tmp_path):
    out = tmp_path / "grouped_matmul_smoke.md"
    default_name = next(name for name, c in SWEEP_CONFIGS.items() if c == DEFAULT_CONFIG)
    default_weight_grad_name = next(
        name for name, c in TRANSPOSED_SWEEP_CONFIGS.items() if c == TRANSPOSED_DEFAULT_CONFIG)
    rows = bench_grouped_matmul.main(
        ["--smoke", "--configs", default_name, "--weight-grad-configs", default_weight_grad_name,
         "--out", str(out)]
    )
    *products_rows, table_row = rows
    row_ragged = [row for row in products_rows if row["family"] == bench_grouped_matmul.ROW_RAGGED]
    weight_grads = [row for row in products_rows if row not in row_ragged]
    assert {row["kernel"] for row in row_ragged} == {
        bench_grouped_matmul.BUNDLED, "ours", bench_grouped_matmul.DENSE}
    # The bundled weight-gradient kernel has no interpret mode: ours and dense only on CPU.
    assert {row["kernel"] for row in weight_grads} == {"ours", bench_grouped_matmul.DENSE}
    products = len(bench_grouped_matmul.SMOKE_SIZE.products)
    weight_gradients = len(bench_grouped_matmul.SMOKE_SIZE.weight_gradients)
    assert len(row_ragged) == 3 * products and len(weight_grads) == 2 * weight_gradients
    assert all(row["ms"] > 0 and row["tflops"] > 0 for row in products_rows)
    assert table_row["kernel"] == bench_grouped_matmul.WORK_TABLE and table_row["ms"] > 0
    assert not bench_grouped_matmul.disagreements(rows)
    table = out.read_text()
    # One row a product, one in each family's totals.
    assert table.count("| ours |") == products + weight_gradients + 2
    assert f"Summed over the {products} row-ragged product(s)" in table
    assert f"Summed over the {weight_gradients} weight-gradient product(s)" in table


def test_routed_group_sizes_cover_every_row():
    sizes = bench_grouped_matmul.routed_group_sizes(131072, 64)
    assert sizes.sum() == 131072 and sizes.dtype == np.int32
    assert 1800 < sizes.min() and sizes.max() < 2300  # about 2048 each


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SWEEP_CONFIGS))
def test_real_sizes_on_gpu_match_ragged_dot(name):
    size = bench_grouped_matmul.GPU_SIZE
    group_sizes = jnp.asarray(bench_grouped_matmul.routed_group_sizes(size.rows, size.groups))
    for product in size.products:
        lhs, rhs, _ = bench_grouped_matmul.product_operands(size, product)
        out = ragged_matmul(lhs, rhs, group_sizes, transpose_rhs=product.transpose_rhs,
                            config=SWEEP_CONFIGS[name])
        expected = bench_grouped_matmul.reference(lhs, rhs, group_sizes, product.transpose_rhs)
        error = relative_error(out[:size.rows], expected[:size.rows], norm="max")
        assert error <= bench_grouped_matmul.AGREEMENT_TOLERANCE, (product, error)
