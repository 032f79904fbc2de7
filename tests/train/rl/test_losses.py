"""train.rl.losses against the formulas written out in NumPy, token by token, in float64: the
group advantages, the clipped objective with each aggregation, KL estimator and DAPO filter, and
the gradient w.r.t. the policy's log-probs against central finite differences; degenerate groups,
an empty mask and the clip bounds."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.cli import apply_overrides
from train.rl.losses import (RLLossConfig, degenerate_groups, dr_grpo_advantages,
                             grpo_advantages, kl_estimate, overlong_penalty, policy_loss,
                             rloo_advantages)

P, G, T = 3, 4, 6
B = P * G


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


# ---------------------------------------------------------------- NumPy formulas, written out


def numpy_advantages(rewards, algorithm, epsilon):
    """Advantages [P, G], one rollout at a time; zero for a group of equal rewards."""
    advantages = np.zeros_like(rewards)
    for p, group in enumerate(rewards):
        size = len(group)
        if all(r == group[0] for r in group):
            continue
        mean = sum(group) / size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (size - 1))
        for i, r in enumerate(group):
            if algorithm in ("grpo", "dapo"):
                advantages[p, i] = (r - mean) / (std + epsilon)
            elif algorithm == "dr_grpo":
                advantages[p, i] = r - mean
            else:  # rloo
                advantages[p, i] = r - sum(group[j] for j in range(size) if j != i) / (size - 1)
    return advantages


def numpy_overlong_penalty(length, max_tokens, cache_tokens):
    if length <= max_tokens - cache_tokens:
        return 0.0
    if length <= max_tokens:
        return ((max_tokens - cache_tokens) - length) / cache_tokens
    return -1.0


def numpy_policy_loss(config: RLLossConfig, logp, batch):
    """The loss as the module docstring states it, token by token."""
    config = config.resolved()
    mask = np.array(batch["loss_mask"], np.float64)
    rewards = np.array(batch["rewards"], np.float64)
    if config.overlong == "penalty":
        for b in range(B):
            rewards[b // G, b % G] += numpy_overlong_penalty(
                mask[b].sum(), config.overlong_max_tokens, config.overlong_cache_tokens)
    if config.overlong == "filter":
        mask[np.asarray(batch["truncated"], bool)] = 0
    if config.dynamic_sampling:
        for p in range(P):
            if len(set(rewards[p])) == 1:
                mask[p * G:(p + 1) * G] = 0
    advantages = numpy_advantages(rewards, config.algorithm, config.std_epsilon).reshape(B)
    per_token = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = math.exp(logp[b, t] - batch["logp_behaviour"][b, t])
            clipped = min(max(ratio, 1 - config.clip_low), 1 + config.clip_high)
            per_token[b, t] = -min(ratio * advantages[b], clipped * advantages[b])
            if config.kl != "none":
                log_ratio = batch["logp_reference"][b, t] - logp[b, t]
                kl = -log_ratio if config.kl == "k1" else math.exp(log_ratio) - log_ratio - 1
                per_token[b, t] += config.kl_coef * kl
    if config.aggregation == "token":
        return per_token.sum() / mask.sum()
    if config.aggregation == "sequence":
        row_means = [per_token[b].sum() / mask[b].sum() for b in range(B) if mask[b].sum()]
        return sum(row_means) / len(row_means)
    return per_token.sum() / (B * (config.normaliser_tokens or T))


# ------------------------------------------------------------------------------ inputs


def rollout_batch(seed=0):
    """A batch of P groups of G rollouts: random rewards with group 1 all equal, behaviour and
    reference log-probs, a mask of 0 on a 2-token prompt and on random tool tokens (row 5 has no
    model tokens), rows 2 and 7 truncated; and the policy's log-probs, whose ratios to the
    behaviour's lie in [0.6, 1.65], at least 1e-3 in log away from every clip bound."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(P, G))
    rewards[1] = 0.5
    mask = (rng.random((B, T)) > 0.25).astype(np.float64)
    mask[:, :2] = 0
    mask[5] = 0
    behaviour = -2.0 + 0.5 * rng.normal(size=(B, T))
    bounds = np.log([0.8, 1.2, 1.28, 0.7])
    log_ratio = rng.uniform(-0.5, 0.5, size=(B, T))
    while (near := np.abs(log_ratio[..., None] - bounds).min(-1) < 1e-3).any():
        log_ratio[near] = rng.uniform(-0.5, 0.5, size=near.sum())
    batch = dict(
        logp_behaviour=behaviour,
        loss_mask=mask,
        rewards=rewards,
        logp_reference=behaviour + 0.3 * rng.normal(size=(B, T)),
        truncated=np.isin(np.arange(B), [2, 7]),
    )
    return behaviour + log_ratio, batch


