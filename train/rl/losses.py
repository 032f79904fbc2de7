"""The policy-gradient losses of RL post-training, as pure functions.

Batch layout. P prompts with G rollouts each: row p * G + g of the per-token arrays [B, T]
(B = P * G) is rollout g of prompt p, and `rewards` [P, G] holds one reward per rollout. Per-token
arrays are aligned with the targets, as the train step's cross-entropy is: `logp[b, t]` is the
log-probability of token t + 1 of row b given the tokens before it. `loss_mask` [B, T] is 1 where
that token was sampled from the policy and 0 on prompt, tool-result and padding tokens.

Per token, with the importance ratio rho = exp(logp - logp_behaviour) against the policy that
sampled the rollout and the rollout's advantage A:

    loss_t = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A) + kl_coef * kl_t

aggregated over the tokens of the loss mask (`aggregate`). The algorithms (`RLLossConfig`) differ
in the advantage and in their defaults (d.s.: dynamic sampling):

| algorithm | advantage of rollout i in its group | clip low/high | aggregation | over-long | d.s. |
|-----------|-------------------------------------|---------------|-------------|-----------|------|
| grpo      | (r_i - mean r) / (std r + eps)      | 0.2 / 0.2     | sequence    | none      | off  |
| dr_grpo   | r_i - mean r                        | 0.2 / 0.2     | constant    | none      | off  |
| dapo      | as grpo                             | 0.2 / 0.28    | token       | filter    | on   |
| rloo      | r_i - mean of the other G - 1 r_j   | 0.2 / 0.2     | token       | none      | off  |

std is the unbiased sample deviation (ddof 1, as torch's default in TRL and verl), so groups need
G >= 2. A group whose rewards are all equal gets exactly zero advantage under every estimator
(no 0 / eps noise, no NaN). With dynamic sampling (DAPO) such a group is dropped from the loss
altogether, its tokens out of every normaliser; the rollout side may refill the batch instead.

The per-token log-probs come from `train.step`'s heads: `-cross_entropy(logits, targets)` for
logits [B, T, V], or `-chunked_lm_head_nll(hidden, kernel, targets, chunk_tokens)`, which never
holds the [B, T, V] logits. They equal the behaviour log-probs of `models.serving` only when the
rollouts sample from the model's own distribution (temperature 1, no top-k or top-p filtering).
"""

import dataclasses
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp

Algorithm = Literal["grpo", "dr_grpo", "dapo", "rloo"]
KLEstimator = Literal["none", "k1", "k3"]
Aggregation = Literal["token", "sequence", "constant"]
Overlong = Literal["none", "filter", "penalty"]
ALGORITHMS = typing.get_args(Algorithm)
KL_ESTIMATORS = typing.get_args(KLEstimator)
AGGREGATIONS = typing.get_args(Aggregation)
OVERLONG_MODES = typing.get_args(Overlong)

