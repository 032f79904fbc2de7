"""train.step on a small model: the update, the QB router-bias update, skipping of non-finite
steps, evaluation, Muon, QK-Clip, and which gradients enter the update in bfloat16."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import pallas as pl

from moe.config import MoEConfig
from moe.routing import updated_bias
from tests.train.toy_model import BATCH, LENGTH, make_batch, split_state
from train import qk_clip
from train.optim import OptimConfig
from train.step import (FAST_COMPILE_OPTIONS, cross_entropy, gradient_dtypes, make_eval_step,
                        make_train_step)


@pytest.fixture(scope="module")
def adamw():
    graphdef, state = split_state()
    return graphdef, state, make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)


def fresh(state):
    """A copy of `state` (the step donates its input)."""
    return jax.tree.map(jnp.copy, state)


def params_of(graphdef, state):
    return nnx.state(nnx.merge(graphdef, state).model, nnx.Param)


def test_step_updates_parameters_and_balances_the_router(adamw):
    graphdef, initial, step = adamw
    batch = make_batch()

    @jax.jit
    def balanced_bias(state):
        model = nnx.merge(graphdef, state).model
        _, (stats,) = model.forward(batch["tokens"], batch["segment_ids"])
        return updated_bias(model.moe.cfg, model.moe.router_bias[...], stats)

    expected_bias = balanced_bias(initial)

    state, metrics = step(fresh(initial), batch)
    after = nnx.merge(graphdef, state)
    assert float(metrics["skipped"]) == 0.0 and int(metrics["skipped_steps"]) == 0
    assert float(metrics["targets"]) == float(batch["loss_mask"].sum())
    assert metrics["max_vio"].shape == (1,)
    np.testing.assert_allclose(after.model.moe.router_bias[...], expected_bias, atol=1e-6)
    assert np.abs(expected_bias).max() > 0  # QB moved the bias
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                           params_of(graphdef, initial), nnx.state(after.model, nnx.Param))
    assert all(jax.tree.leaves(changed))
    assert int(after.optimizer.step[...]) == 1


@pytest.mark.slow
def test_expert_weights_are_read_from_compute_copies_the_update_writes(monkeypatch):
    """With a bf16 MoE, the state keeps its expert weights rounded to bf16; each update rewrites
    them from the new float32 weights, and the forward reads them: two steps give, bit for bit,
    the state of two steps that cast the float32 weights in the forward instead."""
    from train import step as step_module

    def state_and_step():
        graphdef, state = split_state(moe_dtype=jnp.bfloat16)
        return graphdef, state, make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)

    def two_steps(graphdef, state, step):
        for seed in (0, 1):
            state, metrics = step(state, make_batch(seed))
            assert float(metrics["skipped"]) == 0.0
        return nnx.merge(graphdef, state)

    graphdef, initial, step = state_and_step()
    zeroed = nnx.merge(graphdef, fresh(initial))
    for copy in zeroed.compute_copies.values():
        copy[...] = jnp.zeros_like(copy[...])
    _, zeroed_metrics = step(nnx.state(zeroed), make_batch())
    _, metrics = step(fresh(initial), make_batch())
    assert float(zeroed_metrics["loss"]) != float(metrics["loss"])  # the forward reads copies

    with_copies = two_steps(graphdef, initial, step)
    moe = with_copies.model.moe
    assert sorted(with_copies.compute_copies) == ["moe.expert_w_in", "moe.expert_w_out"]
    for key, param in (("moe.expert_w_in", moe.expert_w_in),
                       ("moe.expert_w_out", moe.expert_w_out)):
        copy = with_copies.compute_copies[key][...]
        assert copy.dtype == jnp.bfloat16
        np.testing.assert_array_equal(copy, param[...].astype(jnp.bfloat16))

    monkeypatch.setattr(step_module, "_kernel_weights", lambda model: iter(()))
    cast_in_forward = two_steps(*state_and_step())
    assert len(cast_in_forward.compute_copies) == 0
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(with_copies.model)),
                                      nnx.to_flat_state(nnx.state(cast_in_forward.model))):
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]),
                                      err_msg=str(path))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_compute_copies_cover_every_moe_layer_of_the_hybrid(scan_layers):
    """A bf16 HybridLM's TrainState holds one copy of each MoE layer's two expert weights (of a
    scanned group: the stacked weights), keyed by the parameter's state path, of its shape."""
    from models.config import preset
    from models.lm import HybridLM
    from train.optim import make_optimizer
    from train.step import TrainState, state_path_key

    cfg = preset("tiny", dtype="bfloat16", scan_layers=scan_layers)

    def build():
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        return TrainState(model, make_optimizer(OptimConfig(warmup_steps=0),
                                                nnx.state(model, nnx.Param), 100))

    train_state = nnx.eval_shape(build)
    params = {state_path_key(path): param
              for path, param in nnx.to_flat_state(nnx.state(train_state.model, nnx.Param))}
    copies = dict(train_state.compute_copies.items())
    expert_weights = [key for key in params if key.endswith(("expert_w_in", "expert_w_out"))]
    assert sorted(copies) == sorted(expert_weights) and len(copies) >= 4
    for key, copy in copies.items():
        assert copy.shape == params[key].shape and copy.dtype == jnp.bfloat16


