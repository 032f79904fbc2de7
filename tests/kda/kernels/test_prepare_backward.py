"""The Mosaic GPU backward of the chunk preparation against `jax.vjp` of the plain-JAX one.

On CPU the kernels run in Mosaic GPU interpret mode (simulated Hopper, race detection) at small
shapes and are lowered for Hopper at K = 64 and 128 within the shared memory of two programs an
SM; on a Hopper GPU (`gpu` marker) they run at real shapes.
Cotangents are random normal `ChunkedInputs`, as the recurrence's backward would hand them; the
residuals the backward reads are the preparation kernel's (`save_for_backward`).
"""

import jax
import jax.numpy as jnp
import pytest

from kda.chunked import CHUNK_SIZE, ChunkedInputs, prepare_chunks
from kda.common import l2_normalize
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu import prepare_backward as mosaic_gpu_prepare_backward
from kda.kernels.mosaic_gpu.prepare_backward import prepare_chunks_vjp_kernel
from kda.kernels.mosaic_gpu.tiles import pad_to_chunks
from tests.kda.inputs import relative_error
from tests.kda.kernels.test_mosaic_gpu import (TWO_PROGRAMS_PER_SM, bf16_inputs, interpreted_on_simulated_hopper,
                              lowering_for_hopper_within)
from tests.kda.test_ops import BF16_TOLERANCE

LOWER_BOUND = -5.0
INPUT_NAMES = ("q", "k", "v", "g", "beta")


def preparation_case(seed, batch, length, heads, dim, *, segments, use_qk_l2norm,
                     saturated=False):
    """(inputs, options, cotangents) for one call of the preparation's VJP."""
    inputs = bf16_inputs(seed, batch, length, *heads, dim, segments=segments)
    if saturated:  # g = L everywhere: the tile factors reach e^37.5
        inputs["g"] = jnp.full_like(inputs["g"], LOWER_BOUND)
    if not use_qk_l2norm:  # unit keys as the caller's own norm makes them (else beta |k|^2 >> 2)
        for name in ("q", "k"):
            inputs[name] = l2_normalize(inputs[name].astype(jnp.float32)).astype(jnp.bfloat16)
    options = dict(scale=dim**-0.5, segment_ids=inputs.get("segment_ids"),
                   use_qk_l2norm=use_qk_l2norm, gate_lower_bound=LOWER_BOUND)
    shapes = jax.eval_shape(lambda *xs: prepare_chunks(*xs, chunk_size=64, **options),
                            *(inputs[name] for name in INPUT_NAMES))
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(shapes))
    cotangents = ChunkedInputs(*(jax.random.normal(key, shape.shape, jnp.float32)
                                 for key, shape in zip(keys, shapes)))
    return [inputs[name] for name in INPUT_NAMES], options, cotangents


def saved_residuals(args, options):
    """What the preparation kernel saves for the backward on these inputs."""
    _, residuals = jax.jit(lambda *xs: prepare_chunks_kernel(*xs, save_for_backward=True,
                                                             **options))(*args)
    return residuals


