"""Sigmoid top-k routing, router-bias balancers and load metrics (pure functions, float32).

Routing (DeepSeek-V3 / Kimi K3): scores `s = sigmoid(x @ W_r)`, experts = top-k of `s + b`, mixture
weights = the selected *unbiased* scores, renormalised, times `routed_scaling_factor`. The bias
`b [E]` only changes which experts are chosen; no gradient reaches it.

Balancers (`updated_bias`, applied after the optimizer step to the bias the step routed with;
derivations in `docs/quantile_balancing.md`):
- "qb", Quantile Balancing (Su, kexue.fm/archives/11619; K3 report Eq. 14): with the old bias,
  `alpha_i` = the (k+1)-th largest biased score of token i; the new `b_j` = minus the midpoint
  of the q-th and (q+1)-th largest margins `s_ij - alpha_i` over the m tokens (q = m·k/E);
  then mean-centred. It sets the bias outright (one exact coordinate step of the
  balanced-assignment dual), so it has no rate. The midpoint, not the (q+1)-th margin itself:
  that end of the minimising interval puts one token exactly on expert j's cut-off, and the
  alternating steps can then stall short of the balanced optimum.
- "sign", DeepSeek-V3's rule `b += gamma * sign(mean load - load)`: one SignSGD step on that dual.
- "aux_loss", a Switch-style loss added to the training loss (the bias stays 0); "none".
- dynamic_k: expert j fires iff `s_ij > beta_j` with `beta = -b`; under "qb" beta is an EMA of the
  (1 - k/E) quantile of the scores (Su, kexue.fm/archives/11626).

Quantiles over a batch that is sharded over devices: "histogram" pools margin-bin counts (their sum
is exact, the read-off is within one bin), "minibatch_mean" averages exact per-shard quantiles.
Under `jax.jit` on sharded arrays XLA inserts the reductions; inside `shard_map`, pass the mesh
axis that shards the tokens as `axis_name`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from moe.config import MoEConfig


class RouterStats(NamedTuple):
    """What one MoE layer's forward pass hands to the balancer and the metrics (no gradients).

    Shapes: `...` are the token dims of the layer input (e.g. [B, T]); S = slots per token
    (k, or `dynamic_k_max` under dynamic_k).
    """

    scores: jax.Array  # [..., E] float32 sigmoid router scores
    expert_ids: jax.Array  # [..., S] int32 chosen experts, routed with the old bias
    copy_mask: jax.Array  # [..., S] bool: the token is real and the slot fired
    token_mask: jax.Array  # [...] bool: the token is real (not padding)
    load: jax.Array  # [E] float32 token copies per expert
    aux_loss: jax.Array  # [] float32 weighted auxiliary loss (0 unless balancing == "aux_loss")
    dropped: jax.Array  # [] float32 token copies dropped by a full expert-parallel buffer


# The `checkpoint_name` of the routing and permutation results (the routed experts and weights,
# the dispatch plan, the rows in expert order, the mixed routed output): cheap to keep, a sort,
# a top-k and gathers to recompute. `models.lm`'s `dots_kernels` remat policy keeps them.
PERMUTATION_NAME = "moe_permutation"


def router_scores(x: jax.Array, router_weight: jax.Array) -> jax.Array:
    """Sigmoid router scores in float32. x: [..., D], router_weight: [D, E] -> [..., E].

    On GPU the logits come from bf16 tensor-core passes (`split_bf16_matmul`, about 2^-16
    relative error), which cost far less than a full-precision float32 matmul on the tensor
    cores. Elsewhere they are one float32 matmul at full precision.
    """
    if jax.default_backend() == "gpu":
        logits = split_bf16_matmul(x, router_weight)
    else:
        logits = jnp.einsum(
            "...d,de->...e",
            x.astype(jnp.float32),
            router_weight.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
    return jax.nn.sigmoid(logits)


def split_bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` to about 2^-16 relative precision, in float32, from bf16 passes.

    Each float32 operand is split into a bf16 head and a bf16 remainder, and head·head +
    head·rem + rem·head is accumulated in float32 (rem·rem is below float32 rounding of the sum).
    A bf16 operand has no remainder, so a bf16 x costs two passes. x: [..., D], w: [D, E].
    """
    x_parts, w_parts = _bf16_parts(x), _bf16_parts(w)
    return sum(
        jnp.einsum("...d,de->...e", x_part, w_part, preferred_element_type=jnp.float32)
        for i, x_part in enumerate(x_parts)
        for j, w_part in enumerate(w_parts)
        if i + j < 2
    )


