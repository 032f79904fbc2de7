"""SiTU-GLU, MoEConfig, parameter counts and the Stable LatentMoE / DenseFFN modules."""

import dataclasses
import importlib.resources

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core.norms import rms_norm
from models.config import released_k3_json
from moe.activations import GLUActivation, clamped_swiglu, situ_glu, swiglu
from moe.config import MoEConfig, count_moe_params
from moe.dispatch import dropless_moe
from moe.experts import (
    DenseFFN,
    RouterBias,
    StableLatentMoE,
    moe_layers,
    update_router_biases,
)
from moe.routing import quantile_balance, route, router_scores

K3_JSON = importlib.resources.files("models").joinpath("configs", "k3.json")
D_MODEL = 16
SMALL = MoEConfig(
    num_experts=8,
    top_k=2,
    expert_hidden=12,
    latent_dim=8,
    shared_hidden=24,
    latent_norm=True,
    gmm_backend="xla",
)


def make_layer(cfg=SMALL, seed=0):
    return StableLatentMoE(D_MODEL, cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))


# The layer's forward pass as one jitted program (eager, each op would compile on its own).
apply = nnx.jit(lambda layer, *args: layer(*args))


def inputs(seed=1, batch=2, length=8):
    return jax.random.normal(jax.random.key(seed), (batch, length, D_MODEL))


# --- activations ------------------------------------------------------------------------------


def test_situ_glu_is_bounded_by_beta_product_with_gradient_everywhere():
    big = jnp.array([-1e6, -50.0, -5.0, 0.0, 5.0, 50.0, 1e6])
    gate, up = jnp.meshgrid(big, big)
    out = situ_glu(gate, up)
    assert float(jnp.max(jnp.abs(out))) <= 100.0
    assert float(jnp.max(jnp.abs(out))) > 99.0  # reached, not just bounded
    grad = jax.grad(lambda g: jnp.sum(situ_glu(g, jnp.full_like(g, 3.0))))(jnp.array([8.0, 20.0]))
    assert np.all(np.asarray(grad) != 0.0)  # soft caps, unlike a hard clamp
    assert situ_glu(jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.bfloat16)).dtype == jnp.float32


def test_situ_glu_matches_swiglu_near_zero():
    key_g, key_u = jax.random.split(jax.random.key(0))
    gate = 0.05 * jax.random.normal(key_g, (1000,))
    up = 0.05 * jax.random.normal(key_u, (1000,))
    np.testing.assert_allclose(situ_glu(gate, up), swiglu(gate, up), rtol=1e-3, atol=1e-7)
    # and further out the softcaps bend it away from SwiGLU
    assert abs(float(situ_glu(jnp.array(6.0), jnp.array(30.0)) - swiglu(6.0, 30.0))) > 10.0


def test_clamped_swiglu_and_activation_selection():
    clamped = clamped_swiglu(jnp.array(100.0), jnp.array(-100.0), 7.0)
    np.testing.assert_allclose(clamped, -7.0 * 7.0 * jax.nn.sigmoid(7.0), rtol=1e-6)
    gate, up = jnp.array([0.3, -1.0]), jnp.array([2.0, 0.5])
    np.testing.assert_allclose(GLUActivation("swiglu")(gate, up), swiglu(gate, up))
    np.testing.assert_allclose(
        GLUActivation("situ", 2.0, 3.0)(gate, up), situ_glu(gate, up, 2.0, 3.0)
    )
    with pytest.raises(ValueError, match="activation must be one of"):
        GLUActivation("gelu")
    with pytest.raises(ValueError, match="same shape"):
        GLUActivation()(gate, up[:1])


# --- config and parameter counts --------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_k", 9, "MoEConfig.top_k"),
        ("top_k", 0, "MoEConfig.top_k"),
        ("num_experts", 0, "MoEConfig.num_experts"),
        ("latent_norm", True, "MoEConfig.latent_norm"),
        ("activation", "relu", "MoEConfig.activation"),
        ("balancing", "sinkhorn", "MoEConfig.balancing"),
        ("capacity_factor", 0.0, "MoEConfig.capacity_factor"),
        ("qb_estimator", "median", "MoEConfig.qb_estimator"),
        ("dynamic_k_max", 1, "MoEConfig.dynamic_k_max"),
        ("gmm_backend", "triton", "MoEConfig.gmm_backend"),
        ("token_chunk", 0, "MoEConfig.token_chunk"),
        ("token_chunk", True, "MoEConfig.token_chunk"),
    ],
)
def test_config_validation_names_the_field(field, value, message):
    base = dict(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, field: value})


