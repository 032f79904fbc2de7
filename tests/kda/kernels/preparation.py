"""Cases of the chunk preparation for the kernel tests: its options, random cotangents of its
outputs, and the check of the Mosaic GPU preparation backward against `jax.vjp` of the plain-JAX
preparation (`prepare_chunks`).

Inputs are bf16 (`tests.kda.inputs.bf16_inputs`) with K = V = dim and bounded gates
(`LOWER_BOUND`); cotangents are random normal float32 `ChunkedInputs`, as the recurrence's backward
would hand them; the residuals the backward reads are the preparation kernel's
(`save_for_backward`).
"""

import jax
import jax.numpy as jnp

from experiments.harness import relative_error
from kda.chunked import CHUNK_SIZE, ChunkedInputs, prepare_chunks
from kda.common import l2_normalize
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.prepare_backward import prepare_chunks_vjp_kernel
from kda.kernels.mosaic_gpu.tiles import pad_to_chunks
from tests.kda.inputs import bf16_inputs
from tests.kda.tolerances import BF16_TOLERANCE

LOWER_BOUND = -5.0
INPUT_NAMES = ("q", "k", "v", "g", "beta")


def preparation_options(inputs, dim, lower_bound=LOWER_BOUND):
    """The keyword arguments of a preparation (kernel or `prepare_chunks`) on `inputs`."""
    return dict(scale=dim**-0.5, segment_ids=inputs.get("segment_ids"),
                use_qk_l2norm=inputs["use_qk_l2norm"], gate_lower_bound=lower_bound)


def with_unit_keys(inputs):
    """`inputs` with q and k of unit norm (float32 norm, rounded to bf16) and `use_qk_l2norm` off,
    as a caller's own norm hands them (unnormalised random keys would make beta |k|^2 >> 2)."""
    unit = {name: l2_normalize(inputs[name].astype(jnp.float32)).astype(jnp.bfloat16)
            for name in ("q", "k")}
    return {**inputs, **unit, "use_qk_l2norm": False}


def preparation_case(seed, batch, length, heads, dim, *, segments, use_qk_l2norm,
                     saturated=False):
    """(args [q, k, v, g, beta], options, cotangents) for one call of the preparation's VJP."""
    inputs = bf16_inputs(seed, batch, length, *heads, dim, segments=segments)
    if saturated:  # g = L everywhere: the tile factors reach e^37.5
        inputs["g"] = jnp.full_like(inputs["g"], LOWER_BOUND)
    if not use_qk_l2norm:
        inputs = with_unit_keys(inputs)
    options = preparation_options(inputs, dim)
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
    """The preparation kernel's saved residuals are consistent, and the backward kernels' dq, dk,
    dv, dg, dbeta have the shapes and dtypes of `jax.vjp` of `prepare_chunks` and lie within
    fla's bf16 bars of it."""
    expected = jax.jit(lambda c, *xs: jax.vjp(
        lambda *ys: prepare_chunks(*ys, chunk_size=64, **options), *xs)[1](c))(cotangents, *args)
    residuals = saved_residuals(args, options)
    assert_residuals_are_consistent(residuals, args[INPUT_NAMES.index("g")],
                                    args[INPUT_NAMES.index("beta")])
    vjp = jax.jit(lambda r, c, *xs: prepare_chunks_vjp_kernel(*xs, residuals=r, cotangents=c,
                                                              **options))
    actual = vjp(residuals, cotangents, *args)
    for name, got, want in zip(INPUT_NAMES, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert relative_error(got, want) <= BF16_TOLERANCE[name], name