def test_non_finite_step_is_skipped_and_counted(adamw):
    graphdef, initial, step = adamw
    poisoned = dict(make_batch(), loss_mask=make_batch()["loss_mask"].at[0, 3].set(jnp.nan))
    before = fresh(initial)
    state, metrics = step(fresh(initial), poisoned)
    assert float(metrics["skipped"]) == 1.0 and int(metrics["skipped_steps"]) == 1
    assert not np.isfinite(float(metrics["loss"]))
    kept = nnx.merge(graphdef, state)
    # Nothing moved: parameters, router biases, optimizer moments and step.
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(state)):
        if path[-1] != "skipped_steps":
            np.testing.assert_array_equal(np.asarray(old[...]), np.asarray(new[...]),
                                          err_msg=str(path))
    assert int(kept.optimizer.step[...]) == 0
    # The next finite step trains normally and the count stays.
    state, metrics = step(state, make_batch())
    assert float(metrics["skipped"]) == 0.0 and int(metrics["skipped_steps"]) == 1
    assert int(nnx.merge(graphdef, state).optimizer.step[...]) == 1


def test_loss_falls_on_a_repeated_batch_and_eval_agrees(adamw):
    graphdef, initial, step = adamw
    batch = make_batch(1)
    evaluate = make_eval_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)
    state = fresh(initial)
    first = evaluate(state, batch)
    losses = []
    for _ in range(15):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    # The train step's loss is that of the state it started from.
    assert losses[0] == pytest.approx(float(first["nll"] / first["targets"]), rel=1e-5)
    assert losses[-1] < losses[0] - 1.0
    last = evaluate(state, batch)
    assert last["predictions"].shape == (BATCH, LENGTH)
    assert float(last["nll"] / last["targets"]) < losses[-1]


@pytest.mark.slow
def test_muon_step_is_finite_and_moves_the_matrices():
    graphdef, initial = split_state(OptimConfig(optimizer="muon", warmup_steps=0))
    step = make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)
    state, metrics = step(fresh(initial), make_batch())
    assert np.isfinite(float(metrics["loss"])) and float(metrics["skipped"]) == 0.0
    before = nnx.merge(graphdef, initial).model.attention.q_up.kernel[...]
    after = nnx.merge(graphdef, state).model.attention.q_up.kernel[...]
    assert float(jnp.abs(after - before).max()) > 0


@functools.partial(jax.jit, static_argnums=0)
def _head_max_logits(graphdef, state, batch):
    model = nnx.merge(graphdef, state).model
    _, captured = qk_clip.capture_forward(model, batch["tokens"], batch["segment_ids"])
    [(path, layer)] = qk_clip.mla_layers(model)
    return qk_clip.max_logits(layer.cfg, *captured[path], batch["segment_ids"])


@pytest.mark.slow
def test_qk_clip_caps_the_heads_above_tau():
    # A learning rate of ~0 isolates the clip: only heads over tau change.
    graphdef, initial = split_state(OptimConfig(learning_rate=1e-12, warmup_steps=0))
    batch = make_batch(2)
    before = np.asarray(_head_max_logits(graphdef, initial, batch))
    assert abs(before[0] - before[1]) > 1e-3
    tau = float(before.mean())  # one head above, one below
    step = make_train_step(graphdef, qk_clip_tau=tau, compiler_options=FAST_COMPILE_OPTIONS)
    state, metrics = step(fresh(initial), batch)
    np.testing.assert_allclose(metrics["qk_max_logit"][0], before, rtol=1e-5)
    after = np.asarray(_head_max_logits(graphdef, state, batch))
    np.testing.assert_allclose(after, np.minimum(before, tau), rtol=1e-4)