def _bf16_parts(a: jax.Array) -> tuple[jax.Array, ...]:
    """(a,) for bf16 input, else (head, remainder): bf16 parts summing to a within 2^-16."""
    if a.dtype == jnp.bfloat16:
        return (a,)
    head = a.astype(jnp.bfloat16)
    return head, (a.astype(jnp.float32) - head.astype(jnp.float32)).astype(jnp.bfloat16)


def route(
    scores: jax.Array, bias: jax.Array, k: int, routed_scaling_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts of `scores + bias` and their renormalised unbiased scores.

    Args:
        scores: [T, E] (or [..., E]) float32 router scores (sigmoid outputs, so positive).
        bias: [E] router bias; selection only, it receives no gradient.
        k: experts per token, 1 <= k <= E.
        routed_scaling_factor: multiplies the renormalised weights.

    Returns:
        expert_ids: [T, k] int32, in decreasing order of biased score.
        weights: [T, k] float32, `s_sel / sum(s_sel) * routed_scaling_factor`.
    """
    _check_scores_bias(scores, bias)
    _check_k(k, scores.shape[-1], "k")
    scores = scores.astype(jnp.float32)
    _, expert_ids = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), k)
    expert_ids = checkpoint_name(expert_ids, PERMUTATION_NAME)
    selected = jnp.take_along_axis(scores, expert_ids, axis=-1)
    weights = selected / (jnp.sum(selected, axis=-1, keepdims=True) + 1e-20)
    return expert_ids.astype(jnp.int32), weights * routed_scaling_factor


def dynamic_route(
    scores: jax.Array, bias: jax.Array, max_k: int, routed_scaling_factor: float = 1.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dynamic-k routing: expert j fires for a token iff `s_j + b_j > 0` (threshold `-b_j`).

    At most `max_k` experts fire per token (the `max_k` highest of `s + b`), so that the dispatch
    keeps static shapes. Slots that do not fire get weight 0.

    Args:
        scores: [..., E] float32 router scores.
        bias: [E] minus the per-expert firing threshold.
        max_k: slots per token.
        routed_scaling_factor: multiplies the renormalised weights.

    Returns:
        expert_ids [..., max_k] int32, weights [..., max_k] float32 (renormalised over the fired
        slots), fired [..., max_k] bool.
    """
    _check_scores_bias(scores, bias)
    _check_k(max_k, scores.shape[-1], "max_k")
    scores = scores.astype(jnp.float32)
    biased, expert_ids = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), max_k)
    fired = biased > 0
    selected = jnp.where(fired, jnp.take_along_axis(scores, expert_ids, axis=-1), 0.0)
    weights = selected / (jnp.sum(selected, axis=-1, keepdims=True) + 1e-20)
    return expert_ids.astype(jnp.int32), weights * routed_scaling_factor, fired


def initial_dynamic_bias(num_experts: int, k: int, logit_std: float = 1.0) -> jax.Array:
    """Bias that makes about k of E experts fire at initialisation under dynamic_k.

    With router logits ~ N(0, logit_std^2), the (1 - k/E) quantile of the sigmoid scores is
    `sigmoid(logit_std * Phi^-1(1 - k/E))`; the bias is minus that threshold. (A zero bias would
    fire every expert, as sigmoid scores are positive.)
    """
    _check_k(k, num_experts, "k")
    quantile = jax.scipy.special.ndtri(jnp.float32(1.0 - k / num_experts))
    return jnp.full((num_experts,), -jax.nn.sigmoid(logit_std * quantile), jnp.float32)