def chunk_cumulative_sum(g):
    """G = cumsum(g) within each chunk of 64 (the tail padded with zeros): float32
    [B, HV, N, C, K] from g [B, T, HV, K], as the preparation kernel saves it."""
    batch, length, heads, key_dim = g.shape
    num_chunks = -(-length // CHUNK_SIZE)
    chunks = pad_to_chunks(g, jnp.float32, num_chunks * CHUNK_SIZE).reshape(
        batch, num_chunks, CHUNK_SIZE, heads, key_dim)
    return jnp.moveaxis(jnp.cumsum(chunks, axis=2), 3, 1)


def assert_residuals_are_consistent(residuals, g, beta):
    """G is the chunks' cumulative sum of g (to float32 rounding), Akk strictly lower, and T's
    parts sum to the inverse of I + beta Akk (to the bf16 rounding of its operands: 1.8e-4 at
    most in the interpreted cases)."""
    num_chunks = residuals.G.shape[2]
    assert relative_error(residuals.G, chunk_cumulative_sum(g)) <= 1e-6
    akk = residuals.Akk.astype(jnp.float32)
    assert not jnp.any(jnp.triu(akk)), "Akk has entries on or above the diagonal"
    beta = jnp.moveaxis(pad_to_chunks(beta, jnp.float32, num_chunks * CHUNK_SIZE), 1, 2)
    unit_lower = jnp.eye(CHUNK_SIZE) + beta.reshape(*akk.shape[:-1], 1) * akk
    inverse = residuals.inverse.astype(jnp.float32).sum(axis=3)
    identity = jnp.broadcast_to(jnp.eye(CHUNK_SIZE), akk.shape)
    assert relative_error(inverse @ unit_lower, identity) <= 1e-3


def assert_vjp_matches_plain_jax(args, options, cotangents):
    _, plain_vjp = jax.vjp(lambda *xs: prepare_chunks(*xs, chunk_size=64, **options), *args)
    expected = plain_vjp(cotangents)
    residuals = saved_residuals(args, options)
    assert_residuals_are_consistent(residuals, args[INPUT_NAMES.index("g")],
                                    args[INPUT_NAMES.index("beta")])
    vjp = jax.jit(lambda r, c, *xs: prepare_chunks_vjp_kernel(*xs, residuals=r, cotangents=c,
                                                              **options))
    actual = vjp(residuals, cotangents, *args)
    for name, got, want in zip(INPUT_NAMES, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert relative_error(got, want) <= BF16_TOLERANCE[name], name


@pytest.mark.slow
@pytest.mark.parametrize("length,heads,dim,segments,use_qk_l2norm,saturated", [
    (64, (1, 1), 64, False, False, False),
    (150, (1, 2), 64, True, True, False),  # three chunks, a padded tail, grouped value heads
    (128, (1, 1), 64, True, False, True),  # g = L: the row and column terms of dG nearly cancel
    # K = 128: kernel 1 takes its right-hand sides in two 64-column halves, each of the score
    # kernel's warpgroups two slabs.
    (150, (1, 2), 128, True, True, False),
    # One value head per q/k head with the norm: its backward by `l2_norm_vjp_kernel`.
    (150, (2, 2), 64, True, True, False),
])
def test_interpreted_vjp_matches_plain_jax(length, heads, dim, segments, use_qk_l2norm,
                                           saturated):
    case = preparation_case(11, 1, length, heads, dim, segments=segments,
                            use_qk_l2norm=use_qk_l2norm, saturated=saturated)
    with interpreted_on_simulated_hopper():
        assert_vjp_matches_plain_jax(*case)


@pytest.mark.slow
@pytest.mark.parametrize("dim", [64, 128])
def test_interpreted_forward_with_saving_and_kernel_1_have_no_races(monkeypatch, dim):
    # Interpret mode keeps the race record of the last kernel launched only: in the tests above the
    # score kernel runs last, after the forward and kernel 1 (or, with the norm and one value head
    # per q/k head, `l2_norm_vjp_kernel`, whose own tests check it for races). Here the forward
    # (saving its residuals) runs alone, then the VJP with the score kernel replaced by zeros, so
    # kernel 1 is the last kernel launched. Three chunks: kernel 1's steps refill their input
    # slots.
    args, options, cotangents = preparation_case(14, 1, 192, (1, 2), dim, segments=True,
                                                 use_qk_l2norm=True)
    with interpreted_on_simulated_hopper():
        residuals = jax.block_until_ready(saved_residuals(args, options))

    def score_terms_as_zeros(q, k, G, *_, **__):
        return (jnp.zeros((*q.shape[:2], G.shape[1], G.shape[-1]), jnp.float32),) * 3

    monkeypatch.setattr(mosaic_gpu_prepare_backward, "score_backward", score_terms_as_zeros)
    vjp = jax.jit(lambda r, c, *xs: prepare_chunks_vjp_kernel(*xs, residuals=r, cotangents=c,
                                                              **options))
    with interpreted_on_simulated_hopper():
        dq, dk, dv, dg, dbeta = jax.block_until_ready(vjp(residuals, cotangents, *args))
    assert not jnp.any(dg)  # the stand-in ran; dv and dbeta are kernel 1's alone
    assert bool(jnp.all(jnp.isfinite(dv.astype(jnp.float32)))) and bool(jnp.any(dbeta))


@pytest.mark.slow  # about 10 s on an idle core
@pytest.mark.parametrize("dim", [64, 128])
def test_vjp_lowers_for_hopper_two_programs_per_sm(dim):
    """Layout inference, wgmma and TMA checks of both kernels, with no GPU; Mosaic GPU checks each
    kernel's shared memory (scratch, reduction scratch, alignment) against two programs an SM."""
    args, options, cotangents = preparation_case(12, 2, 200, (2, 4), dim, segments=True,
                                                 use_qk_l2norm=True)
    residuals = jax.eval_shape(lambda *xs: prepare_chunks_kernel(*xs, save_for_backward=True,
                                                                 **options)[1], *args)
    vjp = jax.jit(lambda r, c, *xs: prepare_chunks_vjp_kernel(*xs, residuals=r, cotangents=c,
                                                              **options))
    with lowering_for_hopper_within(TWO_PROGRAMS_PER_SM):
        lowered = vjp.trace(residuals, cotangents, *args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2


@pytest.mark.parametrize("dims,lower_bound,message", [
    ((128, 64), LOWER_BOUND, r"equal head sizes in \(64, 128\), got K=128, V=64"),
    ((32, 32), LOWER_BOUND, r"got K=32, V=32"),
    ((64, 64), None, r"gate_lower_bound must be in \[-5, 0\), got None"),
    ((64, 64), -6.0, r"got -6.0"),
])
def test_unsupported_calls_are_refused(dims, lower_bound, message):
    key_dim, value_dim = dims
    q = k = jnp.zeros((1, 64, 1, key_dim), jnp.bfloat16)
    v = jnp.zeros((1, 64, 1, value_dim), jnp.bfloat16)
    g = jnp.zeros((1, 64, 1, key_dim))
    with pytest.raises(ValueError, match=message):
        prepare_chunks_vjp_kernel(q, k, v, g, jnp.zeros((1, 64, 1)), scale=1.0, segment_ids=None,
                                  use_qk_l2norm=False, gate_lower_bound=lower_bound,
                                  residuals=None, cotangents=None)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_vjp_matches_plain_jax(dim):
    assert_vjp_matches_plain_jax(*preparation_case(13, 2, 8192, (16, 16), dim, segments=False,
                                                   use_qk_l2norm=True))


@pytest.mark.gpu
def test_gpu_vjp_packed_documents_and_grouped_heads():
    assert_vjp_matches_plain_jax(*preparation_case(14, 2, 4100, (8, 16), 128, segments=True,
                                                   use_qk_l2norm=True))