def test_max_logits_ignore_other_documents_and_padding():
    cfg = qk_clip.MLAConfig(num_heads=1, q_lora_rank=None, kv_lora_rank=2, qk_nope_head_dim=1,
                            qk_rope_head_dim=1, v_head_dim=1)
    q = jnp.ones((1, 3, 1, 2))
    keys_nope = jnp.array([1.0, 5.0, 2.0])[None, :, None, None]  # [1, 3, 1, 1]
    kv_up_out = jnp.concatenate([keys_nope, jnp.zeros((1, 3, 1, 1))], axis=-1)
    kv_down_out = jnp.zeros((1, 3, 3))  # rope keys 0
    scale = cfg.softmax_scale
    same_doc = qk_clip.max_logits(cfg, q, kv_up_out, kv_down_out, jnp.array([[1, 1, 1]]))
    assert float(same_doc[0]) == pytest.approx(5.0 * scale)
    # Token 1 in another document: it is only visible to itself, which still counts.
    split = qk_clip.max_logits(cfg, q, kv_up_out, kv_down_out, jnp.array([[1, 2, 1]]))
    assert float(split[0]) == pytest.approx(5.0 * scale)
    # As padding it is not a real token: the largest visible logit is then 2.
    padded = qk_clip.max_logits(cfg, q, kv_up_out, kv_down_out, jnp.array([[1, 0, 1]]))
    assert float(padded[0]) == pytest.approx(2.0 * scale)


@pytest.mark.slow
def test_sharded_step_matches_one_device(adamw):
    """Data and FSDP sharding over 4 of the 8 CPU devices compute the same step: the whole train
    state (parameters, the QB router bias, the optimizer's moments and count, the compute
    copies, the skip counter) and every metric."""
    from core.sharding import batch_sharding, make_mesh, state_shardings

    graphdef, initial, step = adamw
    batch = make_batch(3)
    reference, expected = step(fresh(initial), batch)
    bias_before = nnx.merge(graphdef, initial).model.moe.router_bias[...]

    mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    shardings = state_shardings(initial, mesh)
    sharded_step = make_train_step(graphdef, state_shardings=shardings,
                                   compiler_options=FAST_COMPILE_OPTIONS)
    with jax.set_mesh(mesh):
        state = jax.device_put(fresh(initial), shardings)
        placed = jax.device_put(batch, batch_sharding(mesh, batch["tokens"].shape))
        state, metrics = sharded_step(state, placed)
    embedding = nnx.merge(graphdef, state).model.embed.embedding[...]
    assert embedding.sharding.spec[1] == "fsdp"  # ("vocab", "embed") -> embed over fsdp
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    assert sorted(metrics) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(np.asarray(metrics[name]), np.asarray(expected[name]),
                                   rtol=2e-4, atol=2e-6, err_msg=f"metric {name}")
    sharded_leaves, sharded_tree = jax.tree_util.tree_flatten_with_path(state)
    reference_leaves, reference_tree = jax.tree_util.tree_flatten_with_path(reference)
    assert sharded_tree == reference_tree
    for (path, a), (_, b) in zip(sharded_leaves, reference_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    bias_after = nnx.merge(graphdef, state).model.moe.router_bias[...]
    assert np.abs(np.asarray(bias_after - bias_before)).max() > 0  # the sharded step moved it


def kernel_copy(x):
    """x through a Pallas kernel (interpreted: runs on any backend)."""
    def body(x_ref, out_ref):
        out_ref[...] = x_ref[...]

    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=True)(x)


@jax.custom_vjp
def matmul_with_kernel_weight_gradient(x, w):
    return x @ w


def _forward(x, w):
    return x @ w, (x, w)


def _backward(residuals, cotangent):
    x, w = residuals
    return cotangent @ w.T, kernel_copy(x.T @ cotangent).reshape(w.shape)


matmul_with_kernel_weight_gradient.defvjp(_forward, _backward)


