"""The one-pass cotangent kernel (`kda.kernels.mosaic_gpu.recurrence_cotangents.chunk_cotangents`)
against the XLA products it replaces (`recurrence_cotangents`, the oracle).

Both compute the same bf16 products with float32 sums in another order: float32 outputs agree to
float32 rounding, bf16 outputs (rounded once from those sums) to one bf16 ulp, more only where
a sum cancels so far that float32's reordering error exceeds the ulp of its tiny result. On CPU
in Mosaic GPU interpret mode (simulated Hopper, race detection) at small shapes, for every K and
V in {64, 128}; lowered for Hopper within two programs' shared memory an SM; on a Hopper GPU (`gpu`
marker) at a real shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.harness import relative_error
from kda.chunked import CHUNK_SIZE, ChunkedInputs, chunks_to_tokens
from kda.kernels.mosaic_gpu.common import RecurrenceResiduals
from kda.kernels.mosaic_gpu.prepare_backward import ROUNDED_COTANGENTS
from kda.kernels.mosaic_gpu.recurrence_cotangents import chunk_cotangents
from kda.kernels.mosaic_gpu.reversed_recurrence import recurrence_cotangents
from tests.kda.kernels.hopper import (TWO_PROGRAMS_PER_SM, interpreted_on_simulated_hopper,
                                      lowering_for_hopper_within)
from tests.kda.tolerances import bf16_ulp

# float32 sums of the same bf16 products in another order (observed on CPU: below 1e-7).
FLOAT32_TOLERANCE = 1e-6
DIMS = [(64, 64), (128, 128), (64, 128), (128, 64)]  # (K, V)


def cotangent_inputs(seed, batch, heads, num_chunks, key_dim, value_dim, rounded):
    """(residuals, d_o, d_states, d_v_new) as the recurrence's VJP hands them: d_v_new in bf16
    where dU is rounded (the reversed kernel writes it so), else float32; d_o in bf16 then, and in
    float32 otherwise (the kernel path's rounding before the launch is checked too)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    chunked = (batch, heads, num_chunks)
    bf16 = lambda key, *shape: jax.random.normal(  # noqa: E731
        key, (*chunked, *shape), jnp.bfloat16)
    residuals = RecurrenceResiduals(states=bf16(keys[0], key_dim, value_dim),
                                    v_new=bf16(keys[1], CHUNK_SIZE, value_dim))
    d_states = bf16(keys[3], key_dim, value_dim)
    cotangent_dtype = jnp.bfloat16 if "U" in rounded else jnp.float32
    d_o = jax.random.normal(keys[2], (*chunked, CHUNK_SIZE, value_dim), cotangent_dtype)
    d_v_new = jax.random.normal(keys[4], (*chunked, CHUNK_SIZE, value_dim), cotangent_dtype)
    return residuals, d_o, d_states, d_v_new


def summation_order_bounds(residuals, d_o, d_states, d_v_new):
    """Per output element of each product, the most two float32 sums of the same V exact
    products (of bf16 values) can differ by in any orders: 2 (V - 1) 2^-24 sum |products|. Where
    a sum cancels to far below its terms this exceeds the bf16 ulp of the result."""
    states, v_new = residuals
    value_dim = states.shape[-1]

    def bound(subscripts, x, y):
        magnitude = lambda z: jnp.abs(z.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
        total = jnp.einsum(subscripts, magnitude(x), magnitude(y),
                           precision=jax.lax.Precision.HIGHEST)
        return np.asarray(total) * (2 * (value_dim - 1) * 2.0**-24)

    return dict(W=bound("...cv,...kv->...ck", d_v_new, states),
                q_from_state=bound("...cv,...kv->...ck", d_o, states),
                k_to_state=bound("...cv,...kv->...ck", v_new, d_states),
                Aqk=bound("...iv,...jv->...ij", d_o, v_new))


def assert_matches_oracle(actual: ChunkedInputs, expected: ChunkedInputs, inputs, rounded):
    """Same shapes and dtypes; dU bit for bit (passed through), float32 outputs within
    `FLOAT32_TOLERANCE`, each element of a bf16 output within one bf16 ulp plus what the float32
    summation order can change (`summation_order_bounds`). Returns each output's relative error."""
    bounds = summation_order_bounds(*inputs)
    errors = {}
    for name, got, want in zip(ChunkedInputs._fields, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert want.dtype == (jnp.bfloat16 if name in rounded else jnp.float32), name
        assert bool(jnp.all(jnp.isfinite(got))), name
        errors[name] = relative_error(got, want)
        if name == "U":
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif got.dtype == jnp.bfloat16:
            difference = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
            assert bool(np.all(difference <= bf16_ulp(want) + bounds[name])), name
        else:
            assert errors[name] <= FLOAT32_TOLERANCE, name
    return errors


# Rounded cotangents (what the VJP asks for) at every (K, V); float32 ones (another output dtype,
# the same tiles) at K = V. One program a (batch row, head, chunk): HV = N = 2 give every stride of
# the grid, and each interpreted program costs its run time.
@pytest.mark.parametrize("key_dim,value_dim,rounded", [
    *((key_dim, value_dim, ROUNDED_COTANGENTS) for key_dim, value_dim in DIMS),
    (64, 64, ()), (128, 128, ()),
])
def test_interpreted_kernel_matches_xla_products(key_dim, value_dim, rounded):
    inputs = cotangent_inputs(0, 1, 2, 2, key_dim, value_dim, rounded)
    expected = jax.jit(recurrence_cotangents, static_argnums=4)(*inputs, rounded)
    with interpreted_on_simulated_hopper():
        actual = jax.block_until_ready(chunk_cotangents(*inputs, rounded))
    assert_matches_oracle(actual, expected, inputs, rounded)


@pytest.mark.parametrize("key_dim,value_dim", [(64, 128), (128, 64)])
def test_interpreted_kernel_reads_token_major_d_o_as_the_chunk_major_one(key_dim, value_dim):
    """d_o given token-major, [B, N C, HV, V] (the kernel reads each chunk's token rows): exactly
    the cotangents of the [B, HV, N, C, V] d_o. B = HV = N = 2: every stride of [B, N C, HV, V]."""
    residuals, d_o, d_states, d_v_new = cotangent_inputs(2, 2, 2, 2, key_dim, value_dim,
                                                         ROUNDED_COTANGENTS)
    with interpreted_on_simulated_hopper():
        expected = jax.block_until_ready(
            chunk_cotangents(residuals, d_o, d_states, d_v_new, ROUNDED_COTANGENTS))
    with interpreted_on_simulated_hopper():
        actual = jax.block_until_ready(chunk_cotangents(
            residuals, chunks_to_tokens(d_o), d_states, d_v_new, ROUNDED_COTANGENTS))
    for name, got, want in zip(ChunkedInputs._fields, actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("rounded", [(), ROUNDED_COTANGENTS])
@pytest.mark.parametrize("key_dim,value_dim", DIMS)
@pytest.mark.parametrize("d_o_token_major", [False, True])
def test_kernel_lowers_for_hopper_two_programs_per_sm(key_dim, value_dim, rounded,
                                                      d_o_token_major):
    """Layout inference, wgmma and TMA checks with no GPU (d_o chunk-major or token-major), and
    the shared memory of two programs an SM. Shapes no other test here uses: a lowering cached
    under another limit would not be checked again."""
    residuals, d_o, d_states, d_v_new = jax.eval_shape(
        lambda: cotangent_inputs(0, 2, 3, 5, key_dim, value_dim, rounded))
    if d_o_token_major:
        d_o = jax.ShapeDtypeStruct((2, 5 * CHUNK_SIZE, 3, value_dim), d_o.dtype)
    kernel = jax.jit(chunk_cotangents, static_argnums=4)
    with lowering_for_hopper_within(TWO_PROGRAMS_PER_SM):
        lowered = kernel.trace(residuals, d_o, d_states, d_v_new, rounded).lower(
            lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("key_dim,value_dim,argument", [(256, 128, "K"), (128, 32, "V")])
def test_unsupported_dims_are_refused(key_dim, value_dim, argument):
    inputs = jax.eval_shape(lambda: cotangent_inputs(0, 1, 1, 1, key_dim, value_dim, ()))
    with pytest.raises(ValueError, match=f"residuals.states: {argument} must be one of"):
        chunk_cotangents(*inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("rounded", [(), ROUNDED_COTANGENTS])
def test_gpu_kernel_matches_xla_products(rounded):
    inputs = cotangent_inputs(1, 2, 16, 128, 128, 128, rounded)
    expected = jax.jit(recurrence_cotangents, static_argnums=4)(*inputs, rounded)
    actual = jax.jit(chunk_cotangents, static_argnums=4)(*inputs, rounded)
    assert_matches_oracle(actual, expected, inputs, rounded)
