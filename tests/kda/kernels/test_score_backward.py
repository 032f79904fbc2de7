"""The [token, key] score-tile backward kernel (`kda.kernels.mosaic_gpu.score_backward`).

In the preparation's VJP against `jax.vjp` of the plain-JAX preparation, and with four warpgroups
against two (each warpgroup's slab is computed alike: equal bit for bit). On CPU in Mosaic GPU
interpret mode (simulated Hopper, race detection) at small shapes, and lowered for Hopper within
two programs' shared memory an SM (one of four warpgroups); on a Hopper GPU (`gpu` marker) at a
real shape.
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core as jax_core

from experiments.harness import relative_error
from kda.kernels.mosaic_gpu.prepare_backward import _inverse_norms
from kda.kernels.mosaic_gpu.score_backward import score_backward
from kda.kernels.mosaic_gpu.tiles import CHUNK, documents_in_chunk, pad_to_chunks
from tests.kda.kernels.hopper import (ONE_PROGRAM_PER_SM, TWO_PROGRAMS_PER_SM,
                                      interpreted_on_simulated_hopper, lowering_for_hopper_within)
from tests.kda.kernels.preparation import (LOWER_BOUND, assert_vjp_matches_plain_jax,
                                           chunk_cumulative_sum, preparation_case)

OUTPUT_NAMES = ("dq", "dk", "dg")
# Set before any GPU run: the same operations on each slab, but two warpgroups run one slab's
# code and four another's (a loop over two slabs, or one slab), which ptxas may contract into
# FMAs differently.
GPU_WARPGROUPS_TOLERANCE = 1e-6


def score_kernel_inputs(seed, batch, length, heads, dim, *, saturated=False):
    """(args, options) of one `score_backward` call, as the preparation's VJP makes them, with
    kernel 1's outputs (dAkk masked like it, dk's UT term) drawn at random."""
    (q, k, _, g, _), options, cotangents = preparation_case(
        seed, batch, length, heads, dim, segments=True, use_qk_l2norm=True, saturated=saturated)
    num_heads, num_value_heads = heads
    padded_length = -(-length // CHUNK) * CHUNK
    document = documents_in_chunk(options["segment_ids"], batch, padded_length)
    keys = jax.random.split(jax.random.PRNGKey(seed + 2), 2)
    chunked_shape = cotangents.W.shape[:3]
    chunk_document = document.reshape(batch, 1, -1, CHUNK)
    positions = jnp.arange(CHUNK)
    strictly_lower_same_document = ((positions[:, None] > positions[None, :])
                                    & (chunk_document[..., :, None]
                                       == chunk_document[..., None, :]))
    dakk = jnp.where(strictly_lower_same_document,
                     jax.random.normal(keys[0], (*chunked_shape, CHUNK, CHUNK)), 0.0)
    dk_wy = jax.random.normal(keys[1], (*chunked_shape, CHUNK, dim))
    cotangents = cotangents._replace(Aqk=cotangents.Aqk.astype(jnp.bfloat16))
    args = (pad_to_chunks(q, jnp.bfloat16, padded_length),
            pad_to_chunks(k, jnp.bfloat16, padded_length),
            chunk_cumulative_sum(g), document,
            _inverse_norms(q, True, padded_length) * options["scale"],
            _inverse_norms(k, True, padded_length), dakk.astype(jnp.bfloat16), dk_wy, cotangents)
    return args, dict(lower_bound=LOWER_BOUND, group=num_value_heads // num_heads)


def assert_warpgroup_counts_agree(args, options, context, tolerance=0.0):
    """Four warpgroups (one slab each) give what two (two slabs each) give: bit for bit in
    interpret mode (`tolerance` 0). Each runs in its own `context`: interpret mode checks only the
    last kernel launched for races."""
    outputs = []
    for warpgroups in (4, 2):
        with context():
            outputs.append(jax.block_until_ready(jax.jit(
                lambda *xs, w=warpgroups: score_backward(*xs, warpgroups=w, **options))(*args)))
    for name, got, want in zip(OUTPUT_NAMES, *outputs):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), name
        if tolerance:
            assert relative_error(got, want) <= tolerance, name
        else:
            assert bool(jnp.array_equal(got, want)), name


@pytest.mark.slow  # 20-40 s
def test_interpreted_four_warpgroups_match_two():
    """g = L: the tile factors reach e^37.5."""
    args, options = score_kernel_inputs(21, 1, 128, (1, 1), 128, saturated=True)
    assert_warpgroup_counts_agree(args, options, interpreted_on_simulated_hopper)


@pytest.mark.slow
def test_interpreted_vjp_matches_plain_jax():
    """Three chunks, a padded tail, grouped value heads at K = 64. The preparation VJP's other
    cases (K = 128, g = L, no norm, no documents) are those of
    `tests/kda/kernels/test_prepare_backward.py`: the same VJP, score kernel included."""
    case = preparation_case(22, 1, 150, (1, 2), 64, segments=True, use_qk_l2norm=True)
    with interpreted_on_simulated_hopper():
        assert_vjp_matches_plain_jax(*case)


@pytest.mark.slow
@pytest.mark.parametrize("dim,warpgroups,shared_memory", [
    (64, 2, TWO_PROGRAMS_PER_SM),
    (128, 2, TWO_PROGRAMS_PER_SM),
    (128, 4, ONE_PROGRAM_PER_SM),
])
def test_kernel_lowers_for_hopper(dim, warpgroups, shared_memory):
    """Layout inference, wgmma and TMA checks with no GPU, and the shared memory of two programs
    of two warpgroups an SM (or one of four)."""
    args, options = score_kernel_inputs(23, 2, 192, (2, 4), dim)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    kernel = jax.jit(lambda *xs: score_backward(*xs, warpgroups=warpgroups, **options))
    with lowering_for_hopper_within(shared_memory):
        lowered = kernel.trace(*shapes).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def reductions(jaxpr):
    """(primitive name, axes) of every reduction in jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("reduce_"):
            found.append((eqn.primitive.name, eqn.params["axes"]))
        for param in eqn.params.values():
            for inner in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(inner, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
                    found += reductions(getattr(inner, "jaxpr", inner))
    return found


def test_kernel_sums_over_no_rows():
    """A sum over a tile's rows (spread over the warps) goes through Mosaic GPU's reduction
    scratch, at the same addresses for every warpgroup: with two, their sums would race on the
    GPU, which interpret mode does not model. (A one-warpgroup kernel with such a sum shows that
    the walk finds it inside a kernel.)"""

    def column_sums(x_gmem, out_gmem, x_smem, out_smem, loaded):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, loaded)
        plgpu.barrier_wait(loaded)
        out_smem[...] = jnp.sum(plgpu.load(x_smem, layout=plgpu.Layout.WGMMA), axis=0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    witness = plgpu.kernel(column_sums, out_type=jax.ShapeDtypeStruct((CHUNK,), jnp.float32),
                           scratch_types=(plgpu.SMEM((CHUNK, CHUNK), jnp.float32),
                                          plgpu.SMEM((CHUNK,), jnp.float32), plgpu.Barrier()))
    tile = jax.ShapeDtypeStruct((CHUNK, CHUNK), jnp.float32)
    assert ("reduce_sum", (0,)) in reductions(jax.make_jaxpr(witness)(tile).jaxpr)
    args, options = score_kernel_inputs(26, 1, 64, (1, 1), 64)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    kernel = jax.make_jaxpr(lambda *xs: score_backward(*xs, **options))(*shapes)
    assert not [axes for _, axes in reductions(kernel.jaxpr) if 0 in axes]


@pytest.mark.parametrize("dim,warpgroups,message", [
    (96, 2, "multiple of 64 for 2 warpgroups, got 96"),
    (64, 4, "multiple of 128 for 4 warpgroups, got 64"),
    (128, 1, "warpgroups must be at least 2, got 1"),
])
def test_unsupported_calls_are_refused(dim, warpgroups, message):
    G = jnp.zeros((1, 1, 1, CHUNK, dim))
    with pytest.raises(ValueError, match=message):
        score_backward(None, None, G, None, None, None, None, None, None, lower_bound=-5.0,
                       group=1, warpgroups=warpgroups)


@pytest.mark.gpu
def test_gpu_four_warpgroups_match_two():
    assert_warpgroup_counts_agree(*score_kernel_inputs(24, 2, 4100, (8, 16), 128),
                                  context=contextlib.nullcontext,
                                  tolerance=GPU_WARPGROUPS_TOLERANCE)