def test_only_gradients_a_kernel_wrote_narrow_are_narrowed():
    bf16 = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"kernel": jax.random.normal(keys[0], (8, 4)),
              "xla": jax.random.normal(keys[1], (8, 4)),
              "twice": jax.random.normal(keys[2], (8, 4))}
    x = jax.random.normal(keys[3], (5, 8)).astype(bf16)

    def loss(params):
        y = matmul_with_kernel_weight_gradient(x, params["kernel"].astype(bf16))
        y = y + x @ params["xla"].astype(bf16)  # an XLA dot writes this one's gradient
        twice = params["twice"].astype(bf16)
        y = y + matmul_with_kernel_weight_gradient(x, twice) * matmul_with_kernel_weight_gradient(
            x, twice)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    dtypes = gradient_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, params)
    assert dtypes == {"kernel": bf16, "xla": jnp.float32, "twice": jnp.float32}
    grads = jax.grad(loss)(params)
    np.testing.assert_array_equal(grads["kernel"].astype(bf16).astype(jnp.float32),
                                  grads["kernel"])  # the narrow dtype holds it exactly


# An MoE whose widths fit the Hopper grouped-GEMM kernels' tiles.
KERNEL_SIZED_MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=128, latent_dim=128,
                             latent_norm=True, shared_hidden=128)


@pytest.fixture
def hopper_grouped_matmuls(monkeypatch):
    """The grouped GEMMs take the Mosaic GPU kernels (traced under `simulated_hopper`)."""
    from moe import grouped_matmul

    monkeypatch.setattr(grouped_matmul, "_on_hopper", lambda: True)


