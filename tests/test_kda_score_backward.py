"""The [token, key] score-tile backward kernel (`kda.kernels.mosaic_gpu_score_backward`).

Against kernel 2 of `kda.kernels.mosaic_gpu_prepare_backward` on the same inputs (the two sum the
same terms in another order from differently anchored hi/lo operands: equal to their rounding),
and, swapped into the preparation's VJP, against `jax.vjp` of the plain-JAX preparation. On CPU in
Mosaic GPU interpret mode (simulated Hopper, race detection) at small shapes, and lowered for Hopper
within two programs' shared memory an SM; on a Hopper GPU (`gpu` marker) at a real shape.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.extend import core as jax_core

from kda.kernels import mosaic_gpu_prepare_backward
from kda.kernels.mosaic_gpu_prepare_backward import _inverse_norms, _score_backward
from kda.kernels.mosaic_gpu_score_backward import score_backward
from kda.kernels.mosaic_gpu_tiles import CHUNK, documents_in_chunk, pad_to_chunks
from kda_inputs import relative_error
from test_kda_kernels import HOPPER, TWO_PROGRAMS_PER_SM, interpreted_on_simulated_hopper
from test_kda_kernels_prepare_backward import (LOWER_BOUND, assert_vjp_matches_plain_jax,
                                               preparation_case)

OUTPUT_NAMES = ("dq", "dk", "dg")
# The two kernels' outputs differ by the rounding of their hi/lo operands (2^-16 of a term; kernel
# 2 also rounds its row terms to hi/lo pairs to transpose them, hence dq's larger gap) and the
# order of float32 sums.
# Measured in interpret mode: dq 2.4e-6, dk 0.3-1.5e-7, dg 0.6-1.7e-7.
KERNEL_TOLERANCE = {"dq": 1e-5, "dk": 1e-6, "dg": 1e-6}
# On the GPU both kernels' wgmmas accumulate in the tensor cores' own float32 rounding and their
# exps run on MUFU; set before any GPU run.
GPU_KERNEL_TOLERANCE = {"dq": 1e-5, "dk": 1e-5, "dg": 1e-5}
# An H100/H200 SM has 228 KiB of shared memory and reserves 1 KiB a program.
ONE_PROGRAM_PER_SM = 227 * 1024


def score_kernel_inputs(seed, batch, length, heads, dim, *, saturated=False):
    """(args, options) of one `_score_backward` call, as the preparation's VJP makes them, with
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
            pad_to_chunks(g, jnp.float32, padded_length), document,
            _inverse_norms(q, True, padded_length) * options["scale"],
            _inverse_norms(k, True, padded_length), dakk.astype(jnp.bfloat16), dk_wy, cotangents)
    return args, dict(lower_bound=LOWER_BOUND, group=num_value_heads // num_heads)


def assert_kernels_agree(args, options, context=contextlib.nullcontext, warpgroups=2,
                         tolerance=KERNEL_TOLERANCE):
    """Each kernel runs in its own `context`: interpret mode checks only the last kernel launched
    for races."""
    outputs = []
    for kernel in (functools.partial(score_backward, warpgroups=warpgroups), _score_backward):
        with context():
            outputs.append(jax.block_until_ready(
                jax.jit(lambda *xs, kernel=kernel: kernel(*xs, **options))(*args)))
    for name, got, want in zip(OUTPUT_NAMES, *outputs):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert bool(jnp.all(jnp.isfinite(got))), name
        assert relative_error(got, want) <= tolerance[name], name


@pytest.mark.slow  # 10-20 s each
@pytest.mark.parametrize("dim,heads,saturated,warpgroups", [
    (64, (1, 2), False, 2),  # one slab a warpgroup, grouped value heads
    (128, (1, 1), True, 2),  # two slabs a warpgroup; g = L: the tile factors reach e^37.5
    (128, (1, 1), False, 4),  # one slab a warpgroup
])
def test_interpreted_kernel_matches_kernel_2(dim, heads, saturated, warpgroups):
    args, options = score_kernel_inputs(21, 1, 128, heads, dim, saturated=saturated)
    assert_kernels_agree(args, options, interpreted_on_simulated_hopper, warpgroups)


@pytest.mark.slow
@pytest.mark.parametrize("length,heads,dim,saturated", [
    (150, (1, 2), 64, False),  # a padded tail, grouped value heads
    (128, (1, 1), 64, True),
    (150, (1, 1), 128, False),
])
def test_interpreted_vjp_with_the_kernel_matches_plain_jax(monkeypatch, length, heads, dim,
                                                          saturated):
    monkeypatch.setattr(mosaic_gpu_prepare_backward, "_score_backward", score_backward)
    case = preparation_case(22, 1, length, heads, dim, segments=True, use_qk_l2norm=True,
                            saturated=saturated)
    with interpreted_on_simulated_hopper():
        assert_vjp_matches_plain_jax(*case)


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
    with (jax.sharding.use_abstract_mesh(HOPPER),
          mosaic_gpu_core.artificial_shared_memory_limit(shared_memory)):
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
    GPU, which interpret mode does not model. (Kernel 2, one warpgroup, has one.)"""
    args, options = score_kernel_inputs(26, 1, 64, (1, 1), 64)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    kernel_2 = jax.make_jaxpr(lambda *xs: _score_backward(*xs, **options))(*shapes)
    assert ("reduce_sum", (0,)) in reductions(kernel_2.jaxpr)
    kernel = jax.make_jaxpr(lambda *xs: score_backward(*xs, **options))(*shapes)
    assert not [axes for _, axes in reductions(kernel.jaxpr) if 0 in axes]


@pytest.mark.parametrize("dim,warpgroups,message", [
    (96, 2, "multiple of 64 for 2 warpgroups, got 96"),
    (64, 4, "multiple of 128 for 4 warpgroups, got 64"),
    (128, 1, "warpgroups must be at least 2, got 1"),
])
def test_unsupported_calls_are_refused(dim, warpgroups, message):
    g = jnp.zeros((1, 64, 1, dim))
    with pytest.raises(ValueError, match=message):
        score_backward(None, None, g, None, None, None, None, None, None, lower_bound=-5.0,
                       group=1, warpgroups=warpgroups)


@pytest.mark.gpu
@pytest.mark.parametrize("warpgroups", [2, 4])
def test_gpu_kernel_matches_kernel_2_and_the_vjp_matches_plain_jax(monkeypatch, warpgroups):
    assert_kernels_agree(*score_kernel_inputs(24, 2, 4100, (8, 16), 128), warpgroups=warpgroups,
                         tolerance=GPU_KERNEL_TOLERANCE)
    monkeypatch.setattr(mosaic_gpu_prepare_backward, "_score_backward",
                        functools.partial(score_backward, warpgroups=warpgroups))
    assert_vjp_matches_plain_jax(*preparation_case(25, 2, 4100, (8, 16), 128, segments=True,
                                                   use_qk_l2norm=True))