CONFIGS = {
    "grpo": RLLossConfig("grpo"),
    "grpo_k3": RLLossConfig("grpo", kl="k3", kl_coef=0.1),
    "dr_grpo_k1": RLLossConfig("dr_grpo", kl="k1", kl_coef=0.05, normaliser_tokens=8),
    "dapo": RLLossConfig("dapo"),
    "dapo_penalty_k3": RLLossConfig("dapo", kl="k3", kl_coef=0.2, overlong="penalty",
                                    overlong_max_tokens=4, overlong_cache_tokens=2),
    "rloo": RLLossConfig("rloo", clip_low=0.3, clip_high=0.2),
}


# Compiled once per config and batch shape, shared by the tests (config is static: hashable).
_value_and_grad = jax.jit(jax.value_and_grad(
    lambda logp, batch, config: policy_loss(config, logp, batch), has_aux=True),
    static_argnums=2)


def value_and_grad(config, logp, batch):
    (loss, metrics), grad = _value_and_grad(logp, batch, config)
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def central_differences(config, logp, batch, step=1e-6):
    """d loss / d logp [B, T] from (loss(logp + h e_i) - loss(logp - h e_i)) / 2h."""
    grad = np.zeros_like(logp)
    for index in np.ndindex(logp.shape):
        shift = np.zeros_like(logp)
        shift[index] = step
        grad[index] = (value_and_grad(config, logp + shift, batch)[0]
                       - value_and_grad(config, logp - shift, batch)[0]) / (2 * step)
    return grad


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("algorithm, estimator", [
    ("grpo", lambda r: grpo_advantages(r, 0.1)),
    ("dr_grpo", dr_grpo_advantages),
    ("rloo", rloo_advantages),
])
def test_group_advantages_match_numpy(algorithm, estimator):
    """On random rewards (epsilon 0.1, large enough that forgetting it shows)."""
    rewards = np.random.default_rng(1).normal(size=(4, 5))
    np.testing.assert_allclose(estimator(jnp.asarray(rewards)),
                               numpy_advantages(rewards, algorithm, 0.1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", [lambda r: grpo_advantages(r, 1e-6), dr_grpo_advantages,
                                       rloo_advantages])
def test_groups_of_equal_rewards_get_exactly_zero_advantage(estimator):
    """The mean of three 0.3s is not 0.3 in float64 (nor of 0.7s): without the exact zero, GRPO
    would divide a rounding error by a rounding error (advantage ~0.8)."""
    rewards = jnp.array([[0.3, 0.3, 0.3], [0.7, 0.7, 0.7], [0.0, 1.0, 0.0]])
    advantages = np.asarray(estimator(rewards))
    assert (advantages[:2] == 0).all() and np.isfinite(advantages).all()
    assert (advantages[2] != 0).all()
    np.testing.assert_array_equal(degenerate_groups(rewards), [True, True, False])


@pytest.mark.parametrize("name", CONFIGS)
def test_policy_loss_matches_numpy(name):
    config = CONFIGS[name]
    logp, batch = rollout_batch()
    loss, metrics, _ = value_and_grad(config, logp, batch)
    np.testing.assert_allclose(loss, numpy_policy_loss(config, logp, batch), rtol=1e-12)
    settings = config.resolved()
    assert metrics["degenerate_groups"] == (0 if settings.overlong == "penalty" else 1)
    assert metrics["dropped_groups"] == (metrics["degenerate_groups"]
                                         if settings.dynamic_sampling else 0)
    assert metrics["filtered_rows"] == (2 if settings.overlong == "filter" else 0)


