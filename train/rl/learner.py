"""The RL learner's step: `train.step`'s training step on the policy loss.

    step = make_rl_step(graphdef, RLLossConfig("grpo"), loss_chunk_tokens=256)
    state, metrics = step(state, batch)    # batch: tokens, segment_ids, targets, loss_mask [B, T],
                                           # logp_behaviour [B, T], rewards [P, G], ...

The step is `make_train_step` with `policy_loss` as its per-token objective, so the router-bias
update (Quantile Balancing), the MoE auxiliary loss, QK-Clip, the optimizers, the finite checks
and the checkpoints of supervised training all apply unchanged. The batch layout is
`train.rl.losses`'; the reference and behaviour log-probs come from `train.step.make_token_logp`.
"""

import functools

from flax import nnx

from train.rl.losses import RLLossConfig, policy_loss
from train.step import make_train_step


def make_rl_step(graphdef: nnx.GraphDef, config: RLLossConfig, **train_step_options):
    """The jitted `(state, batch) -> (new state, metrics)` of a split `TrainState` on
    `policy_loss(config, logp, batch)`; train_step_options: `make_train_step`'s (qk_clip_tau,
    loss_chunk_tokens, state_shardings, compiler_options). Metrics: the step's (loss is the
    policy loss) and `policy_loss`'s."""
    if not isinstance(config, RLLossConfig):
        raise TypeError(f"config must be a train.rl.losses.RLLossConfig, got "
                        f"{type(config).__name__}")
    return make_train_step(graphdef, token_loss=functools.partial(policy_loss, config),
                           **train_step_options)
