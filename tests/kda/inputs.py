"""Random KDA inputs in fla's test style: q, k, v ~ U[0, 1), beta = sigmoid(N(0, 1)), log-decay
gates of either form from a raw projection ~ N(0, 1), and optionally an initial state and packed
documents. Errors against them are `experiments.harness.relative_error` (fla's relative RMSE)."""

import jax
import jax.numpy as jnp

from kda.gate import lower_bound_gate, softplus_gate


def make_gate(key, shape, form):
    """Log-decay of the given form from a raw projection ~ N(0, 1), [B, T, HV, K] float32."""
    k_raw, k_rate, k_bias = jax.random.split(key, 3)
    heads, dim = shape[2], shape[3]
    raw = jax.random.normal(k_raw, shape)
    dt_bias = jax.random.normal(k_bias, (heads, dim))
    if form == "lower_bound":
        return lower_bound_gate(raw, jnp.zeros(heads), dt_bias)
    A_log = jnp.log(jax.random.uniform(k_rate, (heads,), minval=1.0, maxval=16.0))
    return softplus_gate(raw, A_log, dt_bias)


def make_inputs(seed, batch, length, heads, value_heads, key_dim, value_dim, *, gate="lower_bound",
                dtype=jnp.float32, initial_state=False, segments=False):
    """Keyword arguments for `kda_attention`: q, k, v ~ U[0, 1) (as fla), beta = sigmoid(N(0, 1)).

    Segments, when asked for, cut each row into 1-4 documents at random positions.
    """
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    inputs = dict(
        q=jax.random.uniform(keys[0], (batch, length, heads, key_dim)).astype(dtype),
        k=jax.random.uniform(keys[1], (batch, length, heads, key_dim)).astype(dtype),
        v=jax.random.uniform(keys[2], (batch, length, value_heads, value_dim)).astype(dtype),
        g=make_gate(keys[3], (batch, length, value_heads, key_dim), gate),
        beta=jax.nn.sigmoid(jax.random.normal(keys[4], (batch, length, value_heads))),
        use_qk_l2norm=True,
    )
    if initial_state:
        inputs["initial_state"] = jax.random.normal(
            keys[5], (batch, value_heads, key_dim, value_dim))
    if segments:
        cuts = jax.random.randint(keys[6], (batch, 3), 0, length)
        positions = jnp.arange(length)
        inputs["segment_ids"] = (positions[None, :, None] >= cuts[:, None, :]).sum(-1) * 7 + 3
    return inputs


def bf16_inputs(seed, batch, length, heads, value_heads, dim, **options):
    """`make_inputs` with K = V = dim and q, k, v in bf16 (as the GPU kernels take them)."""
    return make_inputs(seed, batch, length, heads, value_heads, dim, dim, dtype=jnp.bfloat16,
                       **options)