@pytest.mark.parametrize("name", CONFIGS)
def test_policy_loss_gradient_matches_central_differences(name):
    """Central differences with h = 1e-6 in float64: truncation error ~ h^2, rounding ~ 1e-16 / h;
    the inputs keep every ratio 1e-3 (in log) from the clip's kinks."""
    config = CONFIGS[name]
    logp, batch = rollout_batch(seed=2)
    _, _, grad = value_and_grad(config, logp, batch)
    np.testing.assert_allclose(grad, central_differences(config, logp, batch), rtol=1e-6,
                               atol=1e-9)
    assert (grad[np.asarray(batch["loss_mask"]) == 0] == 0).all()


@pytest.mark.parametrize("delta, cut", [(-1e-4, False), (1e-4, True)])
def test_the_clip_cuts_the_gradient_just_outside_each_bound(delta, cut):
    """Rollout 0 has A > 0 and ratio 1 + clip_high + delta; rollout 1 A < 0 and ratio
    1 - clip_low - delta: inside a bound the token keeps its gradient, outside it gets none. A
    ratio beyond the other bound (below the low one with A > 0, above the high one with A < 0)
    is never clipped."""
    config = RLLossConfig("grpo", clip_low=0.2, clip_high=0.28, aggregation="token")
    ratios = np.array([[1.28 + delta, 0.7], [0.8 - delta, 1.35]])
    batch = dict(logp_behaviour=np.full((2, 2), -1.0), loss_mask=np.ones((2, 2)),
                 rewards=np.array([[1.0, 0.0]]))
    _, metrics, grad = value_and_grad(config, np.log(ratios) - 1.0, batch)
    advantage = 0.5 / (math.sqrt(0.5) + config.std_epsilon)
    at_bounds = grad[[0, 1], [0, 0]]
    if cut:
        np.testing.assert_array_equal(at_bounds, 0.0)
    else:
        np.testing.assert_allclose(at_bounds, [-advantage * ratios[0, 0] / 4,
                                               advantage * ratios[1, 0] / 4], rtol=1e-12)
    np.testing.assert_allclose(grad[[0, 1], [1, 1]], [-advantage * ratios[0, 1] / 4,
                                                      advantage * ratios[1, 1] / 4], rtol=1e-12)
    assert metrics["clip_high_fraction"] == metrics["clip_low_fraction"] == (0.25 if cut else 0)


@pytest.mark.parametrize("name", CONFIGS)
def test_an_empty_mask_gives_zero_loss_and_gradient(name):
    """No model tokens at all, and -inf log-probs wherever the mask is 0: no NaN anywhere."""
    logp, batch = rollout_batch()
    batch["loss_mask"] = np.zeros((B, T))
    batch["logp_behaviour"] = np.full((B, T), -np.inf)
    logp[0, 0] = -np.inf
    loss, metrics, grad = value_and_grad(CONFIGS[name], logp, batch)
    assert loss == 0 and (grad == 0).all()
    assert all(np.isfinite(value) for value in metrics.values()), metrics


@pytest.mark.parametrize("name", CONFIGS)
def test_all_groups_of_equal_rewards_give_no_policy_gradient(name):
    config = CONFIGS[name].resolved()
    logp, batch = rollout_batch()
    batch["rewards"] = np.ones((P, G))
    batch["loss_mask"][:, 2:] = 1  # every row the same length: the penalty shapes them alike
    loss, metrics, grad = value_and_grad(config, logp, batch)
    assert metrics["pg_loss"] == 0 and metrics["degenerate_groups"] == P
    assert metrics["dropped_groups"] == (P if config.dynamic_sampling else 0)
    if config.kl == "none" or config.dynamic_sampling:
        assert loss == 0 and (grad == 0).all()
    else:  # only the KL term pulls
        assert np.isfinite(grad).all() and np.abs(grad).max() > 0


def test_kl_estimators_match_their_formulas():
    rng = np.random.default_rng(3)
    logp, reference = rng.normal(size=(2, 8)), rng.normal(size=(2, 8))
    l = reference - logp  # noqa: E741
    np.testing.assert_allclose(kl_estimate(logp, reference, "k1"), -l, rtol=1e-14)
    np.testing.assert_allclose(kl_estimate(logp, reference, "k3"), np.exp(l) - l - 1,
                               rtol=1e-12)