# Each algorithm's defaults for the fields left None (`RLLossConfig.resolved`).
_DEFAULTED_FIELDS = ("clip_low", "clip_high", "aggregation", "overlong", "dynamic_sampling")
_DEFAULTS = {
    "grpo": (0.2, 0.2, "sequence", "none", False),
    "dr_grpo": (0.2, 0.2, "constant", "none", False),
    "dapo": (0.2, 0.28, "token", "filter", True),
    "rloo": (0.2, 0.2, "token", "none", False),
}


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """The policy loss's settings; fields left None take the algorithm's defaults (module table).

    The fields keep None, and `resolved()` fills in the defaults where the settings are read, so
    that changing the algorithm (`dataclasses.replace`, or `--set rl.loss.algorithm=dapo` through
    `train.cli.apply_overrides`) gives the new algorithm's defaults for every field not set
    explicitly.

    algorithm: "grpo", "dr_grpo", "dapo" or "rloo": the advantage estimator and the defaults.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]; clip_low in
        (0, 1), clip_high > 0 (DAPO's clip-higher: clip_high > clip_low).
    kl: "none", or the per-token estimator of KL(policy || reference): "k1" (logp - logp_ref) or
        "k3" (exp(l) - l - 1 with l = logp_ref - logp: non-negative, lower variance).
    kl_coef: the KL term's weight; > 0 with an estimator, 0 without.
    aggregation: "token" (sum over all tokens of the batch / their number), "sequence" (each
        row's token mean, then the mean over rows with tokens) or "constant" (sum over all tokens
        / (B * normaliser_tokens): no length normalisation, Dr.GRPO).
    normaliser_tokens: the constant aggregation's tokens per row; None: the row length T.
    overlong: "none"; "filter" (rows marked `truncated` leave the loss, DAPO's over-long
        filtering); or "penalty" (DAPO's soft over-long punishment added to the rewards,
        `overlong_penalty` of the row's number of model tokens, with overlong_max_tokens and
        overlong_cache_tokens).
    dynamic_sampling: drop groups whose rewards are all equal from the loss (DAPO).
    std_epsilon: eps of GRPO's and DAPO's std normalisation, > 0.
    """

    algorithm: Algorithm = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    kl: KLEstimator = "none"
    kl_coef: float = 0.0
    aggregation: Aggregation | None = None
    normaliser_tokens: int | None = None
    overlong: Overlong | None = None
    overlong_max_tokens: int | None = None
    overlong_cache_tokens: int | None = None
    dynamic_sampling: bool | None = None
    std_epsilon: float = 1e-6

    def __post_init__(self):
        _require(self.algorithm in ALGORITHMS, "algorithm", self.algorithm,
                 f"one of {ALGORITHMS}")
        if self.resolved() is not self:
            return  # building the resolved config checked every setting
        _require(_is_real(self.clip_low) and 0 < self.clip_low < 1, "clip_low", self.clip_low,
                 "a number in (0, 1)")
        _require(_is_real(self.clip_high) and 0 < self.clip_high < math.inf, "clip_high",
                 self.clip_high, "a finite number > 0")
        _require(self.kl in KL_ESTIMATORS, "kl", self.kl, f"one of {KL_ESTIMATORS}")
        _require(_is_real(self.kl_coef) and 0 <= self.kl_coef < math.inf, "kl_coef",
                 self.kl_coef, "a finite number >= 0")
        if self.kl == "none":
            _require(self.kl_coef == 0, "kl_coef", self.kl_coef,
                     "0 when kl='none' (choose kl='k1' or 'k3' to use it)")
        else:
            _require(self.kl_coef > 0, "kl_coef", self.kl_coef,
                     f"> 0 with kl={self.kl!r} (or set kl='none')")
        _require(self.aggregation in AGGREGATIONS, "aggregation", self.aggregation,
                 f"one of {AGGREGATIONS}")
        if self.normaliser_tokens is not None:
            _require(self.aggregation == "constant", "normaliser_tokens",
                     self.normaliser_tokens, "None unless aggregation='constant'")
            _require(_is_count(self.normaliser_tokens), "normaliser_tokens",
                     self.normaliser_tokens, "a positive int")
        _require(self.overlong in OVERLONG_MODES, "overlong", self.overlong,
                 f"one of {OVERLONG_MODES}")
        for name in ("overlong_max_tokens", "overlong_cache_tokens"):
            value = getattr(self, name)
            if self.overlong == "penalty":
                _require(_is_count(value), name, value, "a positive int with overlong='penalty'")
            else:
                _require(value is None, name, value, "None unless overlong='penalty'")
        if self.overlong == "penalty":
            _require(self.overlong_cache_tokens <= self.overlong_max_tokens,
                     "overlong_cache_tokens", self.overlong_cache_tokens,
                     f"at most overlong_max_tokens={self.overlong_max_tokens}")
        _require(isinstance(self.dynamic_sampling, bool), "dynamic_sampling",
                 self.dynamic_sampling, "True or False")
        _require(_is_real(self.std_epsilon) and 0 < self.std_epsilon < math.inf, "std_epsilon",
                 self.std_epsilon, "a finite number > 0")

    def resolved(self) -> "RLLossConfig":
        """This config with each field left None set to the algorithm's default (module table):
        the settings the loss uses. Itself when no field is None."""
        defaults = {name: default
                    for name, default in zip(_DEFAULTED_FIELDS, _DEFAULTS[self.algorithm])
                    if getattr(self, name) is None}
        return dataclasses.replace(self, **defaults) if defaults else self


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _require(condition: bool, field: str, value, requirement: str) -> None:
    if not condition:
        raise ValueError(f"RLLossConfig.{field} must be {requirement}, got {value!r}")


def degenerate_groups(rewards: jax.Array) -> jax.Array:
    """bool [P]: the groups of rewards [P, G] whose rewards are all equal (no learning signal)."""
    return jnp.all(rewards == rewards[:, :1], axis=1)


def _zero_where_degenerate(advantages: jax.Array, rewards: jax.Array) -> jax.Array:
    """advantages [P, G] with the groups of equal rewards set to exactly 0 (their mean, a float
    sum divided by G, can differ from the rewards by an ulp)."""
    return jnp.where(degenerate_groups(rewards)[:, None], 0.0, advantages)


def _check_groups(rewards: jax.Array) -> None:
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [P prompts, G >= 2 rollouts], got shape "
                         f"{rewards.shape}; group-relative advantages need two rollouts a prompt")


