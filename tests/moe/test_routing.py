"""Routing, Quantile Balancing and the baselines: exactness on tiny cases, estimators, dynamics."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe import routing
from moe.config import MoEConfig
from moe.routing import (
    RouterStats,
    balance_metrics,
    dynamic_route,
    dynamic_threshold_update,
    initial_dynamic_bias,
    load_counts,
    max_violation,
    quantile_balance,
    route,
    sequence_max_violation,
    sign_update,
    split_bf16_matmul,
    switch_aux_loss,
    updated_bias,
)


def random_scores(seed, tokens, experts, skew=0.0):
    """Sigmoid scores; `skew` adds a fixed per-expert logit offset (a strongly biased router)."""
    key_logits, key_skew = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(key_logits, (tokens, experts))
    offsets = skew * jnp.linspace(-1.0, 1.0, experts)
    return jax.nn.sigmoid(logits + offsets)


def brute_force_balanced_assignment(scores, k):
    """The assignment maximising the total score with k experts per token and m·k/E per expert,
    by exhaustive depth-first search over every token's k-subsets (pruned at full experts)."""
    scores = np.asarray(scores, np.float64)
    tokens, experts = scores.shape
    room = np.full(experts, tokens * k // experts)
    choices = list(itertools.combinations(range(experts), k))
    best = dict(total=-np.inf, assignment=None)

    def search(token, total, assignment):
        if token == tokens:
            if total > best["total"]:
                best.update(total=total, assignment=list(assignment))
            return
        for choice in choices:
            chosen = list(choice)
            if np.all(room[chosen] > 0):
                room[chosen] -= 1
                search(token + 1, total + scores[token, chosen].sum(), assignment + [choice])
                room[chosen] += 1

    search(0, 0.0, [])
    return [set(choice) for choice in best["assignment"]]


# --- route -----------------------------------------------------------------------------------


def test_route_selects_with_bias_and_weights_with_unbiased_scores():
    scores = jnp.array([[0.9, 0.8, 0.1, 0.2]])
    bias = jnp.array([0.0, -1.0, 0.0, 0.5])
    expert_ids, weights = route(scores, bias, 2, routed_scaling_factor=2.0)
    assert set(np.asarray(expert_ids[0]).tolist()) == {0, 3}
    np.testing.assert_allclose(np.asarray(weights[0]), 2.0 * np.array([0.9, 0.2]) / 1.1, rtol=1e-6)
    assert expert_ids.dtype == jnp.int32 and weights.dtype == jnp.float32


@settings(deadline=None, max_examples=10)
@given(
    tokens=st.sampled_from([1, 7, 32]),
    experts=st.sampled_from([4, 16]),
    k=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_route_weights_are_renormalised_top_k(tokens, experts, k, seed):
    scores = random_scores(seed, tokens, experts)
    bias = jax.random.normal(jax.random.key(seed + 1), (experts,)) * 0.1
    expert_ids, weights = route(scores, bias, k)
    biased = np.asarray(scores + bias)
    chosen = np.take_along_axis(biased, np.asarray(expert_ids), axis=1)
    kth_best = -np.sort(-biased, axis=1)[:, k - 1]
    assert np.all(chosen >= kth_best[:, None] - 1e-7)
    np.testing.assert_allclose(np.asarray(weights).sum(axis=1), 1.0, rtol=1e-5)
    assert len({tuple(sorted(row)) for row in np.asarray(expert_ids).tolist()}) >= 1
    assert all(len(set(row)) == k for row in np.asarray(expert_ids).tolist())


def test_route_rejects_bad_shapes_and_k():
    scores = jnp.ones((3, 4)) * 0.5
    with pytest.raises(ValueError, match="k must be"):
        route(scores, jnp.zeros(4), 5)
    with pytest.raises(ValueError, match="k must be"):
        route(scores, jnp.zeros(4), 0)
    with pytest.raises(ValueError, match="bias must be"):
        route(scores, jnp.zeros(3), 2)
    with pytest.raises(ValueError, match="scores must be"):
        route(jnp.ones(4), jnp.zeros(4), 2)
    with pytest.raises(ValueError, match="quantile_balance needs"):
        quantile_balance(scores, jnp.zeros(4), 4)


# --- Quantile Balancing: exactness ------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, experts, k, seed",
    [(4, 2, 1, 0), (6, 3, 1, 1), (6, 3, 2, 2), (4, 4, 2, 3), (8, 4, 1, 4), (8, 4, 2, 5)],
)
def test_qb_converges_to_the_brute_force_balanced_assignment(tokens, experts, k, seed):
    """Iterated QB steps (Su's alternating solver) route to the optimal balanced assignment."""
    scores = random_scores(seed, tokens, experts)

    @jax.jit  # the 30 steps in one program (eager, each case's shapes compile op by op)
    def routed_after_30_steps(scores):
        bias = jax.lax.fori_loop(0, 30, lambda _, bias: quantile_balance(scores, bias, k),
                                 jnp.zeros(experts))
        return route(scores, bias, k)[0]

    expert_ids = routed_after_30_steps(scores)
    routed = [set(row) for row in np.asarray(expert_ids).tolist()]
    assert routed == brute_force_balanced_assignment(scores, k)
    assert float(max_violation(expert_ids, experts)) == 0.0


def test_qb_balances_a_toy_like_the_k3_report_figure():
    """K3 report Fig. 5's setting: loads (4, 3, 1, 0), m=8, n=4, k=1, become (2, 2, 2, 2). (The
    report's scores are not published; on these the first step gives (3, 2, 2, 1), the second
    the balanced loads.)"""
    scores = jnp.array(
        [
            [0.90, 0.50, 0.20, 0.10],
            [0.85, 0.40, 0.30, 0.20],
            [0.80, 0.60, 0.10, 0.30],
            [0.70, 0.20, 0.60, 0.50],
            [0.30, 0.90, 0.20, 0.10],
            [0.20, 0.80, 0.40, 0.30],
            [0.40, 0.70, 0.30, 0.50],
            [0.10, 0.30, 0.70, 0.60],
        ]
    )
    ids_before, _ = route(scores, jnp.zeros(4), 1)
    np.testing.assert_array_equal(np.asarray(load_counts(ids_before, 4)), [4, 3, 1, 0])
    bias = quantile_balance(scores, jnp.zeros(4), 1)
    assert float(max_violation(route(scores, bias, 1)[0], 4)) < float(max_violation(ids_before, 4))
    bias = quantile_balance(scores, bias, 1)
    ids_after, _ = route(scores, bias, 1)
    np.testing.assert_array_equal(np.asarray(load_counts(ids_after, 4)), [2, 2, 2, 2])


def numpy_quantile_balance(scores, old_bias, k):
    """The QB step written out: alpha_i = (k+1)-th largest s_i + b; c_j = midpoint of the q-th
    and (q+1)-th largest margins s_ij - alpha_i, q = m·k/E; new bias = -c, mean-centred."""
    scores, old_bias = np.asarray(scores, np.float64), np.asarray(old_bias, np.float64)
    tokens, experts = scores.shape
    alpha = -np.sort(-(scores + old_bias), axis=1)[:, k]
    descending = -np.sort(-(scores - alpha[:, None]), axis=0)
    q = tokens * k // experts
    cutoff = (descending[q - 1] + descending[q]) / 2
    return -cutoff + cutoff.mean()


def test_qb_bias_is_mean_centred_and_matches_the_formula():
    scores = random_scores(7, 40, 8)
    old_bias = jax.random.normal(jax.random.key(8), (8,)) * 0.05
    new_bias = np.asarray(quantile_balance(scores, old_bias, 2))
    np.testing.assert_allclose(new_bias, numpy_quantile_balance(scores, old_bias, 2), atol=1e-6)
    assert abs(new_bias.mean()) < 1e-6


def test_qb_ignores_padding_tokens():
    scores = random_scores(9, 32, 8)
    mask = jnp.arange(32) < 20
    masked = quantile_balance(scores, jnp.zeros(8), 2, token_mask=mask)
    np.testing.assert_allclose(masked, quantile_balance(scores[:20], jnp.zeros(8), 2), atol=1e-6)
    unchanged = quantile_balance(scores, jnp.full(8, 0.3), 2, token_mask=jnp.zeros(32, bool))
    np.testing.assert_allclose(unchanged, 0.3)


# --- Quantile Balancing: estimators -----------------------------------------------------------


def _sorted_cutoff(values, valid, k, num_experts):
    """The exact cut-off by a sort of each column: the oracle of the radix select."""
    num_rows = values.shape[0]
    q = (int(np.sum(valid)) * k) // num_experts
    ascending = np.sort(np.where(valid[:, None], values, -np.inf), axis=0)
    below = ascending[num_rows - 1 - q]
    return (below + ascending[min(num_rows - q, num_rows - 1)]) / 2 if q > 0 else below


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 7, 64]),
       k=st.sampled_from([1, 2, 5]), ties=st.booleans(), valid_share=st.sampled_from([0.0, 0.5, 1]))