@pytest.mark.parametrize("remat", [None, "dots_kernels"])
def test_moe_expert_weight_gradients_from_the_hopper_kernels_are_narrowed(hopper_grouped_matmuls,
                                                                         remat):
    """Traced (not run) on a simulated Hopper, where the grouped GEMMs are Mosaic GPU kernels:
    their weight gradients are the bfloat16 kernel outputs; XLA's are not narrowed. Under a remat
    policy (as the trainer runs each layer) the gradients come out of a checkpoint's body."""
    from models.lm import REMAT
    from moe.experts import StableLatentMoE
    from moe.kernels.mosaic_gpu.simulation import simulated_hopper

    layer = StableLatentMoE(256, KERNEL_SIZED_MOE, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jnp.ones((2, 64, 256), jnp.bfloat16)

    def moe_output(params, x):
        return nnx.merge(graph, params, rest)(x)[0]

    if remat is not None:
        moe_output = jax.checkpoint(moe_output, policy=REMAT[remat])

    def loss(params):
        return jnp.sum(moe_output(params, x).astype(jnp.float32))

    with simulated_hopper():
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    dtypes = nnx.to_pure_dict(gradient_dtypes(jaxpr, params))
    narrowed = {name for name, dtype in dtypes.items() if dtype == jnp.bfloat16}
    assert narrowed == {"expert_w_in", "expert_w_out"}, dtypes


@pytest.mark.slow
def test_the_hybrid_step_passes_expert_gradients_to_the_update_in_bf16(hopper_grouped_matmuls):
    """The whole step of a HybridLM with the MoE kernels (simulated Hopper) and the trainer's
    remat policy, traced (not run): the expert weights' gradients, two per MoE layer, enter the
    update's cond in bfloat16. (A check of one layer alone missed that the layers' checkpoints
    hid the kernels from the analysis.)"""
    from models.config import preset
    from models.lm import HybridLM
    from moe.kernels.mosaic_gpu.simulation import simulated_hopper
    from train.optim import make_optimizer
    from train.step import TrainState

    cfg = preset("tiny", dtype="bfloat16", remat="dots_kernels", d_model=256,
                 moe=KERNEL_SIZED_MOE)

    def build():
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        return TrainState(model, make_optimizer(OptimConfig(warmup_steps=0),
                                                nnx.state(model, nnx.Param), 100))

    graphdef, state = nnx.split(nnx.eval_shape(build))
    with simulated_hopper():
        traced = make_train_step(graphdef).trace(state, make_batch())
    [update] = [eqn for eqn in traced.jaxpr.eqns if eqn.primitive.name == "cond"]
    state_inputs = set(traced.jaxpr.invars)  # the expert weights' compute copies among them
    narrow = sorted(str(var.aval) for var in update.invars
                    if var.aval.dtype == jnp.bfloat16 and var not in state_inputs)
    moe_layers = cfg.num_layers - cfg.first_k_dense
    assert narrow == ["bfloat16[4,128,128]"] * moe_layers + ["bfloat16[4,128,2,128]"] * moe_layers


class KernelHeadLM(nnx.Module):
    """Embedding and an LM head whose weight gradient a (interpreted) Pallas kernel writes in
    bfloat16, with the trainer's interface (no MoE layer)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (264, 16)))
        self.head = nnx.Param(jax.random.normal(rngs.params(), (16, 264)) * 0.25)

    def forward(self, tokens, segment_ids=None):
        hidden = jnp.tanh(self.embed[...][tokens]).astype(jnp.bfloat16).reshape(-1, 16)
        logits = matmul_with_kernel_weight_gradient(hidden, self.head[...].astype(jnp.bfloat16))
        return logits.astype(jnp.float32).reshape(*tokens.shape, -1), ()

    def moe_sites(self):
        return []


def test_a_step_with_narrowed_gradients_equals_one_without(monkeypatch):
    """The head's gradient enters the update in bfloat16, exactly: the new state is bit for bit
    the one of a step that keeps every gradient in float32."""
    from train import step as step_module
    from train.optim import make_optimizer
    from train.step import TrainState

    def build():
        model = KernelHeadLM(nnx.Rngs(0))
        return TrainState(model, make_optimizer(OptimConfig(warmup_steps=0),
                                                nnx.state(model, nnx.Param), 100))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    initial = jax.jit(lambda: nnx.state(build()))()
    graph, params, rest = nnx.split(nnx.merge(graphdef, initial).model, nnx.Param, ...)
    batch = make_batch()

    def head_loss(params):
        return jnp.sum(nnx.merge(graph, params, rest).forward(batch["tokens"])[0])

    head_jaxpr = jax.make_jaxpr(jax.grad(head_loss))(params).jaxpr
    assert nnx.to_pure_dict(gradient_dtypes(head_jaxpr, params)) == {
        "embed": jnp.float32, "head": jnp.bfloat16}

    def step_and_update_operands():
        step = make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)
        [update] = [eqn for eqn in step.trace(fresh(initial), batch).jaxpr.eqns
                    if eqn.primitive.name == "cond"]
        return step(fresh(initial), batch), {str(var.aval) for var in update.invars}

    (narrowed, metrics), operands = step_and_update_operands()
    assert {"bfloat16[16,264]", "float32[16,264]"} <= operands  # the gradient, the head
    monkeypatch.setattr(step_module, "gradient_dtypes",
                        lambda jaxpr, params: jax.tree.map(lambda p: p.dtype, params))
    (kept, _), operands = step_and_update_operands()
    assert "bfloat16[16,264]" not in operands
    assert float(metrics["skipped"]) == 0.0
    for (path, new), (_, reference) in zip(nnx.to_flat_state(narrowed), nnx.to_flat_state(kept)):
        np.testing.assert_array_equal(np.asarray(new[...]), np.asarray(reference[...]),
                                      err_msg=str(path))


def _primitives(jaxpr) -> list[str]:
    """Every primitive of a jaxpr, nested calls' included."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += _primitives(sub)
    return names


def test_cross_entropy_equals_optax_and_its_backward_is_one_dense_pass():
    """Values equal optax's; gradients agree to float32 rounding (the target's term is
    subtracted before the product with the cotangent, not after). The backward has no scatter,
    which would keep XLA from fusing a cast of the cotangent into the pass that writes it."""
    keys = jax.random.split(jax.random.key(0), 3)
    logits = 4 * jax.random.normal(keys[0], (2, 5, 300))
    targets = jax.random.randint(keys[1], (2, 5), 0, 300)
    weights = jax.random.normal(keys[2], (2, 5))
    ours = lambda x: jnp.sum(cross_entropy(x, targets) * weights)  # noqa: E731
    theirs = lambda x: jnp.sum(  # noqa: E731
        optax.softmax_cross_entropy_with_integer_labels(x, targets) * weights)
    np.testing.assert_array_equal(cross_entropy(logits, targets),
                                  optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(theirs)(logits), atol=1e-6)
    assert not [p for p in _primitives(jax.make_jaxpr(jax.grad(ours))(logits).jaxpr)
                if p.startswith("scatter")]
    assert [p for p in _primitives(jax.make_jaxpr(jax.grad(theirs))(logits).jaxpr)
            if p.startswith("scatter")]  # what it replaces
