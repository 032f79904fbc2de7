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


def prepare_qk_vjp(q, k, d_q, d_k, *, scale, use_qk_l2norm):
    """The VJP of `prepare_qk`: the cotangents of its outputs mapped back to q and k.

    The same math as `jax.vjp(prepare_qk, q, k)`, written so that XLA reads each [.., K] row of
    the cotangents twice, K-minor: one reduction gives both `sum(x^2)` and `sum(x * dy)` (a single
    variadic reduce, so XLA does not share it with another reduction of x whose output it lays
    out transposed, as the kernels' [B, H, T] inverse norms are), then one elementwise pass
    `dx = r dy - x r^3 sum(x dy)`, r = rsqrt(sum(x^2) + eps).

    Args:
      q, k: [B, T, H, K], `prepare_qk`'s inputs.
      d_q, d_k: [B, T, HV, K], the cotangents of its outputs (HV a multiple of H).
      scale, use_qk_l2norm: as given to `prepare_qk`.
    Returns:
      (d_q, d_k): [B, T, H, K] in the dtypes of q and k.
    """

    def input_cotangent(x, d_y):
        dtype = jnp.promote_types(x.dtype, jnp.float32)
        *lead, num_heads, key_dim = x.shape
        d_y = d_y.astype(dtype)
        if d_y.shape[-2] != num_heads:  # the sum over each group's value heads
            d_y = d_y.reshape(*lead, num_heads, -1, key_dim).sum(axis=-2)
        if not use_qk_l2norm:
            return d_y.astype(x.dtype)
        x32 = x.astype(dtype)
        square_sum, dot = lax.reduce((x32 * x32, x32 * d_y), (dtype.type(0), dtype.type(0)),
                                     lambda a, b: (a[0] + b[0], a[1] + b[1]), (x.ndim - 1,))
        inverse_norm = lax.rsqrt(square_sum + L2_NORM_EPS)
        d_x = (inverse_norm[..., None] * d_y
               - x32 * (inverse_norm * inverse_norm * inverse_norm * dot)[..., None])
        return d_x.astype(x.dtype)

    return input_cotangent(q, d_q * scale), input_cotangent(k, d_k)


def pad_tokens(x: jax.Array, multiple: int, axis: int = 1) -> jax.Array:
    """`x` with zeros appended along its token axis (`axis`, of length T) up to a multiple of
    `multiple` tokens. Zero tokens (k = v = beta = g = 0) leave a KDA state as it is."""
    pad = -x.shape[axis] % multiple
    return jnp.pad(x, [(0, pad) if i == axis else (0, 0) for i in range(x.ndim)])


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


def document_index(segment_ids: jax.Array) -> jax.Array:
    """Each token's document, a run of equal ids (`document_starts`), numbered 0, 1, ... along its
    row: segment_ids [B, T] int -> [B, T] int32."""
    return jnp.cumsum(document_starts(segment_ids), axis=1, dtype=jnp.int32)


def causal_reach(bad: jax.Array, segment_ids: jax.Array | None,
                 bad_initial_state: jax.Array | None = None) -> jax.Array:
    """Which tokens a bad token can reach: itself and the later tokens of its document.

    A cumulative max of the last bad position, compared with the position where each token's
    document began (`document_starts`): elementwise work and one scan over T.

    Args:
      bad: bool [B, T, HV], tokens whose state write is non-finite.
      segment_ids: integer [B, T] or None (one document per row).
      bad_initial_state: bool [B, HV] or None; a bad initial state reaches the row's first
        document (the only one that reads it).
    Returns:
      bool [B, T, HV]: True where a bad token at or before this one lies in the same document.
    """
    length = bad.shape[1]
    position = jnp.arange(length, dtype=jnp.int32)
    last_bad = lax.cummax(jnp.where(bad, position[None, :, None], -1), axis=1)  # -1: none yet
    starts = document_starts(segment_ids)
    if starts is None:
        document_start = jnp.zeros((bad.shape[0], length), jnp.int32)
    else:
        document_start = lax.cummax(jnp.where(starts, position[None], 0), axis=1)  # [B, T]
    reached = last_bad >= document_start[..., None]
    if bad_initial_state is not None:
        reached = reached | (bad_initial_state[:, None, :] & (document_start == 0)[..., None])
    return reached
