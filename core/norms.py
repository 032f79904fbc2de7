"""RMSNorm, the model's one normalisation (layer inputs, final norm, attention, MoE latents)."""

import jax
import jax.numpy as jnp
from flax import nnx

from core.sharding import logical_param


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32 whatever the input dtype.

    x: [..., D] -> [..., D] float32.
    """
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_norm(
    x: jax.Array, gain: jax.Array, eps: float, *, dtype: jnp.dtype | None = None
) -> jax.Array:
    """RMSNorm with gain `gain`, computed in float32 and cast to `dtype` (default: x.dtype).

    x: [..., D], gain: [D] -> [..., D].
    """
    y = rms_normalize(x, eps) * gain.astype(jnp.float32)
    return y.astype(x.dtype if dtype is None else dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learnable gain, computed in float32 and cast back to `dtype`.

    `axis_name` is the logical axis of the gain (the normalised feature axis), used for sharding.
    """

    def __init__(
        self,
        num_features: int,
        *,
        eps: float,
        axis_name: str | None,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        self.eps = eps
        self.dtype = dtype
        self.scale = logical_param(jnp.ones((num_features,), param_dtype), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in `dtype`."""
        return rms_norm(x, self.scale[...], self.eps, dtype=self.dtype)
