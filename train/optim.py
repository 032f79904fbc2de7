"""Optimizers and learning-rate schedules: AdamW, Muon (optionally per attention head), WSD and
cosine schedules, global-norm clipping.

    tx = make_optimizer(OptimConfig(optimizer="muon"), params, total_steps=1000)

`params` is the model's `nnx.Param` state (concrete or abstract): its logical axis names decide
each parameter's role (`param_role`):

- "matrix": a linear map between feature spaces. Muon orthogonalises its update (when the
  optimizer is Muon) and weight decay applies.
- "embedding": the token embedding and the LM head (a "vocab" axis). AdamW, with weight decay
  (Muon's orthogonal updates suit hidden matrices, not lookup tables or the output classifier).
- "vector": norm gains, biases, gate offsets, depthwise-convolution taps. AdamW, no decay.

Muon follows the Kimi K2 report: Nesterov momentum, five Newton-Schulz steps, the update
rescaled by 0.2·sqrt(max(fan_in, fan_out)) so its RMS matches AdamW's and one learning rate serves
both. The matrix of a parameter: "expert" axes (and scan-stacked layer axes) are batch axes, each
slice orthogonalised alone; an array ending in "embed" maps everything before it to the residual
stream; otherwise the first axis is the input. `muon_per_head` also makes the "heads" axis of
[.., heads, ..] attention projections a batch axis (K3's per-head Muon: one head's large
gradient no longer sets the scale of every head's update).
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

ParamRole = Literal["matrix", "embedding", "vector"]
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("wsd", "cosine", "constant")
# Parameters that have two axes but are not maps between feature spaces: the depthwise
# convolution's taps [conv, channels] and the per-channel gate bias [heads, head_dim] of KDA.
NON_MATRIX_NAMES = frozenset({"conv_weight", "dt_bias"})
# K2's Muon: the RMS of an orthogonalised update is 1/sqrt(max(fan_in, fan_out)); scaling by
# 0.2·sqrt(max(...)) gives AdamW's typical update RMS of about 0.2.
MUON_RMS = 0.2
FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer, schedule and clipping.

    optimizer: "adamw", or "muon" (Muon on matrices, AdamW on the rest).
    learning_rate: peak learning rate (both parts of Muon share it, see the module docstring).
    schedule: "wsd" (linear warmup, constant, linear decay over the last `decay_fraction` of
        the steps), "cosine" (warmup, then cosine decay to the end), "constant" (warmup only).
    warmup_steps: linear warmup to the peak (step i of it at (i + 1) / warmup_steps of it).
    decay_fraction: share of the steps in WSD's final decay.
    min_lr_ratio: final learning rate as a fraction of the peak (WSD and cosine).
    weight_decay: decoupled weight decay of matrices and embeddings.
    b1, b2, eps: AdamW moments.
    clip_norm: clip the gradient to this global norm before the update; None turns it off.
    muon_momentum: Muon's Nesterov momentum.
    muon_per_head: orthogonalise each attention head's slice of [.., heads, ..] projections alone.
    qk_clip: after each step, shrink the query/key weights of MLA heads whose largest attention
        logit exceeded `qk_clip_tau` (Kimi K2's QK-Clip; see `train.step`).
    qk_clip_tau: the logit threshold.
    """

    optimizer: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = 3e-3
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = 50
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    muon_momentum: float = 0.95
    muon_per_head: bool = True
    qk_clip: bool = False
    qk_clip_tau: float = 100.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"OptimConfig.optimizer must be one of {OPTIMIZERS}, got "
                             f"{self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule must be one of {SCHEDULES}, got "
                             f"{self.schedule!r}")
        for name, value in dataclasses.asdict(self).items():
            # inf and nan slip through the comparisons below (inf > 0 holds); a value past
            # float32's range is inf once the step casts it.
            if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:  # False for nan
                raise ValueError(
                    f"OptimConfig.{name} must be a finite float32 number, got {value!r}"
                )
        checks = {
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "decay_fraction": (0.0 <= self.decay_fraction <= 1.0, "in [0, 1]"),
            "min_lr_ratio": (0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "b1": (0.0 <= self.b1 < 1.0, "in [0, 1)"),
            "b2": (0.0 <= self.b2 < 1.0, "in [0, 1)"),
            "eps": (self.eps > 0, "> 0"),
            "clip_norm": (self.clip_norm is None or self.clip_norm > 0, "> 0 or None"),
            "muon_momentum": (0.0 <= self.muon_momentum < 1.0, "in [0, 1)"),
            "qk_clip_tau": (self.qk_clip_tau > 0, "> 0"),
        }
        for name, (ok, expected) in checks.items():
            if not ok:
                raise ValueError(
                    f"OptimConfig.{name} must be {expected}, got {getattr(self, name)!r}"
                )


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate at each step (0-based) of a `total_steps` run.

    Warmup: step i < warmup_steps runs at (i + 1) / warmup_steps of the peak (the first step
    already moves). The decay of WSD and cosine ends at min_lr_ratio · peak on the last step.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    peak, final = cfg.learning_rate, cfg.min_lr_ratio
    warmup = max(min(cfg.warmup_steps, total_steps), 1)
    decay_steps = max(round(cfg.decay_fraction * total_steps), 1)

    def schedule(step):
        done = jnp.asarray(step, jnp.float32) + 1.0  # steps finished after this one
        warm = jnp.minimum(done / warmup, 1.0)
        if cfg.schedule == "wsd":
            progress = jnp.clip((done - (total_steps - decay_steps)) / decay_steps, 0.0, 1.0)
            shape = 1.0 - (1.0 - final) * progress
        elif cfg.schedule == "cosine":
            progress = jnp.clip((done - warmup) / max(total_steps - warmup, 1), 0.0, 1.0)
            shape = final + (1.0 - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        else:
            shape = 1.0
        return peak * warm * shape

    return schedule


def _path_names(path) -> Path:
    """A jax key path (or an nnx state path) as a tuple of strings."""
    return tuple(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def _parameters(params: nnx.State, stacked_axes: Callable[[Path], int]):
    """(path, number of stacked axes, logical names of the other axes) of each parameter."""
    for path, variable in nnx.to_flat_state(params):
        path = _path_names(path)
        names = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
        num_stacked = stacked_axes(path)
        yield path, num_stacked, tuple(names)[num_stacked:]


def param_role(name: str, names: tuple[str | None, ...]) -> ParamRole:
    """The role of parameter `name` whose (unstacked) axes have logical `names`."""
    if "vocab" in names:
        return "embedding"
    if len(names) < 2 or name in NON_MATRIX_NAMES:
        return "vector"
    return "matrix"


def muon_dimension_numbers(
    num_stacked: int, names: tuple[str | None, ...], per_head: bool
) -> MuonDimensionNumbers:
    """Reduction and output axes of a matrix parameter whose axes after `num_stacked` stacked
    ones have logical `names`; every other axis is a batch axis (see the module docstring)."""
    batch = {"expert", "heads"} if per_head and "heads" in names and len(names) > 2 else {"expert"}
    matrix_axes = [num_stacked + i for i, name in enumerate(names) if name not in batch]
    if len(matrix_axes) > 1 and names[matrix_axes[-1] - num_stacked] == "embed":
        reduction, output = matrix_axes[:-1], matrix_axes[-1:]
    else:
        reduction, output = matrix_axes[:1], matrix_axes[1:]
    return MuonDimensionNumbers(tuple(reduction), tuple(output))


def _matrix_shape(x, dims: MuonDimensionNumbers) -> tuple[int, int]:
    """(fan_in, fan_out) of one matrix of parameter x."""
    fan_in = math.prod(x.shape[axis] for axis in dims.reduction_axis)
    return fan_in, math.prod(x.shape[axis] for axis in dims.output_axis)


def _scale_to_adamw_rms(dimension_numbers) -> optax.GradientTransformation:
    """Multiplies each orthogonalised update by MUON_RMS·sqrt(max(fan_in, fan_out)).

    dimension_numbers: tree -> the tree of each parameter's MuonDimensionNumbers.
    """

    def scale_one(update, dims):
        if isinstance(update, optax.MaskedNode):
            return update
        return update * (MUON_RMS * math.sqrt(max(_matrix_shape(update, dims))))

    def scale(updates, params=None):
        del params
        return jax.tree.map(
            scale_one,
            updates,
            dimension_numbers(updates),
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )

    return optax.stateless(scale)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm`, reusing the norm when the caller already has it.

    `update(..., grad_norm=n)` clips with n, the caller's `optax.tree.norm` of the same updates,
    instead of reading every gradient again: `train.step` computes the norm for its non-finite
    check before the update runs under `lax.cond`, where XLA cannot share it (it would be one
    more read of every float32 gradient). Without it, computed here.
    """

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        unclipped = norm < max_norm

        def clip(t):
            return jax.lax.select(unclipped, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(
    cfg: OptimConfig,
    params: nnx.State,
    total_steps: int,
    stacked_axes: Callable[[Path], int] = lambda path: 0,
) -> optax.GradientTransformation:
    """The optax transformation of `cfg` for `params` (their logical axis names and paths decide
    each one's treatment; see the module docstring). Clipping comes first; its update takes the
    gradient norm as `grad_norm=` when the caller has it (`clip_by_global_norm`)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    use_muon = cfg.optimizer == "muon"
    labels, dims = {}, {}
    for path, num_stacked, names in _parameters(params, stacked_axes):
        role = param_role(path[-1], names)
        if role == "matrix" and use_muon:
            labels[path] = "muon"
            dims[path] = muon_dimension_numbers(num_stacked, names, cfg.muon_per_head)
        else:
            labels[path] = "adamw_no_decay" if role == "vector" else "adamw"

    def by_path(lookup: Mapping[Path, object]):
        def tree_fn(tree):
            def leaf(path, x):
                if isinstance(x, optax.MaskedNode):
                    return x
                return lookup[_path_names(path)]

            return jax.tree_util.tree_map_with_path(
                leaf, tree, is_leaf=lambda x: isinstance(x, (nnx.Variable, optax.MaskedNode))
            )

        return tree_fn

    adamw = dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    transforms = {
        "adamw": optax.adamw(schedule, weight_decay=cfg.weight_decay, **adamw),
        "adamw_no_decay": optax.adamw(schedule, weight_decay=0.0, **adamw),
    }
    if use_muon:
        transforms["muon"] = optax.chain(
            scale_by_muon(beta=cfg.muon_momentum, weight_dimension_numbers=by_path(dims)),
            _scale_to_adamw_rms(by_path(dims)),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    tx = optax.partition(transforms, by_path(labels))
    if cfg.clip_norm is not None:
        tx = optax.chain(clip_by_global_norm(cfg.clip_norm), tx)
    return tx
