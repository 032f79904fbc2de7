"""The KDA layer: decode equals prefill, documents stay apart, counts and errors."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments.harness import relative_error
from kda import layer as layer_module
from kda.layer import KDA, KDAConfig, causal_depthwise_conv, count_kda_params
from kda.segments import kda_attention_in_segments

CONFIGS = {
    "k3": KDAConfig(num_heads=2, head_dim=16, gate="lower_bound", full_rank_gate=True),
    "kimi_linear_gva": KDAConfig(num_heads=1, head_dim=16, num_value_heads=2, gate="softplus"),
}


def _layer(name, d_model=24):
    return KDA(d_model, CONFIGS[name], rngs=nnx.Rngs(0))


def _tokens(batch, length, d_model=24, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (batch, length, d_model))


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_count_matches_the_built_layer(name):
    layer = _layer(name)
    built = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    assert built == count_kda_params(24, CONFIGS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_then_token_by_token_decode_equals_the_full_forward(name):
    layer = _layer(name)
    x = _tokens(2, 70)
    full = layer(x)
    y, cache = layer(x[:, :66], return_cache=True)  # a prefill longer than one chunk
    pieces = [y]
    for t in range(66, 70):
        y, cache = layer(x[:, t:t + 1], cache=cache, return_cache=True)
        pieces.append(y)
    assert relative_error(jnp.concatenate(pieces, axis=1), full) <= 1e-5
    assert cache.state.dtype == jnp.float32 and cache.state.shape == (2, 2, 16, 16)


@pytest.mark.slow
def test_packed_documents_do_not_see_each_other():
    layer = _layer("k3")
    x = _tokens(1, 50)
    segment_ids = jnp.where(jnp.arange(50) < 20, 4, 9)[None]
    packed = layer(x, segment_ids=segment_ids)
    separate = jnp.concatenate([layer(x[:, :20]), layer(x[:, 20:])], axis=1)
    assert relative_error(packed, separate) <= 1e-5


def test_conv_returns_its_receptive_field_for_the_next_call():
    x = _tokens(1, 2, d_model=3)
    weight = jnp.arange(12.0).reshape(4, 3)
    prefix = jnp.ones((1, 3, 3))
    y, tail = causal_depthwise_conv(x, weight, prefix)
    assert jnp.array_equal(tail, jnp.concatenate([prefix[:, 2:], x], axis=1))
    expected_last = weight[0] + weight[1] + weight[2] * x[0, 0] + weight[3] * x[0, 1]
    assert jnp.allclose(y[0, 1], expected_last)


def test_conv_weight_gradient_in_bfloat16_is_summed_in_float32():
    """The weight's gradient sums over every token; from bf16 inputs and cotangents it must match
    a float64 sum of the same bf16 numbers (bf16 accumulation was about 1% off at 8192 tokens)."""
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (2, 4096, 16)).astype(jnp.bfloat16)
    weight = jax.random.uniform(keys[1], (4, 16), minval=-0.5, maxval=0.5)
    cotangent = jax.random.normal(keys[2], (2, 4096, 16)).astype(jnp.bfloat16)
    segment_ids = jnp.repeat(jnp.array([[1, 2]]), 2048, axis=1).repeat(2, axis=0)

    def weight_gradient(dtype, weight_dtype):
        conv = lambda w: causal_depthwise_conv(x.astype(dtype), w, jnp.zeros((2, 3, 16), dtype),
                                               segment_ids)[0]
        _, pullback = jax.vjp(conv, weight.astype(weight_dtype))
        return pullback(cotangent.astype(dtype))[0]

    with jax.enable_x64(True):
        exact = weight_gradient(jnp.float64, jnp.float64)
    got = weight_gradient(jnp.bfloat16, jnp.float32)  # as in training: float32 weights
    assert relative_error(got, exact) < 1e-6


@pytest.mark.slow
def test_gradients_reach_every_parameter_in_bfloat16():
    layer = KDA(24, CONFIGS["k3"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = _tokens(1, 40)

    def loss(model):
        return jnp.mean(jnp.square(model(x).astype(jnp.float32)))

    grads = nnx.jit(nnx.grad(loss))(layer)  # eagerly, every operation of the VJP compiles alone
    for path, g in jax.tree.leaves_with_path(nnx.state(grads, nnx.Param)):
        assert bool(jnp.isfinite(g).all()), path
        assert float(jnp.abs(g).max()) > 0, path


@pytest.mark.parametrize("changes,message", [
    (dict(num_value_heads=3), r"KDAConfig.num_value_heads \(3\) must be a multiple of num_heads"),
    (dict(gate="relu"), r"KDAConfig.gate must be one of"),
    (dict(gate_lower_bound=-8.0), r"KDAConfig.gate_lower_bound must lie in \[-5.0, 0\)"),
    (dict(head_dim=0), r"KDAConfig.head_dim must be >= 1"),
    (dict(conv_kernels="yes"), r"KDAConfig.conv_kernels must be a bool"),
    (dict(segment_tokens=100), r"KDAConfig.segment_tokens must be None or a positive multiple"),
])
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        KDAConfig(**{"num_heads": 2, "head_dim": 16, **changes})


@pytest.mark.parametrize("conv_kernels,expected", [(False, False), (True, None)])
def test_conv_kernels_field_chooses_the_short_conv_path(monkeypatch, conv_kernels, expected):
    """A first call asks `conv_silu_parts` for the kernels where they run only when the config
    says so (None: where they run; False: XLA); a continuation keeps the cache's path."""
    from kda import layer as kda_layer  # noqa: PLC0415 (patched below)
    asked = []
    original = kda_layer.conv_silu_parts

    def recording(*args, kernels=None):
        asked.append(kernels)
        return original(*args, kernels=False)

    monkeypatch.setattr(kda_layer, "conv_silu_parts", recording)
    cfg = KDAConfig(num_heads=2, head_dim=16, conv_kernels=conv_kernels)
    layer = KDA(24, cfg, rngs=nnx.Rngs(0))
    _, cache = layer(_tokens(1, 8), return_cache=True)
    assert asked == []  # returning the cache: the XLA path, which also gives the conv's tail
    layer(_tokens(1, 8))
    assert asked == [expected]


@pytest.mark.slow
def test_segment_tokens_runs_long_calls_in_segments_with_the_same_result(monkeypatch):
    """The layer over 256 tokens in segments of 64 equals the whole call (outputs, gradients),
    and really takes the segmented path."""
    whole = _layer("k3")
    segmented = KDA(24, dataclasses.replace(CONFIGS["k3"], segment_tokens=64), rngs=nnx.Rngs(0))
    x = _tokens(2, 256)
    segment_ids = jnp.repeat(jnp.array([[1, 2, 2, 3]]), 64, axis=1).repeat(2, axis=0)
    calls = []
    monkeypatch.setattr(layer_module, "kda_attention_in_segments",
                        lambda *a, **kw: calls.append(kw["segment_tokens"])
                        or kda_attention_in_segments(*a, **kw))

    def loss(layer):
        return jnp.sum(jnp.sin(layer(x, segment_ids=segment_ids)))

    # One jit for both layers: their configs differ, so each traces (and compiles) its own.
    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    (expected, want), (actual, got) = (value_and_grad(layer) for layer in (whole, segmented))
    assert calls == [64]
    assert relative_error(actual, expected) <= 1e-5
    for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        assert relative_error(a[...], b[...]) <= 1e-4, path