def grpo_advantages(rewards: jax.Array, epsilon: float) -> jax.Array:
    """GRPO: (r - mean r) / (std r + epsilon) within each group. rewards [P, G] -> [P, G]; std
    with ddof 1."""
    _check_groups(rewards)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    std = jnp.std(rewards, axis=1, ddof=1, keepdims=True)
    return _zero_where_degenerate(centred / (std + epsilon), rewards)


def dr_grpo_advantages(rewards: jax.Array) -> jax.Array:
    """Dr.GRPO: r - mean r within each group, no std division. rewards [P, G] -> [P, G]."""
    _check_groups(rewards)
    return _zero_where_degenerate(rewards - rewards.mean(axis=1, keepdims=True), rewards)


def rloo_advantages(rewards: jax.Array) -> jax.Array:
    """RLOO: r_i minus the mean of the group's other G - 1 rewards. rewards [P, G] -> [P, G]."""
    _check_groups(rewards)
    group = rewards.shape[1]
    others = (rewards.sum(axis=1, keepdims=True) - rewards) / (group - 1)
    return _zero_where_degenerate(rewards - others, rewards)


def group_advantages(rewards: jax.Array, algorithm: Algorithm,
                     std_epsilon: float = 1e-6) -> jax.Array:
    """The advantages [P, G] of `algorithm` (DAPO uses GRPO's) for rewards [P, G]."""
    if algorithm in ("grpo", "dapo"):
        return grpo_advantages(rewards, std_epsilon)
    if algorithm == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if algorithm == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def overlong_penalty(lengths: jax.Array, max_tokens: int, cache_tokens: int) -> jax.Array:
    """DAPO's soft over-long punishment of responses of `lengths` [B] tokens, [B] in lengths'
    float dtype (float32 for integer lengths): 0 up to max_tokens - cache_tokens, then falling
    linearly to -1 at max_tokens, and -1 beyond."""
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.floating):
        lengths = lengths.astype(jnp.float32)
    start = max_tokens - cache_tokens
    ramp = (start - lengths) / cache_tokens
    return jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_tokens, ramp, -1.0))


def kl_estimate(logp: jax.Array, logp_reference: jax.Array, estimator: KLEstimator) -> jax.Array:
    """Per-token estimate [B, T] of KL(policy || reference) from the tokens' log-probs under each
    ([B, T]); with l = logp_reference - logp: "k1" -l, "k3" exp(l) - l - 1."""
    log_ratio = logp_reference - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return jnp.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")