def test_overlong_penalty_matches_dapo():
    """0 up to 12 tokens, then -1/4 per token to -1 at 16, and -1 beyond."""
    lengths = np.arange(0, 20)
    want = [numpy_overlong_penalty(n, 16, 4) for n in lengths]
    np.testing.assert_allclose(overlong_penalty(jnp.asarray(lengths), 16, 4), want, rtol=1e-7)
    assert want[12] == 0 and want[14] == -0.5 and want[16] == want[19] == -1


def test_algorithm_defaults_and_explicit_fields():
    dapo = RLLossConfig("dapo").resolved()
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation, dapo.overlong,
            dapo.dynamic_sampling) == (0.2, 0.28, "token", "filter", True)
    assert RLLossConfig("dr_grpo").resolved().aggregation == "constant"
    assert RLLossConfig("grpo").resolved().aggregation == "sequence"
    assert RLLossConfig("dapo", clip_high=0.3, dynamic_sampling=False).resolved().clip_high == 0.3


def test_changing_the_algorithm_gives_its_defaults_and_keeps_explicit_fields():
    """As `--set rl.loss.algorithm=dapo` does on the default (GRPO) config: every field left
    unset follows the new algorithm, and the loss is DAPO's; a field set explicitly stays."""
    switched = dataclasses.replace(RLLossConfig(), algorithm="dapo")
    assert switched == RLLossConfig("dapo")
    logp, batch = rollout_batch()
    loss, metrics = policy_loss(switched, jnp.asarray(logp), batch)
    want_loss, want_metrics = policy_loss(RLLossConfig("dapo"), jnp.asarray(logp), batch)
    assert float(loss) == float(want_loss) and metrics["dropped_groups"] == 1
    assert {k: float(v) for k, v in metrics.items()} == {
        k: float(v) for k, v in want_metrics.items()}

    overridden = apply_overrides(RLLossConfig(clip_high=0.3),
                                 ["algorithm=dapo", "aggregation=sequence"]).resolved()
    assert (overridden.clip_low, overridden.clip_high, overridden.aggregation,
            overridden.overlong, overridden.dynamic_sampling) == (0.2, 0.3, "sequence", "filter",
                                                                  True)
    assert apply_overrides(RLLossConfig("dapo"), ["algorithm=grpo"]) == RLLossConfig("grpo")


@pytest.mark.parametrize("fields, named", [
    (dict(algorithm="ppo"), "algorithm"),
    (dict(clip_low=1.0), "clip_low"),
    (dict(clip_low=0), "clip_low"),
    (dict(clip_high=-0.1), "clip_high"),
    (dict(kl="k2", kl_coef=0.1), "kl"),
    (dict(kl="k3"), "kl_coef"),
    (dict(kl_coef=0.1), "kl_coef"),
    (dict(aggregation="mean"), "aggregation"),
    (dict(normaliser_tokens=16), "normaliser_tokens"),
    (dict(aggregation="constant", normaliser_tokens=0), "normaliser_tokens"),
    (dict(overlong="clip"), "overlong"),
    (dict(overlong="penalty", overlong_cache_tokens=4), "overlong_max_tokens"),
    (dict(overlong="penalty", overlong_max_tokens=4, overlong_cache_tokens=8),
     "overlong_cache_tokens"),
    (dict(overlong_max_tokens=16), "overlong_max_tokens"),
    (dict(dynamic_sampling="yes"), "dynamic_sampling"),
    (dict(std_epsilon=0.0), "std_epsilon"),
])
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"RLLossConfig\.{named} must be"):
        RLLossConfig(**fields)


def test_batch_errors_name_the_key():
    logp, batch = rollout_batch()

    def trace(config, batch):
        jax.eval_shape(lambda logp, batch: policy_loss(config, logp, batch), logp, batch)

    with pytest.raises(KeyError, match="logp_reference"):
        trace(RLLossConfig("grpo", kl="k1", kl_coef=0.1),
              {k: v for k, v in batch.items() if k != "logp_reference"})
    with pytest.raises(ValueError, match=r"batch\['rewards'\] must be \[P, G\]"):
        trace(RLLossConfig("grpo"), dict(batch, rewards=batch["rewards"][:2]))
    with pytest.raises(ValueError, match="G >= 2"):
        trace(RLLossConfig("grpo"), dict(batch, rewards=batch["rewards"].reshape(B, 1)))