def test_config_rejects_k_equal_to_e_for_qb_only():
    with pytest.raises(ValueError, match="top_k < num_experts for quantile balancing"):
        MoEConfig(num_experts=4, top_k=4)
    assert MoEConfig(num_experts=4, top_k=4, balancing="none").top_k == 4


def test_k3_config_and_its_parameter_counts():
    """The reference's numbers: 29.78B parameters and ~0.72B active per MoE layer."""
    cfg = MoEConfig.from_hf_config(released_k3_json()["text_config"])
    assert MoEConfig.from_json(K3_JSON) == cfg
    assert (cfg.num_experts, cfg.top_k, cfg.latent_dim, cfg.expert_hidden) == (896, 16, 3584, 3072)
    assert (cfg.shared_hidden, cfg.situ_beta, cfg.situ_linear_beta) == (6144, 4.0, 25.0)
    assert cfg.latent_norm and cfg.activation == "situ" and cfg.routed_scaling_factor == 1.0
    counts = count_moe_params(7168, cfg)
    assert counts["routed_experts"] == 896 * 3 * 3584 * 3072
    assert counts["total"] / 1e9 == pytest.approx(29.78, abs=0.01)
    assert counts["active"] / 1e9 == pytest.approx(0.72, abs=0.005)
    assert counts["routed_experts"] / counts["total"] > 0.99


@pytest.mark.parametrize(
    "cfg",
    [SMALL, dataclasses.replace(SMALL, latent_dim=None, latent_norm=False, shared_hidden=0)],
    ids=["latent", "plain"],
)
def test_count_moe_params_matches_the_module(cfg):
    layer = make_layer(cfg)
    params = nnx.state(layer, nnx.Param)
    assert sum(p.size for p in jax.tree.leaves(params)) == count_moe_params(D_MODEL, cfg)["total"]


# --- the layer --------------------------------------------------------------------------------


def test_layer_equals_its_formula():
    """y = W_up · RMSNorm(sum_j p_j E_j(W_down x)) + Shared(x), routing with the layer's bias."""
    layer = make_layer()
    layer.router_bias[...] = jnp.linspace(-0.1, 0.1, 8)
    x = inputs()
    y, stats = apply(layer, x)
    tokens = x.reshape(-1, D_MODEL)
    scores = router_scores(tokens, layer.router[...])
    ids, weights = route(scores, layer.router_bias[...], SMALL.top_k)
    routed = dropless_moe(
        tokens @ layer.w_down[...],
        ids,
        weights,
        layer.expert_w_in[...],
        layer.expert_w_out[...],
        GLUActivation(),
    )
    expected = rms_norm(routed, layer.latent_gain[...], 1e-5) @ layer.w_up[...]
    expected = expected + layer.shared(tokens)
    np.testing.assert_allclose(y.reshape(-1, D_MODEL), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stats.expert_ids.reshape(-1, 2), ids)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert stats.scores.shape == (2, 8, 8) and stats.load.shape == (8,)
    assert float(stats.load.sum()) == 2 * 8 * 2


def test_bias_is_not_a_param_and_gets_no_update_from_the_optimizer():
    layer = make_layer()
    assert isinstance(layer.router_bias, RouterBias)
    assert not isinstance(layer.router_bias, nnx.Param)
    layer.router_bias[...] = jnp.linspace(-0.2, 0.2, 8)
    x = inputs()

    def loss(model):
        y, stats = model(x)
        return jnp.mean(y**2) + stats.aux_loss

    grads = nnx.jit(nnx.grad(loss))(layer)
    assert "router_bias" not in grads
    assert float(jnp.max(jnp.abs(grads["router"][...]))) > 0
    optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
    router_before = layer.router[...]
    optimizer.update(layer, grads)
    np.testing.assert_array_equal(layer.router_bias[...], jnp.linspace(-0.2, 0.2, 8))
    assert not np.array_equal(layer.router[...], router_before)


