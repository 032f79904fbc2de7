"""Input preparation shared by every KDA implementation (reference, chunked, kernels)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Every float32 contraction in the plain-JAX implementations runs at full precision: on GPUs the
# default would round operands to TF32 and the "exact" ops would no longer be exact.
einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)

L2_NORM_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS) -> jax.Array:
    """`x * rsqrt(sum(x^2) + eps)` over the last axis, as fla's in-kernel L2 norm."""
    return x * lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def prepare_qk(q, k, *, scale, use_qk_l2norm, num_value_heads):
    """Queries and keys in the compute dtype, one head per value head, q multiplied by `scale`.

    The compute dtype is float32, or float64 for float64 inputs (finite-difference checks).

    Args:
      q, k: [B, T, H, K].
      scale: softmax-free read scale (default K**-0.5 is applied by the caller).
      use_qk_l2norm: L2-normalise q and k per head first.
      num_value_heads: HV, a multiple of H; each q/k head serves HV // H consecutive value heads.
    Returns:
      (q, k): [B, T, HV, K] in the compute dtype.
    """
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    q = q.astype(dtype)
    k = k.astype(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = num_value_heads // q.shape[2]
    if group > 1:
        q = jnp.repeat(q, group, axis=2)
        k = jnp.repeat(k, group, axis=2)
    return q * scale, k


def document_starts(segment_ids: jax.Array | None) -> jax.Array | None:
    """Marks the tokens where a new packed document begins (the state restarts from zero).

    Args:
      segment_ids: integer [B, T] or None.
    Returns:
      bool [B, T], True where `segment_ids` differs from the previous token (never at t = 0, so an
      initial state always applies to the first document), or None.
    """
    if segment_ids is None:
        return None
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed, ((0, 0), (1, 0)))

