"""Token-by-token Kimi Delta Attention: the oracle every other implementation is tested against.

Per value head, with a float32 state `S [K, V]`, for each token t:

    S <- S * exp(g_t)[:, None]             decay each key row c by exp(g_t[c])
    S <- S + beta_t k_t (v_t - k_t^T S)^T   delta-rule write against the *decayed* state
    o_t = S^T (scale * q_t)                 read after the write, so o_t sees token t

`recurrent_step` is that update for one token; it is also the decode step of `kda.layer.KDA`.

A plain scan's gradient keeps the state of every token, T x [B, HV, K, V] float32: at long
sequences more memory than the kernels' tests can spare on one GPU. Where those states would pass
`KEPT_STATES_MAX_BYTES`, the scan runs over blocks of `REMAT_BLOCK` tokens whose insides the
gradient recomputes (`jax.checkpoint`), keeping T / REMAT_BLOCK + REMAT_BLOCK states. The
arithmetic is the same token by token; on CPU the results are the plain scan's to the bit.
"""

import jax
import jax.numpy as jnp
from jax import lax

from kda.common import document_starts, einsum, pad_tokens, prepare_qk

REMAT_BLOCK = 64  # tokens between the states that the gradient keeps
# Below this the plain scan: its gradient compiles faster.
KEPT_STATES_MAX_BYTES = 2**30


def recurrent_step(state, q_t, k_t, v_t, g_t, beta_t):
    """Advances the KDA state by one token.

    Args:
      state: float32 [B, HV, K, V].
      q_t: float32 [B, HV, K], already scaled (and normalised if requested).
      k_t: float32 [B, HV, K].
      v_t: float32 [B, HV, V].
      g_t: float32 [B, HV, K], log-decay (<= 0).
      beta_t: float32 [B, HV], write strength.
    Returns:
      (state [B, HV, K, V], o_t [B, HV, V]), both float32.
    """
    state = state * jnp.exp(g_t)[..., None]
    prediction = einsum("bhk,bhkv->bhv", k_t, state)
    state = state + einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - prediction)
    return state, einsum("bhk,bhkv->bhv", q_t, state)


def kda_reference(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    use_qk_l2norm=False,
    gate_lower_bound=None,
):
    """KDA by a `lax.scan` over tokens. Exact for any gate; `gate_lower_bound` is not needed.

    Args:
      q, k: [B, T, H, K].
      v: [B, T, HV, V], HV a multiple of H.
      g: [B, T, HV, K] log-decay.
      beta: [B, T, HV].
      scale: read scale.
      initial_state: float32 [B, HV, K, V] or None (zeros).
      output_final_state: also return the state after the last token.
      segment_ids: integer [B, T] or None; the state restarts from zero where the id changes.
      use_qk_l2norm: L2-normalise q and k per head.
      gate_lower_bound: accepted for a common signature; unused.
    Returns:
      (o [B, T, HV, V] in v.dtype, final_state float32 [B, HV, K, V] or None).
    """
    del gate_lower_bound
    batch, _, num_value_heads, value_dim = v.shape
    q, k = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm,
                      num_value_heads=num_value_heads)
    dtype = q.dtype  # float32 (float64 for float64 inputs)
    if initial_state is None:
        initial_state = jnp.zeros((batch, num_value_heads, q.shape[-1], value_dim), dtype)
    starts = document_starts(segment_ids)
    if starts is None:
        starts = jnp.zeros(v.shape[:2], bool)

    def step(state, inputs):
        start, *token = inputs
        state = jnp.where(start[:, None, None, None], 0.0, state)
        return recurrent_step(state, *token)

    inputs = (starts, q, k, v.astype(dtype), g.astype(dtype), beta.astype(dtype))
    final_state, o = _scan_tokens(step, initial_state.astype(dtype), inputs)
    return o.astype(v.dtype), (final_state if output_final_state else None)


def _scan_tokens(step, state, inputs):
    """`lax.scan(step, state, inputs)` over the time axis 1 of `inputs` ([B, T, ...] each).

    Where T states would pass `KEPT_STATES_MAX_BYTES`, an outer scan over blocks of
    `REMAT_BLOCK` tokens and an inner, checkpointed scan within a block; T is then padded to
    whole blocks with tokens that leave the state as it is (`pad_tokens`) and whose outputs are
    dropped.

    Returns:
      (final state, outputs [B, T, ...] of `step`).
    """
    length = inputs[0].shape[1]
    time_major = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), inputs)  # [T, B, ...] each
    if length * state.size * state.dtype.itemsize <= KEPT_STATES_MAX_BYTES:
        state, out = lax.scan(step, state, time_major)
    else:
        blocked = jax.tree.map(  # [T, B, ...] -> [blocks, REMAT_BLOCK, B, ...]
            lambda x: pad_tokens(x, REMAT_BLOCK, axis=0).reshape(-1, REMAT_BLOCK, *x.shape[1:]),
            time_major)
        block_step = jax.checkpoint(lambda state, block: lax.scan(step, state, block))
        state, out = lax.scan(block_step, state, blocked)
        out = out.reshape(-1, *out.shape[2:])[:length]
    return state, jnp.moveaxis(out, 0, 1)