def clipped_surrogate(log_ratio: jax.Array, advantages: jax.Array, clip_low: float,
                      clip_high: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's clipped objective as a per-token loss.

    log_ratio: [B, T] logp - logp_behaviour; advantages: [B] (one per rollout). Returns the loss
    -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) [B, T] and two bool [B, T]: where the
    clipped term is the smaller one and its gradient is cut, below the low bound (A < 0) and
    above the high bound (A > 0).
    """
    ratio = jnp.exp(log_ratio)
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return -jnp.minimum(unclipped, clipped), clipped_low, clipped_high


def aggregate(per_token: jax.Array, mask: jax.Array, aggregation: Aggregation,
              normaliser_tokens: int | None = None) -> jax.Array:
    """A scalar from per-token values [B, T] over mask [B, T] (0/1): "token" sum / number of
    tokens; "sequence" the mean over rows with tokens of each row's token mean; "constant" sum /
    (B * normaliser_tokens, default T). An empty mask gives 0."""
    total = jnp.sum(per_token * mask)
    if aggregation == "token":
        return total / jnp.maximum(jnp.sum(mask), 1.0)
    if aggregation == "sequence":
        row_tokens = jnp.sum(mask, axis=1)
        row_means = jnp.sum(per_token * mask, axis=1) / jnp.maximum(row_tokens, 1.0)
        return jnp.sum(row_means) / jnp.maximum(jnp.sum(row_tokens > 0), 1)
    if aggregation == "constant":
        rows, length = per_token.shape
        return total / (rows * (length if normaliser_tokens is None else normaliser_tokens))
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _batch_array(batch: dict, key: str, why: str, shape: tuple | None = None) -> jax.Array:
    """batch[key] as an array, checked against `shape`; errors name the key and `why`."""
    if key not in batch:
        raise KeyError(f"policy_loss: the batch needs {key!r} {why}; it has {sorted(batch)}")
    value = jnp.asarray(batch[key])
    if shape is not None and value.shape != shape:
        raise ValueError(f"policy_loss: batch[{key!r}] must have shape {shape} ({why}), got "
                         f"{value.shape}")
    return value


def policy_loss(config: RLLossConfig, logp: jax.Array,
                batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The RL loss of the policy's per-token log-probs, and its metrics.

    logp: [B, T] float, log-probs of the rollouts' tokens under the policy being trained (the
    only input with a gradient). batch (module docstring's layout):
        logp_behaviour [B, T]: the tokens' log-probs under the policy that sampled them;
        loss_mask [B, T]: 1 on the policy's tokens, 0 on prompt, tool and padding tokens;
        rewards [P, G] with P * G = B;
        logp_reference [B, T]: under the frozen reference policy (only with a KL estimator);
        truncated [B] bool: rows cut at the length limit (only with overlong="filter").
    Positions outside the mask never enter the arithmetic, so any value there (even -inf) is safe.

    Returns the scalar loss and float32 scalar metrics: pg_loss and kl (aggregated as the loss;
    kl 0 without an estimator), tokens (in the loss), clip_low_fraction and clip_high_fraction
    (of those tokens, where the clip cut the gradient), ratio_mean, ratio_max, reward_mean (after
    any over-long penalty), advantage_abs_mean (over rollouts), degenerate_groups (all rewards
    equal), dropped_groups (by dynamic sampling), filtered_rows (truncated rows left out).
    """
    config = config.resolved()
    rows, length = logp.shape
    aligned = "aligned with logp [B, T]"
    behaviour = _batch_array(batch, "logp_behaviour", aligned, (rows, length))
    mask = _batch_array(batch, "loss_mask", aligned, (rows, length)).astype(logp.dtype)
    rewards = _batch_array(batch, "rewards", f"[P, G] with P * G = {rows}").astype(logp.dtype)
    if rewards.ndim != 2 or rewards.shape[0] * rewards.shape[1] != rows:
        raise ValueError(f"policy_loss: batch['rewards'] must be [P, G] with P * G = {rows} "
                         f"rows of logp, got shape {rewards.shape}")
    prompts, group = rewards.shape
    filtered_rows = jnp.zeros((), jnp.float32)
    if config.overlong == "penalty":
        lengths = jnp.sum(mask, axis=1)
        penalty = overlong_penalty(lengths, config.overlong_max_tokens,
                                   config.overlong_cache_tokens)
        rewards = rewards + penalty.reshape(prompts, group)
    elif config.overlong == "filter":
        truncated = _batch_array(batch, "truncated", "[B] with overlong='filter'",
                                 (rows,)).astype(bool)
        filtered_rows = jnp.sum(truncated & (jnp.sum(mask, axis=1) > 0)).astype(jnp.float32)
        mask = mask * (~truncated)[:, None]
    degenerate = degenerate_groups(rewards)
    dropped = jnp.zeros((prompts,), bool)
    if config.dynamic_sampling:
        dropped = degenerate
        mask = mask * jnp.repeat(~dropped, group)[:, None]
    advantages = group_advantages(rewards, config.algorithm, config.std_epsilon).reshape(rows)

    used = mask > 0
    log_ratio = jnp.where(used, logp - behaviour.astype(logp.dtype), 0.0)
    surrogate, clipped_low, clipped_high = clipped_surrogate(
        log_ratio, advantages, config.clip_low, config.clip_high)
    pg_loss = aggregate(surrogate, mask, config.aggregation, config.normaliser_tokens)
    kl = jnp.zeros((), logp.dtype)
    if config.kl != "none":
        reference = _batch_array(batch, "logp_reference", f"{aligned} with kl={config.kl!r}",
                                 (rows, length)).astype(logp.dtype)
        per_token_kl = kl_estimate(jnp.where(used, logp, 0.0), jnp.where(used, reference, 0.0),
                                   config.kl)
        kl = aggregate(per_token_kl, mask, config.aggregation, config.normaliser_tokens)
    loss = pg_loss + config.kl_coef * kl

    tokens = jnp.sum(mask)
    token_mean = lambda values: jnp.sum(values * mask) / jnp.maximum(tokens, 1.0)  # noqa: E731
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    metrics = dict(
        pg_loss=pg_loss,
        kl=kl,
        tokens=tokens,
        clip_low_fraction=token_mean(clipped_low),
        clip_high_fraction=token_mean(clipped_high),
        ratio_mean=token_mean(ratio),
        ratio_max=jnp.max(jnp.where(used, ratio, 0.0), initial=0.0),
        reward_mean=jnp.mean(rewards),
        advantage_abs_mean=jnp.mean(jnp.abs(advantages)),
        degenerate_groups=jnp.sum(degenerate),
        dropped_groups=jnp.sum(dropped),
        filtered_rows=filtered_rows,
    )
    metrics = {name: jax.lax.stop_gradient(value).astype(jnp.float32)
               for name, value in metrics.items()}
    return loss, metrics