def test_stats_route_with_the_old_bias_and_the_update_uses_them():
    layer = make_layer()
    x = inputs(length=32)
    old_bias = layer.router_bias[...]
    _, stats = apply(layer, x)
    np.testing.assert_array_equal(
        stats.expert_ids.reshape(-1, 2), route(stats.scores.reshape(-1, 8), old_bias, 2)[0]
    )
    update_router_biases([layer], [stats])
    np.testing.assert_allclose(
        layer.router_bias[...], quantile_balance(stats.scores, old_bias, 2), atol=1e-7
    )
    with pytest.raises(ValueError, match="RouterStats for 1 MoE layers"):
        update_router_biases([layer], [stats, stats])


def test_update_of_a_stacked_layer_updates_each_slice_on_its_own():
    """A layer stacked by nnx.vmap (bias [L, E], stats [L, ...]) next to a plain one ([E])."""
    plain = make_layer()
    keys = jax.random.split(jax.random.key(3), 2)
    stacked = nnx.vmap(lambda key: make_layer(seed=key), in_axes=0)(keys)
    assert stacked.router_bias[...].shape == (2, 8)
    x = inputs(length=32)
    _, plain_stats = apply(plain, x)
    _, stacked_stats = nnx.jit(nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None)))(stacked, x)
    old_slices = [stacked.router_bias[...][i] for i in range(2)]
    update_router_biases([plain, stacked], [plain_stats, stacked_stats])
    np.testing.assert_allclose(
        plain.router_bias[...], quantile_balance(plain_stats.scores, jnp.zeros(8), 2), atol=1e-7
    )
    for i, old in enumerate(old_slices):
        np.testing.assert_allclose(
            stacked.router_bias[...][i],
            quantile_balance(stacked_stats.scores[i], old, 2),
            atol=1e-7,
        )
    assert not np.allclose(stacked.router_bias[...][0], stacked.router_bias[...][1])


def test_padding_tokens_get_no_routed_output_and_no_load():
    cfg = dataclasses.replace(SMALL, shared_hidden=0)
    layer = make_layer(cfg)
    x = inputs()
    segment_ids = jnp.array([[1] * 5 + [0] * 3, [1] * 8])
    y, stats = apply(layer, x, segment_ids)
    np.testing.assert_allclose(y[0, 5:], 0.0, atol=1e-6)
    assert float(stats.load.sum()) == (5 + 8) * 2
    assert not bool(stats.copy_mask[0, 6].any())
    # real tokens do not see the padding
    y_changed, _ = apply(layer, x.at[0, 5:].set(100.0), segment_ids)
    np.testing.assert_allclose(y_changed[0, :5], y[0, :5], rtol=1e-6)


def test_aux_loss_only_under_aux_loss_balancing():
    x = inputs()
    assert float(make_layer()(x)[1].aux_loss) == 0.0
    layer = make_layer(dataclasses.replace(SMALL, balancing="aux_loss", aux_loss_weight=0.1))
    _, stats = apply(layer, x)
    assert 0.1 * 0.5 < float(stats.aux_loss) < 0.1 * 8
    grads = nnx.jit(nnx.grad(lambda m: m(x)[1].aux_loss))(layer)
    assert float(jnp.max(jnp.abs(grads["router"][...]))) > 0


def test_dynamic_k_layer_fires_a_variable_number_of_experts():
    cfg = dataclasses.replace(SMALL, dynamic_k=True, dynamic_k_max=5)
    layer = make_layer(cfg)
    assert float(layer.router_bias[...][0]) < 0  # minus a positive firing threshold
    _, stats = apply(layer, inputs(length=64))
    fired = np.asarray(stats.copy_mask.sum(-1))
    assert stats.expert_ids.shape[-1] == 5 and fired.min() < fired.max()
    update_router_biases([layer], [stats])
    assert np.all(np.isfinite(np.asarray(layer.router_bias[...])))


