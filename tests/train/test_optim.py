"""train.optim: schedules, parameter roles, Muon's matrix views (per head, stacked layers), and
that per-head Muon gives every head an update of its own scale."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.config import preset
from models.lm import HybridLM
from train.optim import (
    OptimConfig,
    clip_by_global_norm,
    learning_rate_schedule,
    make_optimizer,
    muon_dimension_numbers,
    param_role,
)
from train.step import stacked_axes


def _values(cfg, total):
    schedule = learning_rate_schedule(cfg, total)
    return np.array([float(schedule(step)) for step in range(total)])


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_schedules_warm_up_from_the_first_step(schedule):
    cfg = OptimConfig(schedule=schedule, learning_rate=1.0, warmup_steps=4, min_lr_ratio=0.1)
    values = _values(cfg, 20)
    np.testing.assert_allclose(values[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert values.max() == pytest.approx(1.0)
    expected_final = 1.0 if schedule == "constant" else 0.1
    assert values[-1] == pytest.approx(expected_final, rel=1e-5)


def test_wsd_is_constant_until_the_decay_then_linear():
    cfg = OptimConfig(schedule="wsd", learning_rate=2.0, warmup_steps=2, decay_fraction=0.25,
                      min_lr_ratio=0.0)
    values = _values(cfg, 20)
    np.testing.assert_allclose(values[2:15], 2.0)
    np.testing.assert_allclose(values[15:], [1.6, 1.2, 0.8, 0.4, 0.0], atol=1e-6)


def test_cosine_decreases_monotonically_after_warmup():
    values = _values(OptimConfig(schedule="cosine", warmup_steps=5), 50)
    assert np.all(np.diff(values[4:]) <= 1e-9)


@pytest.mark.parametrize(
    "field, value",
    [("optimizer", "sgd"), ("schedule", "linear"), ("learning_rate", 0.0), ("b2", 1.0),
     ("clip_norm", -1.0), ("decay_fraction", 1.5), ("qk_clip_tau", 0.0)],
)
def test_invalid_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OptimConfig(**{field: value})


def test_total_steps_must_be_positive():
    with pytest.raises(ValueError, match="total_steps"):
        learning_rate_schedule(OptimConfig(), 0)


@pytest.fixture(scope="module")
def tiny_params():
    model = nnx.eval_shape(lambda: HybridLM(preset("tiny"), rngs=nnx.Rngs(0)))
    return {
        tuple(str(p) for p in path): variable
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _names(variable):
    return tuple(variable.get_metadata()["out_sharding"])


def test_roles_of_the_tiny_hybrid(tiny_params):
    roles = {path: param_role(path[-1], _names(v)) for path, v in tiny_params.items()
             if v.get_metadata().get("out_sharding") is not None}
    assert roles[("embed", "embedding")] == "embedding"
    assert roles[("lm_head", "kernel")] == "embedding"
    assert roles[("final_norm", "scale")] == "vector"
    mla = ("groups", "3", "layers", "0", "mixer")
    assert roles[mla + ("q_up", "kernel")] == "matrix"
    kda = ("groups", "0", "layers", "0", "mixer")
    assert roles[kda + ("conv_weight",)] == "vector"  # depthwise taps, not a feature map
    assert roles[kda + ("qkv_proj", "kernel")] == "matrix"
    assert param_role("dt_bias", (None, None)) == "vector"


@pytest.mark.parametrize(
    "names, per_head, expected",
    [
        (("embed", "mlp"), True, ((0,), (1,))),
        (("mlp", "embed"), True, ((0,), (1,))),
        (("latent", "heads", "kv"), False, ((0,), (1, 2))),  # MLA q_up: all heads one matrix
        (("latent", "heads", "kv"), True, ((0,), (2,))),  # per head: heads is a batch axis
        (("heads", "kv", "embed"), False, ((0, 1), (2,))),  # MLA output projection
        (("heads", "kv", "embed"), True, ((1,), (2,))),
        (("heads", "embed"), True, ((0,), (1,))),  # KDA o_proj: no separate head axis
        (("expert", "latent", None, "mlp"), True, ((1,), (2, 3))),  # each expert alone
        (("expert", "mlp", "latent"), True, ((1,), (2,))),
    ],
)
def test_muon_matrix_views(names, per_head, expected):
    dims = muon_dimension_numbers(0, names, per_head)
    assert (tuple(dims.reduction_axis), tuple(dims.output_axis)) == expected


def test_scan_stacked_layers_are_a_batch_axis():
    cfg = preset("tiny", scan_layers=True)
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    stacked = stacked_axes(model)
    assert any(plan.repeats > 1 for plan in model.plan)
    group = next(str(i) for i, plan in enumerate(model.plan) if plan.repeats > 1)
    path = ("groups", group, "layers", "0", "ffn", "w_down")
    assert stacked(path) == 1 and stacked(("groups", "0", "layers", "0", "ffn", "w_in")) == 0
    dims = muon_dimension_numbers(1, ("embed", "latent"), True)
    assert (tuple(dims.reduction_axis), tuple(dims.output_axis)) == ((1,), (2,))
    # The whole optimizer builds and updates a scanned model.
    params = nnx.state(model, nnx.Param)
    make_optimizer(OptimConfig(optimizer="muon"), params, 10, stacked).init(params)


class Projection(nnx.Module):
    """One attention-style projection [C, H, K] with logical names."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.zeros((16, 2, 8)), out_sharding=("latent", "heads", "kv"),
                                 eager_sharding=False)