def quantile_balance(
    scores: jax.Array,
    bias: jax.Array,
    k: int,
    *,
    token_mask: jax.Array | None = None,
    estimator: str = "exact",
    num_bins: int = 1024,
    num_minibatches: int = 1,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """One Quantile Balancing step: the new router bias from a batch routed with `bias`.

    `alpha_i` = (k+1)-th largest of `s_i + bias`; `c_j` = the midpoint of the q-th and (q+1)-th
    largest margins `s_ij - alpha_i` over the m real tokens, q = floor(m·k/E), so that exactly q
    tokens clear expert j's new cut-off; new bias = `-c` minus its mean.

    Args:
        scores: [T, E] (or [..., E]) float32 router scores of the batch.
        bias: [E] the bias the batch was routed with.
        k: experts per token, 1 <= k < E.
        token_mask: [T] (or [...]) bool, False for padding tokens (None = all real).
        estimator: "exact", "histogram" or "minibatch_mean" (see module docstring).
        num_bins: histogram bins.
        num_minibatches: mini-batches of "minibatch_mean" (must divide the token count).
        axis_name: mesh axis (or axes) sharding the tokens, when called inside `shard_map`.

    Returns:
        [E] float32 new bias (the old one if the batch has no real token).
    """
    _check_scores_bias(scores, bias)
    num_experts = scores.shape[-1]
    if not 1 <= k < num_experts:
        raise ValueError(
            f"quantile_balance needs 1 <= k < E, got k={k}, E={num_experts}; with k == E every "
            "expert is always chosen and there is nothing to balance."
        )
    scores, valid = _flatten_tokens(scores, token_mask)
    bias = bias.astype(jnp.float32)
    alpha = jax.lax.top_k(scores + bias, k + 1)[0][:, k]
    margins = scores - alpha[:, None]
    cutoff, any_token = _upper_quantile(
        margins, valid, k, num_experts, estimator, num_bins, num_minibatches, axis_name
    )
    new_bias = -cutoff - jnp.mean(-cutoff)
    return jnp.where(any_token, new_bias, bias)


def dynamic_threshold_update(
    scores: jax.Array,
    bias: jax.Array,
    k: int,
    *,
    decay: float,
    token_mask: jax.Array | None = None,
    estimator: str = "exact",
    num_bins: int = 1024,
    num_minibatches: int = 1,
    axis_name: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Dynamic-k QB: `beta <- decay·beta + (1 - decay)·quantile_{1-k/E}(s)`, with `bias = -beta`.

    Args and estimator options as in `quantile_balance`; decay in [0, 1).

    Returns:
        [E] float32 new bias (not mean-centred: it is an absolute firing threshold).
    """
    _check_scores_bias(scores, bias)
    _check_k(k, scores.shape[-1], "k")
    scores, valid = _flatten_tokens(scores, token_mask)
    quantile, any_token = _upper_quantile(
        scores, valid, k, scores.shape[1], estimator, num_bins, num_minibatches, axis_name
    )
    bias = bias.astype(jnp.float32)
    new_bias = decay * bias - (1.0 - decay) * quantile
    return jnp.where(any_token, new_bias, bias)


def sign_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's aux-loss-free rule: `b += rate * sign(mean load - load)`. load: [E]."""
    if bias.shape != load.shape:
        raise ValueError(f"bias {bias.shape} and load {load.shape} must both be [E].")
    load = load.astype(jnp.float32)
    return bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)


def switch_aux_loss(
    scores: jax.Array, expert_ids: jax.Array, copy_mask: jax.Array | None = None
) -> jax.Array:
    """Switch-Transformer load-balancing loss `E * sum_j f_j * P_j` (1 when balanced).

    f_j: fraction of the token copies sent to expert j (no gradient); P_j: mean over real tokens of
    the normalised scores `s_ij / sum_j s_ij` (the gradient path to the router).

    Args:
        scores: [..., E] float32 router scores (not stop-gradiented).
        expert_ids: [..., S] chosen experts.
        copy_mask: [..., S] bool, which slots count (None = all).
    """
    num_experts = scores.shape[-1]
    if copy_mask is None:
        copy_mask = jnp.ones(expert_ids.shape, bool)
    token_mask = jnp.any(copy_mask, axis=-1)
    load = load_counts(expert_ids, num_experts, copy_mask)
    fraction = load / jnp.maximum(jnp.sum(load), 1.0)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    probs = jnp.where(token_mask[..., None], probs, 0.0)
    mean_prob = jnp.sum(probs.reshape(-1, num_experts), axis=0) / jnp.maximum(
        jnp.sum(token_mask), 1
    )
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def updated_bias(cfg: MoEConfig, bias: jax.Array, stats: RouterStats) -> jax.Array:
    """The balancer's single entry point: the router bias for the next step.

    Call after the optimizer step, outside the gradient, with the bias the step routed with and
    the layer's `RouterStats`. It is a pure function of replicated values, so every replica
    computes the same bias.
    """
    estimator_options = dict(
        token_mask=stats.token_mask,
        estimator=cfg.qb_estimator,
        num_bins=cfg.qb_bins,
        num_minibatches=cfg.qb_minibatches,
    )
    if cfg.balancing == "qb" and cfg.dynamic_k:
        return dynamic_threshold_update(
            stats.scores, bias, cfg.top_k, decay=cfg.dynamic_k_decay, **estimator_options
        )
    if cfg.balancing == "qb":
        return quantile_balance(stats.scores, bias, cfg.top_k, **estimator_options)
    if cfg.balancing == "sign":
        return sign_update(bias, stats.load, cfg.sign_rate)
    return bias


def load_counts(
    expert_ids: jax.Array, num_experts: int, copy_mask: jax.Array | None = None
) -> jax.Array:
    """Token copies per expert. expert_ids: [..., S] int, copy_mask: [..., S] bool -> [E] f32.

    Ids outside [0, E) count nowhere. A compare-and-sum rather than `bincount`, whose scatter-add
    into E counters serialises on GPU atomics.
    """
    ids = expert_ids.reshape(-1, 1)
    hits = ids == jnp.arange(num_experts)
    if copy_mask is not None:
        hits = hits & copy_mask.reshape(-1, 1)
    return jnp.sum(hits, axis=0, dtype=jnp.float32)


def max_violation(
    expert_ids: jax.Array, num_experts: int, copy_mask: jax.Array | None = None
) -> jax.Array:
    """MaxVio of a batch: `max_j load_j / mean_j load_j - 1` (0 = perfectly balanced).

    Args:
        expert_ids: [T, k] (or [..., k]) chosen experts.
        num_experts: E.
        copy_mask: [..., k] bool, which copies count (None = all).

    Returns:
        [] float32 (0 for an empty batch).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return _max_violation_of_load(load_counts(expert_ids, num_experts, copy_mask))


def sequence_max_violation(
    expert_ids: jax.Array, num_experts: int, copy_mask: jax.Array | None = None
) -> jax.Array:
    """Mean over sequences of the per-sequence MaxVio. expert_ids: [B, T, k] -> [] float32."""
    if expert_ids.ndim != 3:
        raise ValueError(f"expert_ids must be [B, T, k], got shape {expert_ids.shape}")
    if copy_mask is None:
        copy_mask = jnp.ones(expert_ids.shape, bool)
    per_sequence = jax.vmap(lambda ids, mask: max_violation(ids, num_experts, mask))(
        expert_ids, copy_mask
    )
    return jnp.mean(per_sequence)


def balance_metrics(stats: RouterStats, bias: jax.Array) -> dict[str, jax.Array]:
    """Per-layer balance metrics from one step's `RouterStats` and the bias it routed with.

    Returns float32 scalars: `max_vio` (batch MaxVio), `seq_max_vio` (mean per-sequence MaxVio,
    when the layer input had a batch dim), `idle_experts` (experts with no token), `load_cv`
    (coefficient of variation of the load), `max_abs_bias`, `dropped` (token copies dropped).
    """
    load = stats.load
    metrics = dict(
        max_vio=_max_violation_of_load(load),
        idle_experts=jnp.sum(load == 0).astype(jnp.float32),
        load_cv=jnp.std(load) / jnp.maximum(jnp.mean(load), 1e-20),
        max_abs_bias=jnp.max(jnp.abs(bias)).astype(jnp.float32),
        dropped=stats.dropped,
    )
    if stats.expert_ids.ndim == 3:
        metrics["seq_max_vio"] = sequence_max_violation(
            stats.expert_ids, load.shape[0], stats.copy_mask
        )
    return metrics


def _max_violation_of_load(load: jax.Array) -> jax.Array:
    mean = jnp.mean(load)
    return jnp.where(mean > 0, jnp.max(load) / jnp.maximum(mean, 1e-20) - 1.0, 0.0)


def _upper_quantile(values, valid, k, num_experts, estimator, num_bins, num_minibatches, axis_name):
    """Per column of values [T, E], a cut-off with q = floor(m·k/E) of the m valid rows above it.

    The cut-off is the midpoint of the q-th and (q+1)-th largest valid values (the (q+1)-th when
    q = 0); m counts the valid rows over all shards of `axis_name`. Returns (cut-off [E] float32,
    whether any row was valid).
    """
    num_valid = _psum(jnp.sum(valid, dtype=jnp.int32), axis_name)
    if estimator == "exact":
        if axis_name is not None:
            values = _gather_replicated(values, axis_name)
            valid = _gather_replicated(valid.astype(jnp.int32), axis_name).astype(bool)
        cutoff = _exact_cutoff(values, valid, k, num_experts)
    elif estimator == "histogram":
        cutoff = _histogram_cutoff(values, valid, k, num_experts, num_bins, axis_name)
    elif estimator == "minibatch_mean":
        cutoff = _minibatch_cutoff(values, valid, k, num_experts, num_minibatches)
        if axis_name is not None:
            cutoff = jax.lax.pmean(cutoff, axis_name)
    else:
        raise ValueError(
            f"estimator must be 'exact', 'histogram' or 'minibatch_mean', got {estimator!r}"
        )
    return cutoff, num_valid > 0


def _exact_cutoff(values, valid, k, num_experts):
    """Midpoint of the q-th and (q+1)-th largest valid value per column (the (q+1)-th when
    q = 0), found by a radix select (`_key_of_rank`) rather than a sort: the same values exactly,
    from nine passes of counts over values [T, E] instead of a sort of each column."""
    q = (jnp.sum(valid, dtype=jnp.int32) * k) // num_experts
    keys = _order_keys(jnp.where(valid[:, None], values, -jnp.inf))
    below = _key_of_rank(keys, q + 1)  # [E]
    # The q-th largest: the smallest key above `below` if q keys are above it, else a tie with it.
    greater = keys > below
    smallest_greater = jnp.min(jnp.where(greater, keys, np.uint32(2**32 - 1)), axis=0)
    above = jnp.where(jnp.sum(greater, axis=0) >= q, smallest_greater, below)
    below, above = _float_of_keys(below), _float_of_keys(above)
    return jnp.where(q > 0, (below + above) / 2, below)


_SIGN_BIT = np.uint32(0x80000000)
_RADIX_BITS = 4  # digits a pass of `_key_of_rank` settles: 2^4 - 1 counts a pass, 8 passes


def _order_keys(values):
    """float32 -> uint32 keys in the same order (IEEE bits: negatives' bits reversed, positives'
    sign set), so that order statistics can be found by counting keys at or above a threshold."""
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    return jnp.where(bits >= _SIGN_BIT, ~bits, bits | _SIGN_BIT)


def _float_of_keys(keys):
    """The inverse of `_order_keys`."""
    bits = jnp.where(keys >= _SIGN_BIT, keys & ~_SIGN_BIT, ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _key_of_rank(keys, rank):
    """Per column of keys [T, E] uint32, the rank-th largest key (rank: int32 [], 1 <= rank <= T).

    The rank-th largest key is the largest threshold with at least `rank` keys at or above it;
    it is built digit by digit from the top, each pass counting the keys at or above the
    threshold with every value of the next digit (the counts fall as the digit grows).
    """
    digits = jnp.arange(1, 2**_RADIX_BITS, dtype=jnp.uint32)[:, None]  # [2^r - 1, 1]
    threshold = jnp.zeros(keys.shape[1:], jnp.uint32)  # [E]
    for shift in range(32 - _RADIX_BITS, -1, -_RADIX_BITS):
        candidates = threshold | (digits << shift)  # [2^r - 1, E]
        counts = jnp.sum(keys[None] >= candidates[:, None], axis=1)  # [2^r - 1, E]
        digit = jnp.sum(counts >= rank, axis=0, dtype=jnp.uint32)  # the largest digit that holds
        threshold = threshold | (digit << shift)
    return threshold


def _minibatch_cutoff(values, valid, k, num_experts, num_minibatches):
    """Su's compromise: the exact cut-off of each contiguous mini-batch, averaged."""
    num_tokens = values.shape[0]
    if num_tokens % num_minibatches:
        raise ValueError(
            f"qb_minibatches={num_minibatches} must divide the token count {num_tokens}."
        )
    per_batch = jax.vmap(lambda v, m: _exact_cutoff(v, m, k, num_experts))(
        values.reshape(num_minibatches, -1, num_experts), valid.reshape(num_minibatches, -1)
    )
    has_tokens = jnp.any(valid.reshape(num_minibatches, -1), axis=1)
    total = jnp.sum(jnp.where(has_tokens[:, None], per_batch, 0.0), axis=0)
    return total / jnp.maximum(jnp.sum(has_tokens), 1)


def _histogram_cutoff(values, valid, k, num_experts, num_bins, axis_name):
    """The cut-off read off pooled fixed-bin counts; within one bin width of `_exact_cutoff`.

    Bin edges span the pooled [min, max] of the valid values, so they agree on every shard; only
    the [E, num_bins] counts and two scalars cross devices. The q-th and (q+1)-th largest values
    are each replaced by the centre of their bin.
    """
    low = _pmin(jnp.min(jnp.where(valid[:, None], values, jnp.inf)), axis_name)
    high = _pmax(jnp.max(jnp.where(valid[:, None], values, -jnp.inf)), axis_name)
    low = jnp.where(jnp.isfinite(low), low, 0.0)
    width = jnp.maximum((jnp.where(jnp.isfinite(high), high, 0.0) - low) / num_bins, 1e-12)
    bins = jnp.clip(jnp.floor((values - low) / width), 0, num_bins - 1).astype(jnp.int32)
    expert = jnp.broadcast_to(jnp.arange(num_experts), bins.shape)
    counts = jnp.zeros((num_experts, num_bins), jnp.int32)
    counts = counts.at[expert, bins].add(jnp.broadcast_to(valid[:, None], bins.shape))
    counts = _psum(counts, axis_name)
    q = (jnp.sum(counts[0]) * k) // num_experts
    # at_or_above[:, r]: values in the r+1 highest bins. The r-th largest value sits in the
    # highest bin where that count first reaches r.
    at_or_above = jnp.cumsum(counts[:, ::-1], axis=1)

    def bin_centre(rank):
        bin_index = num_bins - 1 - jnp.argmax(at_or_above >= rank, axis=1)
        return low + (bin_index.astype(jnp.float32) + 0.5) * width

    below = bin_centre(q + 1)
    return jnp.where(q > 0, (below + bin_centre(jnp.maximum(q, 1))) / 2, below)


def _flatten_tokens(scores, token_mask):
    num_experts = scores.shape[-1]
    flat = scores.reshape(-1, num_experts).astype(jnp.float32)
    if token_mask is None:
        return flat, jnp.ones(flat.shape[0], bool)
    if token_mask.shape != scores.shape[:-1]:
        raise ValueError(
            f"token_mask must have the token shape of scores {scores.shape[:-1]}, "
            f"got {token_mask.shape}."
        )
    return flat, token_mask.reshape(-1).astype(bool)


def _check_scores_bias(scores, bias):
    if scores.ndim < 2:
        raise ValueError(f"scores must be [T, E] (or [..., E]), got shape {scores.shape}.")
    if bias.shape != (scores.shape[-1],):
        raise ValueError(
            f"bias must be [E] with E = scores.shape[-1] = {scores.shape[-1]}, "
            f"got shape {bias.shape}."
        )


def _check_k(k, num_experts, name):
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= num_experts:
        raise ValueError(
            f"{name} must be an integer with 1 <= {name} <= E = {num_experts}, got {k!r}."
        )


def _gather_replicated(x, axis_name):
    """All shards' x concatenated along axis 0, typed as replicated over `axis_name`.

    A psum of zero-padded blocks, because `all_gather`'s result counts as varying under
    `shard_map`'s replication check and the new bias must be the same on every shard.
    """
    blocks = jnp.zeros((jax.lax.axis_size(axis_name),) + x.shape, x.dtype)
    blocks = blocks.at[jax.lax.axis_index(axis_name)].set(x)
    return jax.lax.psum(blocks, axis_name).reshape((-1,) + x.shape[1:])


def _psum(x, axis_name):
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmin(x, axis_name):
    return x if axis_name is None else jax.lax.pmin(x, axis_name)


def _pmax(x, axis_name):
    return x if axis_name is None else jax.lax.pmax(x, axis_name)