def test_exact_cutoff_selects_what_a_sort_selects(seed, rows, k, ties, valid_share):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, 6)).astype(np.float32) * 3
    if ties:  # a few distinct values: many equal order statistics, zeros of both signs
        values = rng.choice(np.float32([-2.5, -0.0, 0.0, 1e-30, 7.0]), size=(rows, 6))
    valid = rng.random(rows) < valid_share
    got = routing._exact_cutoff(jnp.asarray(values), jnp.asarray(valid), k, 6)
    np.testing.assert_array_equal(got, _sorted_cutoff(values, valid, k, 6))


@pytest.mark.slow
@settings(deadline=None, max_examples=8)
@given(seed=st.integers(0, 10_000), bins=st.sampled_from([64, 1024]))
def test_histogram_estimator_is_within_one_bin_of_exact(seed, bins):
    scores = random_scores(seed, 256, 16, skew=2.0)
    bias = jax.random.normal(jax.random.key(seed), (16,)) * 0.1
    exact = quantile_balance(scores, bias, 4)
    estimate = quantile_balance(scores, bias, 4, estimator="histogram", num_bins=bins)
    biased = scores + bias
    alpha = jax.lax.top_k(biased, 5)[0][:, 4]
    margins = scores - alpha[:, None]
    bin_width = float(margins.max() - margins.min()) / bins
    assert float(jnp.max(jnp.abs(estimate - exact))) <= bin_width + 1e-6


