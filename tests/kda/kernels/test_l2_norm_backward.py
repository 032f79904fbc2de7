"""The one-pass L2-norm backward (`kda.kernels.mosaic_gpu.l2_norm_backward.l2_norm_vjp_kernel`)
against `kda.common.prepare_qk_vjp` (the oracle), for q (scaled) and k.

Both evaluate the same float32 expression and round it to bf16 once; the order of the two row
sums differs (and on the GPU perhaps rsqrt's approximation and fused products), so each element
agrees to one bf16 ulp where its float32 value lies near a rounding boundary, and more only where
the two terms of dx cancel beyond what those can change (`float32_bounds`). In interpret mode,
over three seeds of the cases below, at most 4 elements in 76800 differed at all. On CPU in Mosaic
GPU interpret mode (simulated Hopper, race detection) at small shapes, K = 64 and 128, with and
without padded tokens of dy, and row counts that take zero tokens (TMA's row tiles) or end inside a
block; lowered for Hopper within four programs' shared memory an SM; on a Hopper GPU (`gpu`
marker) at a real shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda.common import prepare_qk_vjp
from kda.kernels.mosaic_gpu.l2_norm_backward import l2_norm_vjp_kernel
from tests.kda.kernels.hopper import (FOUR_PROGRAMS_PER_SM, interpreted_on_simulated_hopper,
                                      lowering_for_hopper_within)
from tests.kda.tolerances import bf16_ulp


def l2_norm_inputs(seed, batch, length, padded_length, heads, key_dim):
    """x bf16 [B, T, H, K] (random normal: norms about sqrt(K)) and float32 cotangents dq, dk
    [B, T', H, K] as the score kernel hands them (padded tokens included)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(keys[0], (batch, length, heads, key_dim), jnp.bfloat16)
    d_q, d_k = (jax.random.normal(key, (batch, padded_length, heads, key_dim), jnp.float32)
                for key in keys[1:])
    return x, d_q, d_k


def oracle(x, d_q, d_k, scale):
    """`prepare_qk_vjp` with x as both q and k: (dq, dk) [B, T, H, K] bf16."""
    length = x.shape[1]
    return jax.jit(prepare_qk_vjp, static_argnames=("scale", "use_qk_l2norm"))(
        x, x, d_q[:, :length], d_k[:, :length], scale=scale, use_qk_l2norm=True)


def float32_bounds(x, d_y, scale):
    """Per element, the most two float32 evaluations of dx = r dy - x r^3 dot can differ by when
    their sums of the same K products run in other orders: each sum by 2 (K - 1) 2^-24 of its
    sum of magnitudes (so r by half that of sum(x^2), relatively), rsqrt by 2^-22.9 each side
    (PTX's approximation; `COMPILER_PARAMS`), and each product by a rounding (one side may fuse
    it into the subtraction). Far below a bf16 ulp unless the two terms of dx cancel."""
    key_dim = x.shape[-1]
    x = np.asarray(x, np.float64)
    d_y = scale * np.asarray(d_y[:, :x.shape[1]], np.float64)
    summed = 2 * (key_dim - 1) * 2.0**-24
    inverse_norm = 1 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    inverse_norm_relative = summed / 2 + 2 * 2.0**-22.9
    magnitudes = np.sum(np.abs(x * d_y), axis=-1, keepdims=True)
    dot = np.abs(np.sum(x * d_y, axis=-1, keepdims=True))
    return ((inverse_norm_relative + 2.0**-24) * inverse_norm * np.abs(d_y)
            + np.abs(x) * inverse_norm**3 * (summed * magnitudes
                                             + (3 * inverse_norm_relative + 2.0**-24) * dot))


def assert_matches_oracle(actual, expected, x, d_y, scale):
    """Same shape and dtype, finite, each element within one bf16 ulp of the oracle's plus
    `float32_bounds`."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype == jnp.bfloat16
    got, want = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.all(np.isfinite(got))
    difference = np.abs(got - want)
    assert np.all(difference <= bf16_ulp(want) + float32_bounds(x, d_y, scale))


@pytest.mark.parametrize("batch,length,padded_length,heads,key_dim", [
    (2, 128, 128, 2, 64),  # T' = T, whole blocks (K = 128: the next cases)
    (2, 150, 192, 2, 128),  # padded tokens of dy; a batch row's last block ends inside it
    (1, 150, 192, 3, 64),  # 450 rows, not whole row tiles: zero tokens appended
    (1, 20, 64, 2, 128),  # fewer rows than a block
])
def test_interpreted_kernel_matches_prepare_qk_vjp(batch, length, padded_length, heads,
                                                   key_dim):
    x, d_q, d_k = l2_norm_inputs(0, batch, length, padded_length, heads, key_dim)
    scale = key_dim**-0.5
    expected_q, expected_k = oracle(x, d_q, d_k, scale)
    with interpreted_on_simulated_hopper():
        actual_q = jax.block_until_ready(l2_norm_vjp_kernel(x, d_q, scale=scale))
    with interpreted_on_simulated_hopper():
        actual_k = jax.block_until_ready(l2_norm_vjp_kernel(x, d_k, scale=1.0))
    assert_matches_oracle(actual_q, expected_q, x, d_q, scale)
    assert_matches_oracle(actual_k, expected_k, x, d_k, 1.0)


@pytest.mark.parametrize("key_dim", [64, 128])
def test_kernel_lowers_for_hopper_four_programs_per_sm(key_dim):
    """Layout inference and TMA checks with no GPU (a block ending past the rows included), and
    the shared memory of four programs an SM."""
    x = jax.ShapeDtypeStruct((2, 150, 4, key_dim), jnp.bfloat16)
    d_y = jax.ShapeDtypeStruct((2, 192, 4, key_dim), jnp.float32)
    kernel = jax.jit(lambda *xs: l2_norm_vjp_kernel(*xs, scale=key_dim**-0.5))
    with lowering_for_hopper_within(FOUR_PROGRAMS_PER_SM):
        lowered = kernel.trace(x, d_y).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("x_shape,x_dtype,d_y_shape,d_y_dtype,message", [
    ((1, 64, 2, 32), jnp.bfloat16, (1, 64, 2, 32), jnp.float32, r"K in \(64, 128\)"),
    ((1, 64, 2, 64), jnp.float32, (1, 64, 2, 64), jnp.float32, "x must be bf16"),
    ((1, 64, 2, 64), jnp.bfloat16, (1, 64, 2, 64), jnp.bfloat16, "d_y must be float32"),
    ((1, 64, 2, 64), jnp.bfloat16, (1, 100, 2, 64), jnp.float32, "d_y must be float32"),
    ((1, 128, 2, 64), jnp.bfloat16, (1, 64, 2, 64), jnp.float32, "d_y must be float32"),
    ((1, 64, 2, 64), jnp.bfloat16, (1, 64, 4, 64), jnp.float32, "d_y must be float32"),
])
def test_unsupported_calls_are_refused(x_shape, x_dtype, d_y_shape, d_y_dtype, message):
    with pytest.raises(ValueError, match=message):
        l2_norm_vjp_kernel(jnp.zeros(x_shape, x_dtype), jnp.zeros(d_y_shape, d_y_dtype),
                           scale=1.0)


@pytest.mark.gpu
def test_gpu_kernel_matches_prepare_qk_vjp():
    x, d_q, d_k = l2_norm_inputs(1, 2, 8192, 8192, 16, 128)
    scale = 128**-0.5
    expected_q, expected_k = oracle(x, d_q, d_k, scale)
    assert_matches_oracle(l2_norm_vjp_kernel(x, d_q, scale=scale), expected_q, x, d_q, scale)
    assert_matches_oracle(l2_norm_vjp_kernel(x, d_k, scale=1.0), expected_k, x, d_k, 1.0)
