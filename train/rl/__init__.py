"""Agentic RL post-training on our own trainer.

- `train.rl.losses`: group-relative advantages (GRPO, Dr.GRPO, RLOO), the clipped policy-gradient
  objective against the behaviour policy's per-token log-probs (DAPO's clip-higher, token-level,
  sequence-level and constant aggregation), KL to a frozen reference (k1, k3), DAPO's over-long
  filtering or penalty and dynamic sampling; `RLLossConfig` and `policy_loss`, the train step's
  entry.
- `train.rl.learner`: `make_rl_step`, `train.step.make_train_step` with `policy_loss` as its
  per-token objective (`token_loss`); `train.step.make_token_logp` gives the reference and
  behaviour policies' per-token log-probs.
- `train.rl.rollout`: multi-turn rollouts on `models.serving`'s engine: groups of G trajectories
  per prompt (sharing the prompt's prefill), the model's tokens sampled, tool results appended as
  forced tokens to a paused sequence (no re-prefill of the conversation), per-token loss mask,
  behaviour log-probs and policy versions; partial rollouts (a per-iteration token budget, a
  checkpointable `RolloutBuffer`, bounded staleness); `make_batch`, the learner's batch.
- `train.rl.tools`: the tool-call syntax of the byte vocabulary (`<c>37*12</c><r>444</r>`), its
  parser, the calculator, the "notes" search over the embedded corpus and injected tool failures.
- `train.rl.sandbox`: the Python tool, a `python -I -S` subprocess with resource limits, a wall
  timeout and, where the kernel offers them, Landlock and a network namespace.
- `train.rl.arithmetic`: the verifiable task: seeded multi-step arithmetic chains solved with one
  calculator call a step, their verifier (`grade`, `reward`), the notes variant for long
  trajectories, warm-start traces in the rollouts' byte format and mask, and `Curriculum`, the
  RL stream of problems with the number of steps raised stage by stage.
- `train.rl.loop`: the RL loop, `train_rl`: iteration after iteration, rollouts of the current
  policy on a fresh engine and one learner step on the finished groups; every tool failure,
  over-length trajectory and all-equal-reward group counted in the metrics; checkpoints of the
  policy, reference, optimizer, rollout buffers and data position that resume exactly.
  `python -m experiments.agentic_rl` runs it on the arithmetic task.

Why our own learner and not Tunix (the JAX RL library): Tunix would add about 60 packages and
750 MB to every set-up and its next release caps jax below the version we pin; its loss drops the
model's second output, the router statistics, so Quantile Balancing's bias update, the auxiliary
loss and QK-Clip would not run; and its rollout renders and re-prefills the whole conversation
every turn, throwing away KDA's constant-size state and the paged latent cache. A learner of our
own is a few pure functions fed to `train.step`'s machinery (optimizers, QB, QK-Clip, finite
checks, checkpoints), and its rollouts run on `models.serving`. Ideas borrowed from Tunix, verl,
slime and AReaL; the code is ours.
"""