def test_minibatch_estimator_exact_with_one_averages_with_more():
    scores = random_scores(3, 128, 8, skew=1.0)
    bias = jnp.zeros(8)
    exact = quantile_balance(scores, bias, 2)
    one = quantile_balance(scores, bias, 2, estimator="minibatch_mean", num_minibatches=1)
    np.testing.assert_allclose(one, exact, atol=1e-6)
    halves = [quantile_balance(part, bias, 2) for part in (scores[:64], scores[64:])]
    two = quantile_balance(scores, bias, 2, estimator="minibatch_mean", num_minibatches=2)
    np.testing.assert_allclose(two, (halves[0] + halves[1]) / 2, atol=1e-6)
    with pytest.raises(ValueError, match="must divide"):
        quantile_balance(scores, bias, 2, estimator="minibatch_mean", num_minibatches=3)


@pytest.mark.parametrize("estimator", ["exact", "histogram", "minibatch_mean"])
def test_sharded_estimators_under_shard_map(estimator):
    """Tokens split over 8 devices: exact and histogram pool the shards, minibatch_mean averages
    per-shard quantiles (equal to the global mini-batch estimator with 8 mini-batches)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    scores = random_scores(11, 512, 16, skew=1.5)
    bias = jax.random.normal(jax.random.key(12), (16,)) * 0.05
    minibatches = 8 if estimator == "minibatch_mean" else 1

    @jax.jit  # one program for both sides (eager shard_map compiles op by op)
    def sharded_and_single(scores, bias):
        sharded = jax.shard_map(
            lambda s, b: quantile_balance(s, b, 4, estimator=estimator, num_bins=256,
                                          axis_name="data"),
            mesh=mesh,
            in_specs=(jax.P("data"), jax.P()),
            out_specs=jax.P(),
        )(scores, bias)
        single = quantile_balance(
            scores, bias, 4, estimator=estimator, num_bins=256, num_minibatches=minibatches
        )
        return sharded, single

    sharded, single = sharded_and_single(scores, bias)
    np.testing.assert_allclose(sharded, single, atol=1e-6)


# --- no look-ahead and gradients --------------------------------------------------------------


def test_routing_of_a_token_does_not_depend_on_the_rest_of_the_batch():
    """Routing uses only the old bias: changing other tokens cannot move a token's experts (an
    update-then-route scheme would, through the bias it computes from the batch)."""
    scores = random_scores(1, 64, 8)
    bias = quantile_balance(random_scores(2, 64, 8), jnp.zeros(8), 2)
    ids, _ = route(scores, bias, 2)
    other = scores.at[1:].set(random_scores(3, 63, 8, skew=3.0))
    ids_other, _ = route(other, bias, 2)
    np.testing.assert_array_equal(ids[0], ids_other[0])
    lookahead_bias = quantile_balance(other, bias, 2)
    assert not np.array_equal(np.asarray(route(other, lookahead_bias, 2)[0][1:]), ids_other[1:])


def test_bias_gets_no_gradient_and_router_logits_do():
    logits = jax.random.normal(jax.random.key(0), (16, 8))
    bias = jnp.linspace(-0.2, 0.2, 8)
    target = jax.random.normal(jax.random.key(1), (16, 2))

    def loss(logits, bias):
        _, weights = route(jax.nn.sigmoid(logits), bias, 2)
        return jnp.sum(weights * target)

    logits_grad, bias_grad = jax.grad(loss, argnums=(0, 1))(logits, bias)
    assert float(jnp.max(jnp.abs(bias_grad))) == 0.0
    assert float(jnp.max(jnp.abs(logits_grad))) > 0.0


# --- dynamics on a skewed router --------------------------------------------------------------


def run_balancer(update, steps, tokens=8192, experts=8, k=2, skew=2.0):
    """MaxVio per step on fresh batches from a fixed, strongly skewed router."""
    bias = jnp.zeros(experts)
    history = []
    for step in range(steps):
        scores = random_scores(step, tokens, experts, skew=skew)
        ids, _ = route(scores, bias, k)
        history.append(float(max_violation(ids, experts)))
        bias = update(scores, bias, ids)
    return history


def test_qb_balances_a_skewed_router_within_a_few_steps():
    k, experts = 2, 8
    qb = run_balancer(lambda s, b, ids: quantile_balance(s, b, k), steps=8)
    none = run_balancer(lambda s, b, ids: b, steps=8)
    sign = run_balancer(lambda s, b, ids: sign_update(b, load_counts(ids, experts), 1e-3), 8)
    assert qb[0] > 1.0 and min(none) > 1.0
    assert max(qb[4:]) < 0.1  # below 0.1 after four updates, and it stays there
    assert sign[-1] > 1.0  # eight 1e-3 steps barely move a skew of this size


@pytest.mark.slow
def test_sign_rule_needs_many_more_steps_than_qb():
    experts = 8
    sign = run_balancer(
        lambda s, b, ids: sign_update(b, load_counts(ids, experts), 1e-3), steps=400, tokens=2048
    )
    first_below = next(i for i, v in enumerate(sign) if v < 0.2)
    assert 20 < first_below < 400
    assert max(sign[:20]) > 1.0


# --- baselines and dynamic k ------------------------------------------------------------------


def test_sign_update_raises_underloaded_experts():
    new = sign_update(jnp.zeros(3), jnp.array([10.0, 5.0, 0.0]), 1e-3)
    np.testing.assert_allclose(new, [-1e-3, 0.0, 1e-3])


def test_switch_aux_loss_is_one_when_balanced_and_has_router_gradient():
    scores = jnp.full((4, 4), 0.5)
    ids = jnp.array([[0], [1], [2], [3]])
    assert float(switch_aux_loss(scores, ids)) == pytest.approx(1.0)
    skewed_ids = jnp.zeros((4, 1), jnp.int32)
    grad = jax.grad(lambda s: switch_aux_loss(s, skewed_ids))(jax.nn.sigmoid(jnp.eye(4)))
    assert float(jnp.max(jnp.abs(grad))) > 0


@pytest.mark.slow
def test_dynamic_k_fires_about_k_and_its_threshold_tracks_quantile():
    experts, k = 16, 4
    scores = random_scores(0, 4096, experts)
    bias = initial_dynamic_bias(experts, k)
    ids, weights, fired = dynamic_route(scores, bias, 2 * k)
    mean_fired = float(jnp.mean(jnp.sum(fired, axis=1)))
    assert 3.0 < mean_fired < 5.0
    fired_rows = jnp.sum(fired, axis=1) > 0
    np.testing.assert_allclose(jnp.sum(weights, axis=1)[fired_rows], 1.0, rtol=1e-5)
    assert float(jnp.max(jnp.where(fired, 0.0, weights))) == 0.0
    bias = jax.jit(lambda bias: jax.lax.fori_loop(  # the 60 updates in one program
        0, 60, lambda _, bias: dynamic_threshold_update(scores, bias, k, decay=0.9), bias))(bias)
    all_ids, _, all_fired = dynamic_route(scores, bias, experts)
    per_expert = np.asarray(load_counts(all_ids, experts, all_fired))
    np.testing.assert_allclose(per_expert, 4096 * k / experts, rtol=0.01)


# --- metrics and the single entry point -------------------------------------------------------


def test_metrics():
    ids = jnp.array([[[0, 1], [0, 2]], [[0, 3], [1, 2]]])
    assert float(max_violation(ids, 4)) == pytest.approx(3 / 2 - 1)
    assert float(max_violation(ids, 5)) == pytest.approx(3 / (8 / 5) - 1)
    assert float(sequence_max_violation(ids, 4)) == pytest.approx(((2 / 1 - 1) + 0.0) / 2)
    stats = RouterStats(
        scores=jnp.full((2, 2, 4), 0.5),
        expert_ids=ids,
        copy_mask=jnp.ones(ids.shape, bool),
        token_mask=jnp.ones((2, 2), bool),
        load=load_counts(ids, 5),
        aux_loss=jnp.zeros(()),
        dropped=jnp.zeros(()),
    )
    metrics = balance_metrics(stats, jnp.array([0.1, -0.3, 0.0, 0.2, 0.0]))
    assert float(metrics["idle_experts"]) == 1.0
    assert float(metrics["max_abs_bias"]) == pytest.approx(0.3)
    assert float(metrics["load_cv"]) > 0


@pytest.mark.parametrize("balancing", ["qb", "sign", "aux_loss", "none"])
def test_updated_bias_dispatches_on_the_config(balancing):
    cfg = MoEConfig(num_experts=8, top_k=2, balancing=balancing)
    scores = random_scores(0, 64, 8, skew=2.0)
    old_bias = jax.random.normal(jax.random.key(1), (8,)) * 0.05
    ids, _ = route(scores, old_bias, 2)
    stats = RouterStats(
        scores=scores,
        expert_ids=ids,
        copy_mask=jnp.ones(ids.shape, bool),
        token_mask=jnp.ones(64, bool),
        load=load_counts(ids, 8),
        aux_loss=jnp.zeros(()),
        dropped=jnp.zeros(()),
    )
    new = updated_bias(cfg, old_bias, stats)
    load = np.bincount(np.asarray(ids).reshape(-1), minlength=8)
    expected = {  # each rule written out, not through the functions updated_bias calls
        "qb": numpy_quantile_balance(scores, old_bias, 2),
        "sign": np.asarray(old_bias) + cfg.sign_rate * np.sign(load.mean() - load),
        "aux_loss": np.asarray(old_bias),
        "none": np.asarray(old_bias),
    }[balancing]
    np.testing.assert_allclose(new, expected, atol=1e-6)


def test_split_bf16_matmul_is_float32_accurate():
    x = jax.random.normal(jax.random.key(0), (64, 96))
    w = jax.random.normal(jax.random.key(1), (96, 8))
    exact = jnp.einsum("td,de->te", x, w, precision="highest")
    assert float(jnp.max(jnp.abs(split_bf16_matmul(x, w) - exact))) < 1e-3
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    single_pass = jnp.einsum("td,de->te", x16, w16, preferred_element_type=jnp.float32)
    assert float(jnp.max(jnp.abs(single_pass - exact))) > 1e-2
