"""The Mosaic GPU backward of the chunk preparation against `jax.vjp` of the plain-JAX one.

On CPU the kernels run in Mosaic GPU interpret mode (simulated Hopper, race detection) at small
shapes and are lowered for Hopper at K = 64 and 128 within the shared memory of two programs an
SM; on a Hopper GPU (`gpu` marker) they run at real shapes. The cases (random cotangents of the
preparation's outputs) and the check are `tests.kda.kernels.preparation`'s.
"""

import jax
import jax.numpy as jnp
import pytest

from kda.kernels.mosaic_gpu import prepare_backward as mosaic_gpu_prepare_backward
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.prepare_backward import prepare_chunks_vjp_kernel
from tests.kda.kernels.hopper import (TWO_PROGRAMS_PER_SM, interpreted_on_simulated_hopper,
                                      lowering_for_hopper_within)
from tests.kda.kernels.preparation import (LOWER_BOUND, assert_vjp_matches_plain_jax,
                                           preparation_case, saved_residuals)


@pytest.mark.slow
@pytest.mark.parametrize("length,heads,dim,segments,use_qk_l2norm,saturated", [
    # A padded tail and grouped value heads at K = 64: in
    # `tests/kda/kernels/test_score_backward.py`, which runs this same VJP.
    # No segment ids (the kernels' document index all zeros) and g = L: the row and column terms
    # of dG nearly cancel.
    (128, (1, 1), 64, False, False, True),
    # K = 128: kernel 1 takes its right-hand sides in two 64-column halves, each of the score
    # kernel's warpgroups two slabs. Two chunks, a padded tail.
    (100, (1, 2), 128, True, True, False),
    # One value head per q/k head with the norm: its backward by `l2_norm_vjp_kernel`.
    (100, (2, 2), 64, True, True, False),
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
