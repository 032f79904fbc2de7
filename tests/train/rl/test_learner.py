"""The RL learner's step on the toy model: `train.step.make_train_step`'s per-token objective
(`token_loss`) against the masked mean NLL and against the policy loss computed by hand with
`jax.grad`; the router bias and the MoE auxiliary loss as in a normal step; the chunked head;
`make_token_logp` against log_softmax of the logits; and `Trainer.place` of an RL batch."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from core.sharding import make_mesh
from moe.routing import updated_bias
from tests.train.toy_model import BATCH, LENGTH, MOE, ToyLM, make_batch, split_state
from train.loop import Trainer
from train.rl.learner import make_rl_step
from train.rl.losses import RLLossConfig, policy_loss
from train.step import (FAST_COMPILE_OPTIONS, TrainState, make_token_logp, make_train_step,
                        masked_sum)

PROMPTS, GROUP = 2, BATCH  # two toy batches stacked: B = 4 rows, two groups of two
CHUNK = 5  # does not divide LENGTH: the last chunk is padded
GRPO = RLLossConfig("grpo")


def fresh(state):
    """A copy of `state` (the step donates its input)."""
    return jax.tree.map(jnp.copy, state)


def flat(state):
    return [(path, np.asarray(value[...])) for path, value in nnx.to_flat_state(state)]


def model_logp(model, batch):
    """log_softmax of the model's logits gathered at the targets: [B, T] float32."""
    logits, stats = model.forward(batch["tokens"], batch["segment_ids"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0], stats


@functools.cache
def sgd_setup(balancing: str):
    """(graphdef, state) of a ToyLM whose MoE balances with `balancing`, trained by plain SGD at
    learning rate 1, so one step's parameter change is minus the gradient."""
    moe = dataclasses.replace(MOE, balancing=balancing)

    def build():
        return TrainState(ToyLM(moe=moe, rngs=nnx.Rngs(0)), optax.sgd(1.0))

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return graphdef, jax.jit(lambda: nnx.state(build()), compiler_options=FAST_COMPILE_OPTIONS)()


@functools.cache
def rl_batch():
    """Two toy batches as B = 4 rollouts of two prompts: loss mask 0 on each row's first four
    (prompt) tokens, hand-made rewards, and behaviour log-probs = the model's own plus noise of up
    to 0.4 nats, so that some ratios leave GRPO's clip range [0.8, 1.2]."""
    halves = [make_batch(seed) for seed in (0, 1)]
    batch = {key: jnp.concatenate([half[key] for half in halves]) for key in halves[0]}
    batch["loss_mask"] = batch["loss_mask"].at[:, :4].set(0.0)
    graphdef, state = sgd_setup("qb")
    logp = model_logp(nnx.merge(graphdef, state).model, batch)[0]
    noise = jax.random.uniform(jax.random.key(1), logp.shape, minval=-0.4, maxval=0.4)
    return dict(batch, logp_behaviour=logp + noise,
                rewards=jnp.array([[1.0, 0.0], [0.5, 2.0]]),
                truncated=jnp.zeros((PROMPTS * GROUP,), bool))


@functools.cache
def rl_step(balancing: str, loss_chunk_tokens: int | None = None):
    return make_rl_step(sgd_setup(balancing)[0], GRPO, loss_chunk_tokens=loss_chunk_tokens,
                        compiler_options=FAST_COMPILE_OPTIONS)


@functools.cache
def rl_step_result(balancing: str, loss_chunk_tokens: int | None = None):
    """(state after one GRPO step from sgd_setup(balancing), its metrics)."""
    _, state = sgd_setup(balancing)
    return rl_step(balancing, loss_chunk_tokens)(fresh(state), rl_batch())


def masked_mean_nll(logp, batch):
    """The default objective written as a token loss."""
    total, count = masked_sum(-logp, batch["loss_mask"])
    return total / jnp.maximum(count, 1.0), {"nll_per_target": total / count}


@pytest.mark.slow
def test_token_loss_of_the_masked_mean_nll_is_the_default_step():
    """The hook's plumbing: a token loss equal to the default objective gives the default step's
    new state and metrics, bit for bit, and its own metrics join the step's."""
    graphdef, initial = split_state()
    batch = make_batch()
    default = make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)
    hooked = make_train_step(graphdef, token_loss=masked_mean_nll,
                             compiler_options=FAST_COMPILE_OPTIONS)
    want_state, want = default(fresh(initial), batch)
    got_state, got = hooked(fresh(initial), batch)
    assert float(got["skipped"]) == 0.0
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)
    np.testing.assert_array_equal(got["nll_per_target"], want["loss"])
    for (path, new), (_, old) in zip(flat(got_state), flat(want_state), strict=True):
        np.testing.assert_array_equal(new, old, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("balancing", ["qb", "aux_loss"])
def test_grpo_step_is_policy_loss_by_hand(balancing):
    """One GRPO step: the loss, its metrics and the gradient (SGD at rate 1: the parameter change)
    equal `policy_loss` on log_softmax of the model's logits plus the MoE auxiliary loss,
    differentiated by jax.grad; the router bias moves as the balancer says for the forward's
    router statistics (QB), and the auxiliary loss enters the gradient (aux_loss balancing)."""
    graphdef, initial = sgd_setup(balancing)
    batch = rl_batch()

    @jax.jit
    def by_hand(state):
        model = nnx.merge(graphdef, state).model
        graph, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logp, (stats,) = model_logp(nnx.merge(graph, params, rest), batch)
            value, metrics = policy_loss(GRPO, logp, batch)
            return value + stats.aux_loss, (value, stats.aux_loss, metrics, stats)

        (_, (value, aux, metrics, stats)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        bias = updated_bias(model.moe.cfg, model.moe.router_bias[...], stats)
        return value, aux, metrics, grads, bias

    want_loss, want_aux, want_metrics, grads, want_bias = by_hand(initial)
    state, metrics = rl_step_result(balancing)
    after = nnx.merge(graphdef, state)
    assert float(metrics["skipped"]) == 0.0 and float(metrics["nonfinite_state"]) == 0.0
    # The policy loss sums terms of order 1 (advantage times ratio) that cancel to about 0.01:
    # float32 rounding of the terms, an absolute 1e-7 or so, bounds its error.
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(metrics["aux_loss"], want_aux, rtol=1e-6)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
    assert float(metrics["clip_low_fraction"] + metrics["clip_high_fraction"]) > 0
    assert float(metrics["targets"]) == float(batch["loss_mask"].sum())
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    before = nnx.state(nnx.merge(graphdef, initial).model, nnx.Param)
    for (path, old), (_, new), (_, grad) in zip(flat(before), flat(nnx.state(after.model,
                                                                              nnx.Param)),
                                                flat(grads), strict=True):
        scale = max(np.abs(old).max(), np.abs(grad).max())
        np.testing.assert_allclose(old - new, grad, rtol=0, atol=1e-5 * scale, err_msg=str(path))
    bias = after.model.moe.router_bias[...]
    np.testing.assert_allclose(bias, want_bias, atol=1e-6)
    if balancing == "qb":
        assert np.abs(want_bias).max() > 0
    else:
        assert float(want_aux) > 0


@pytest.mark.slow
def test_chunked_head_equals_the_full_logits_for_the_policy_loss():
    """loss_chunk_tokens (a chunk size that does not divide T) gives the full head's GRPO step:
    metrics and new parameters within float32 rounding."""
    want_state, want = rl_step_result("qb")
    got_state, got = rl_step_result("qb", CHUNK)
    for name in ("loss", "grad_norm", "pg_loss", "ratio_mean", "ratio_max"):  # atol: as above
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    for name in ("clip_low_fraction", "clip_high_fraction", "tokens"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for (path, new), (_, old) in zip(flat(got_state), flat(want_state), strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("loss_chunk_tokens", [None, CHUNK])
def test_token_logp_is_log_softmax_at_the_targets(loss_chunk_tokens):
    """make_token_logp of a TrainState's state (full head) and of a bare model's (chunked head)
    equals log_softmax of the model's logits at the targets."""
    graphdef, state = sgd_setup("qb")
    batch = rl_batch()
    model = nnx.merge(graphdef, state).model
    want = jax.jit(lambda: model_logp(model, batch)[0])()
    if loss_chunk_tokens is not None:
        graphdef, state = nnx.split(model)
    got = make_token_logp(graphdef, loss_chunk_tokens=loss_chunk_tokens,
                          compiler_options=FAST_COMPILE_OPTIONS)(state, batch)
    assert got.shape == (PROMPTS * GROUP, LENGTH) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_place_splits_rows_and_replicates_the_groups():
    """Trainer.place on a data=2 mesh puts the RL batch's arrays of B rows ([B, T], [B]) on the
    data axis and the rewards [P, G] replicated."""
    trainer = types.SimpleNamespace(mesh=make_mesh(data=2, fsdp=-1))
    placed = Trainer.place(trainer, {key: np.asarray(value) for key, value in rl_batch().items()})
    for key, value in rl_batch().items():
        np.testing.assert_array_equal(placed[key], value, err_msg=key)
        rows = PartitionSpec("data", *[None] * (value.ndim - 1))
        assert placed[key].sharding.spec == (PartitionSpec() if key == "rewards" else rows), key


def test_make_rl_step_wants_a_loss_config():
    with pytest.raises(TypeError, match="RLLossConfig"):
        make_rl_step(sgd_setup("qb")[0], {"algorithm": "grpo"})