@pytest.mark.parametrize("per_head", [True, False])
def test_per_head_muon_gives_each_head_its_own_scale(per_head):
    module = Projection()
    params = nnx.state(module, nnx.Param)
    tx = make_optimizer(
        OptimConfig(optimizer="muon", muon_per_head=per_head, learning_rate=1.0, warmup_steps=0,
                    weight_decay=0.0, clip_norm=None, schedule="constant"),
        params, total_steps=10,
    )
    grad = jax.random.normal(jax.random.key(0), (16, 2, 8))
    grad = grad.at[:, 0].multiply(1000.0)  # head 0's gradient dwarfs head 1's
    grads = jax.tree.map(lambda _: grad, nnx.as_pure(params))
    updates, _ = tx.update(grads, tx.init(nnx.as_pure(params)), nnx.as_pure(params))
    update = np.asarray(jax.tree.leaves(updates)[0])
    head_norms = np.linalg.norm(update.reshape(16, 2, 8), axis=(0, 2))
    if per_head:
        # Each head is orthogonalised alone: both updates have the same (orthogonal) scale,
        # 0.2 * sqrt(max(16, 8)) * sqrt(8 singular values) up to Newton-Schulz's spread.
        np.testing.assert_allclose(head_norms[0], head_norms[1], rtol=0.2)
        singular = np.linalg.svd(update[:, 1], compute_uv=False)
        assert singular.min() > 0.4 * 0.2 * 4 and singular.max() < 1.5 * 0.2 * 4
    else:
        # One orthogonalisation for all heads: the small head gets a much smaller update.
        assert head_norms[1] < 0.25 * head_norms[0]


def test_adamw_updates_every_parameter_and_decays_only_matrices():
    class Small(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.ones((4, 4)), out_sharding=("embed", "mlp"),
                                    eager_sharding=False)
            self.scale = nnx.Param(jnp.ones((4,)), out_sharding=("embed",),
                                   eager_sharding=False)

    params = nnx.as_pure(nnx.state(Small(), nnx.Param))
    tx = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5,
                                    clip_norm=None, schedule="constant"),
                        nnx.state(Small(), nnx.Param), total_steps=10)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.1 * 0.5 * np.ones((4, 4)), rtol=1e-6)
    np.testing.assert_allclose(updates["scale"], 0.0)


def test_clipping_bounds_the_gradient_the_optimizer_sees():
    class Small(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.zeros((3, 3)), out_sharding=("embed", "mlp"),
                                    eager_sharding=False)

    state = nnx.state(Small(), nnx.Param)
    params = nnx.as_pure(state)
    cfg = OptimConfig(clip_norm=1.0, b1=0.0, warmup_steps=0, schedule="constant")
    tx = make_optimizer(cfg, state, total_steps=10)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 100.0), params)
    _, opt_state = tx.update(grads, tx.init(params), params)
    # The Adam second moment saw the clipped gradient (norm 1), not the raw one (norm 300).
    nu = [leaf for leaf in jax.tree.leaves(opt_state) if np.shape(leaf) == (3, 3)][-1]
    np.testing.assert_allclose(np.sqrt(np.asarray(nu) / (1 - cfg.b2)), 1.0 / 3.0, rtol=1e-4)
    assert isinstance(tx, optax.GradientTransformation)
    assert dataclasses.replace(cfg, clip_norm=None).clip_norm is None


def test_clipping_takes_the_callers_norm_and_computes_the_same_one_itself():
    grads = {"a": jnp.full((3, 3), 100.0), "b": jnp.arange(4.0)}
    clip = clip_by_global_norm(1.0)
    state = clip.init(grads)
    own, _ = clip.update(grads, state)
    given, _ = clip.update(grads, state, grad_norm=optax.tree.norm(grads))
    for x, y in zip(jax.tree.leaves(own), jax.tree.leaves(given)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(optax.tree.norm(own), 1.0, rtol=1e-6)
    reference, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    for x, y in zip(jax.tree.leaves(own), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(x, y)
    # The given norm is used, not recomputed: a norm of 4x the true one clips to a quarter.
    quartered, _ = clip.update(grads, state, grad_norm=4 * optax.tree.norm(grads))
    np.testing.assert_allclose(optax.tree.norm(quartered), 0.25, rtol=1e-6)