def test_expert_parallel_layer_under_a_mesh_equals_single_device():
    layer = make_layer()
    x = inputs(length=16)
    y_single, _ = apply(layer, x)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        y_parallel, stats = apply(layer, x)
    np.testing.assert_allclose(y_parallel, y_single, rtol=1e-5, atol=1e-5)
    assert float(stats.dropped) == 0.0


def test_plain_moe_equals_its_formula_and_annotations():
    """y = sum_{j in top-k(s + b)} p_j E_j(x) + Shared(x), experts reading x at full width."""
    cfg = dataclasses.replace(SMALL, latent_dim=None, latent_norm=False)
    layer = make_layer(cfg)
    layer.router_bias[...] = jnp.linspace(-0.1, 0.1, 8)
    x = inputs()
    y, stats = apply(layer, x)
    tokens = np.asarray(x, np.float64).reshape(-1, D_MODEL)
    scores = 1 / (1 + np.exp(-tokens @ np.asarray(layer.router[...], np.float64)))
    ids = np.argsort(-(scores + np.asarray(layer.router_bias[...])), axis=1)[:, : cfg.top_k]
    selected = np.take_along_axis(scores, ids, axis=1)
    weights = selected / selected.sum(axis=1, keepdims=True)

    def glu_mlp(z, w_in, w_out):  # z [..., W], w_in [W, 2, H], w_out [H, W]
        return np.asarray(situ_glu(z @ w_in[:, 0], z @ w_in[:, 1]), np.float64) @ w_out

    w_in, w_out = (np.asarray(w[...], np.float64) for w in (layer.expert_w_in, layer.expert_w_out))
    expected = sum(
        weights[:, [slot]] * np.stack([glu_mlp(tokens[n], w_in[e], w_out[e])
                                       for n, e in enumerate(ids[:, slot])])
        for slot in range(cfg.top_k)
    )
    shared_w_in, shared_w_out = (np.asarray(w[...], np.float64)
                                 for w in (layer.shared.w_in, layer.shared.w_out))
    expected = expected + glu_mlp(tokens, shared_w_in, shared_w_out)
    np.testing.assert_array_equal(np.sort(stats.expert_ids.reshape(-1, 2), axis=1),
                                  np.sort(ids, axis=1))
    np.testing.assert_allclose(y.reshape(-1, D_MODEL), expected, rtol=1e-4, atol=1e-5)
    assert not hasattr(layer, "w_down") and not hasattr(layer, "latent_gain")
    axes = {
        path: var.get_metadata()["out_sharding"]
        for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param))
    }
    assert axes[("expert_w_in",)] == ("expert", "embed", None, "mlp")
    assert axes[("router",)] == ("embed", None)
    assert axes[("shared", "w_out")] == ("mlp", "embed")
    assert make_layer().expert_w_out.get_metadata()["out_sharding"] == ("expert", "mlp", "latent")


def test_layer_rejects_bad_inputs():
    layer = make_layer()
    with pytest.raises(ValueError, match="x must be"):
        layer(jnp.ones((2, 8, D_MODEL + 1)))
    with pytest.raises(ValueError, match="segment_ids must be"):
        layer(inputs(), jnp.ones((2, 7), jnp.int32))
    with pytest.raises(ValueError, match="d_model must be"):
        StableLatentMoE(0, SMALL, rngs=nnx.Rngs(0))


def test_moe_layers_finds_nested_layers():
    class Stack(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([make_layer(seed=i) for i in range(3)])
            self.dense = DenseFFN(D_MODEL, 32, rngs=nnx.Rngs(0))

    stack = Stack()
    assert [id(layer) for layer in moe_layers(stack)] == [id(b) for b in stack.blocks]


def test_dense_ffn():
    ffn = DenseFFN(D_MODEL, 32, "situ", dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = inputs()
    w_in, w_out = ffn.w_in[...], ffn.w_out[...]
    expected = situ_glu(x @ w_in[:, 0], x @ w_in[:, 1]) @ w_out
    np.testing.assert_allclose(ffn(x), expected, rtol=1e-5, atol=1e-5)
    assert DenseFFN(D_MODEL, 32, rngs=nnx.Rngs(0))(x).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="x must be"):
        ffn(jnp.ones((2, D_MODEL + 1)))
