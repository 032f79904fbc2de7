"""The RL loop: rollouts on the serving engine and GRPO-family steps on the trainer, iteration
after iteration, every failure of a trajectory handled and counted, checkpoints that resume
exactly.

    config = RLConfig(train=TrainConfig(model=preset("tiny"), optim=..., steps=40),
                      loss=RLLossConfig("grpo"), rollout=RolloutConfig(group_size=8, ...),
                      prompts_per_iteration=8)
    environment = ToolEnvironment(task.tools(busy_probability=0.1))
    result = train_rl(config, curriculum, environment, "runs/rl",
                      policy=nnx.state(warm_started_model))
    result = train_rl(config, curriculum, environment, "runs/rl", resume=True)  # after a stop

The task (`RLTask`, e.g. `train.rl.arithmetic.Curriculum`) is a stream of prompts with a
verifier: `prompt(i)` and `reward(i, completion)`. Iteration v (the policy version v):

1. An engine holding the current policy (`make_engine`; its MoE expert weights in the compute
   dtype, `rollout_policy`) samples G trajectories of each of the
   next P prompts and continues the unfinished ones of earlier iterations
   (`train.rl.rollout.rollout`: tool turns, limits, partial rollouts with a token budget).
2. Finished groups join the ready queue; the oldest P of them are the learner's batch
   (`make_batch`, padded to P groups so that the step compiles once), rewards from the task;
   with a KL term the frozen reference policy's log-probs join it.
3. One `make_rl_step` step (none in an iteration that finishes no group).

Group ids are prompt indices (both count from 0, P an iteration), so the rollout buffer's next
group id is the position in the task's stream.

Failures never stop the run; each is counted in the iteration's metrics row:
    tool_errors_<kind>: tool results that are failures, by `ToolResult.error` (busy: injected,
        crash: the tool raised, timeout: the sandbox's wall or CPU limit, malformed: a call the
        syntax cannot read, unavailable: an unknown tool, calculator: a refused expression...),
        each answered with an "ERR ..." result the trajectory goes on from;
    finish_length, finish_turns (`rollout_metrics`): trajectories cut by the length or the turn
        limit (`truncated` in the batch; DAPO's over-long filtering drops them);
    equal_reward_groups: groups of the batch whose rewards are all equal: zero advantage, so no
        gradient from them (dropped from the loss with dynamic sampling);
    skipped: the step's finite checks threw a non-finite step away (`train.step`).

Checkpoints (`train.checkpoint.Checkpointer` in run_dir/checkpoints) hold the policy's whole
train state (parameters, router biases, optimizer), the reference policy (with a KL term), the
rollout buffer and the ready queue (`RolloutBuffer`s, their shapes in the metadata), the
iteration and every injected-failure tool's call count (`FlakyTool.calls`, its only state).
Sampling seeds derive from the rollout config's seed and the group ids, so a resumed run
computes what the uninterrupted run computes, bit for bit on one device.
"""

import collections
import dataclasses
import json
import os
import resource
import time
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from models.lm import HybridLM
from models.serving import Engine
from train.checkpoint import Checkpointer, abstract_like
from train.cli import config_dict
from train.loop import TrainConfig, Trainer, check_health
from train.metrics import MetricsWriter, read_metrics
from train.optim import learning_rate_schedule
from train.rl.learner import make_rl_step
from train.rl.losses import RLLossConfig
from train.rl.rollout import (RolloutBuffer, RolloutConfig, ToolEnvironment, Trajectory,
                              make_batch, rollout, rollout_metrics)
from train.rl.tools import FlakyTool, ToolResult
from train.step import make_token_logp, state_path_key

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
_BUFFERS = ("rollouts", "ready")  # the checkpoint's RolloutBuffers: unfinished groups, ready ones


class RLTask(Protocol):
    """A stream of prompts and their verifier."""

    def prompt(self, index: int) -> np.ndarray:
        """int32 [n]: prompt `index`'s token ids."""

    def reward(self, index: int, completion: np.ndarray) -> float:
        """The reward of `completion` (int32 token ids after the prompt) of prompt `index`."""


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """An RL run.

    train: the learner: model, optim (the RL optimizer and learning rate), mesh, steps (the
        iterations: the learning-rate schedule spans them), checkpoint_every and
        keep_checkpoints (in iterations), fast_compile, loss_chunk_tokens, progress,
        max_consecutive_skips; its data and evaluation fields are not used.
    loss: the policy loss (GRPO, Dr.GRPO, DAPO, RLOO; KL to the reference or none).
    rollout: how trajectories are sampled (group size G, limits, token budget, seed).
    prompts_per_iteration: P, new prompts an iteration, and groups a learner batch.
    slots, page_size, prefill_chunk_tokens: the engine's (`models.serving.Engine`); its page
        pool holds every slot at rollout.max_length, so no sequence is ever preempted.
    """

    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    loss: RLLossConfig = dataclasses.field(default_factory=RLLossConfig)
    rollout: RolloutConfig = dataclasses.field(
        default_factory=lambda: RolloutConfig(group_size=8, max_length=256))
    prompts_per_iteration: int = 8
    slots: int = 64
    page_size: int = 16
    prefill_chunk_tokens: int = 64

    def __post_init__(self):
        for name in ("prompts_per_iteration", "slots", "page_size", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.rollout.group_size < 2:
            raise ValueError(f"RLConfig.rollout.group_size must be at least 2 (group-relative "
                             f"advantages), got {self.rollout.group_size}")

    @property
    def iterations(self) -> int:
        return self.train.steps


def make_engine(model: HybridLM, config: RLConfig) -> Engine:
    """An idle engine of `model` for rollouts of `config` (prefix sharing on: a group's members
    share their prompt's prefill)."""
    pages = -(-config.rollout.max_length // config.page_size)
    return Engine(model, slots=config.slots, num_pages=config.slots * pages + 1,
                  page_size=config.page_size, max_seq_len=config.rollout.max_length,
                  prefill_chunk_tokens=config.prefill_chunk_tokens, prefix_sharing=True)


def rollout_policy(trainer: Trainer) -> HybridLM:
    """The policy the engine samples with: the trainer's model with each MoE expert weight
    replaced by its compute copy (`train.step.TrainState.compute_copies`: the weight rounded to
    the compute dtype, rewritten by every learner step). The engine then reads bf16 expert weights
    instead of casting the float32 masters at every decode step, and computes exactly what the
    float32 model computes under bf16 compute (the model casts those weights itself). A model
    stored in its compute dtype has no copies: its own parameters."""
    train_state = nnx.merge(trainer.graphdef, trainer.state)
    model = train_state.model
    copies = {key: copy[...] for key, copy in train_state.compute_copies.items()}
    if not copies:
        return model
    graphdef, state = nnx.split(model)

    def read(path, value):
        key = state_path_key(tuple(part.key for part in path
                                   if isinstance(part, jax.tree_util.DictKey)))
        return copies.get(key, value)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(read, state))


class CountingEnvironment:
    """A `ToolEnvironment` that counts its results by kind: "ok", or the failure's
    `ToolResult.error` ("busy", "crash", "timeout", "malformed", ...)."""

    def __init__(self, environment: ToolEnvironment):
        self.environment = environment
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def pause_sequences(self) -> tuple[tuple[int, ...], ...]:
        return self.environment.pause_sequences

    def respond(self, turn: np.ndarray) -> tuple[np.ndarray, ToolResult]:
        forced, result = self.environment.respond(turn)
        self.counts[result.error or "ok"] += 1
        return forced, result


def _groups(buffer: RolloutBuffer) -> list[list[Trajectory]]:
    """The buffer's trajectories as groups, in group order, members in order."""
    groups: dict[int, list[Trajectory]] = {}
    for t in buffer.trajectories():
        groups.setdefault(t.group, []).append(t)
    return [sorted(members, key=lambda t: t.member) for _, members in sorted(groups.items())]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Position:
    """The checkpoint's JSON item (grain's iterator interface, which `Checkpointer` saves):
    the iteration and each `FlakyTool`'s call count."""

    def __init__(self, run: "RLRun"):
        self.run = run

    def get_state(self) -> dict:
        return {"iteration": self.run.iteration,
                "tool_calls": {tag: tool.calls for tag, tool in self.run.flaky_tools.items()}}

    def set_state(self, state: dict) -> None:
        if set(state["tool_calls"]) != set(self.run.flaky_tools):
            raise ValueError(f"the checkpoint counts the calls of the tools "
                             f"{sorted(state['tool_calls'])} with injected failures, the run "
                             f"has {sorted(self.run.flaky_tools)}; resume with the same tools")
        self.run.iteration = int(state["iteration"])
        for tag, calls in state["tool_calls"].items():
            self.run.flaky_tools[tag].calls = int(calls)


class RLRun:
    """A built RL run: the trainer (policy and optimizer), the frozen reference, the buffers,
    the environment and the compiled steps. `iterate` runs one iteration; `save` and `restore`
    checkpoint it (module docstring)."""

    def __init__(self, config: RLConfig, task: RLTask, environment: ToolEnvironment,
                 trainer: Trainer):
        self.config, self.task, self.trainer = config, task, trainer
        self.environment = CountingEnvironment(environment)
        self.flaky_tools = {tag: tool for tag, tool in environment.tools.items()
                            if isinstance(tool, FlakyTool)}
        self.iteration = 0
        self.rollouts = RolloutBuffer.of([], 0)
        self.ready = RolloutBuffer.of([], 0)
        self.reference: nnx.State | None = None
        self.batch_groups: list[list[Trajectory]] = []
        self.schedule = learning_rate_schedule(config.train.optim, config.train.steps)
        self.step_fn = make_rl_step(trainer.graphdef, config.loss,
                                    loss_chunk_tokens=config.train.loss_chunk_tokens,
                                    state_shardings=trainer.shardings,
                                    compiler_options=trainer.compiler_options)
        self.reference_logp = (None if config.loss.kl == "none" else make_token_logp(
            nnx.graphdef(trainer.model), loss_chunk_tokens=config.train.loss_chunk_tokens,
            compiler_options=trainer.compiler_options))

    @classmethod
    def start(cls, config: RLConfig, task: RLTask, environment: ToolEnvironment,
              policy: nnx.State) -> "RLRun":
        """A run at iteration 0 whose policy (and reference) is the model state `policy`
        (`nnx.state(model)` of a HybridLM of config.train.model), with a fresh optimizer."""
        trainer = Trainer.create(config.train)
        merged = nnx.merge(trainer.graphdef, trainer.state)
        nnx.update(merged.model, jax.tree.map(jnp.copy, policy))  # the step donates its state
        merged.refresh_compute_copies()
        trainer.state = jax.device_put(nnx.state(merged), trainer.shardings)
        run = cls(config, task, environment, trainer)
        if config.loss.kl != "none":
            run.reference = jax.tree.map(jnp.copy, trainer.state["model"])
        return run

    @property
    def model(self) -> HybridLM:
        """The current policy (shares the train state's arrays)."""
        return self.trainer.model

    def rollout_engine(self) -> Engine:
        """An idle engine of the policy the next iteration samples with (`rollout_policy`): a
        warm-up that runs one compiles the programs of every iteration's engine (the same
        parameter dtypes; the masters of a bf16-compute model would compile others)."""
        return make_engine(rollout_policy(self.trainer), self.config)

    @property
    def next_prompt(self) -> int:
        """The index of the task's next prompt (= the next group id)."""
        return int(self.rollouts.next_group)

    def iterate(self) -> dict:
        """One iteration (module docstring); returns its metrics row, numbers only. The groups
        trained on stay in `batch_groups`."""
        config, version = self.config, self.iteration
        clock, cpu = time.perf_counter(), _cpu_seconds()
        self.environment.counts.clear()
        first = self.next_prompt
        prompts = [self.task.prompt(i) for i in range(first, first + config.prompts_per_iteration)]
        finished, self.rollouts = rollout(self.rollout_engine(), prompts, config.rollout,
                                          self.environment, version=version,
                                          buffer=self.rollouts)
        ready = _groups(self.ready) + finished
        self.batch_groups = ready[:config.prompts_per_iteration]
        waiting = ready[config.prompts_per_iteration:]
        self.ready = RolloutBuffer.of([t for group in waiting for t in group], 0)
        row = {"step": version + 1, "next_prompt": self.next_prompt,
               "groups_finished": len(finished), "groups_waiting": len(waiting),
               "trajectories_unfinished": len(self.rollouts),
               "tool_results": sum(self.environment.counts.values())}
        row.update({f"tool_errors_{kind}": count
                    for kind, count in sorted(self.environment.counts.items()) if kind != "ok"})
        row["rollout_seconds"] = time.perf_counter() - clock
        if self.batch_groups:
            row.update(self._learn(self.batch_groups, version))
        self.iteration += 1
        row.update(seconds=time.perf_counter() - clock, cpu_seconds=_cpu_seconds() - cpu)
        return row

    def _learn(self, groups: list[list[Trajectory]], version: int) -> dict:
        """One learner step on `groups` (at most P); its metrics."""
        config = self.config
        rewards = np.array([[self.task.reward(t.group, t.tokens[t.prompt_length:])
                             for t in group] for group in groups], np.float32)
        by_trajectory = {(t.group, t.member): float(r)
                         for group, values in zip(groups, rewards) for t, r in zip(group, values)}
        batch = make_batch(groups, lambda t: by_trajectory[t.group, t.member],
                           length=config.rollout.max_length - 1,
                           num_groups=config.prompts_per_iteration)
        if self.reference_logp is not None:
            batch["logp_reference"] = np.asarray(self.reference_logp(self.reference, batch))
        learner_step = int(self.trainer.state["optimizer"]["step"][...])
        with jax.set_mesh(self.trainer.mesh):
            self.trainer.state, metrics = self.step_fn(self.trainer.state,
                                                       self.trainer.place(batch))
        row = {name: float(value) for name, value in jax.device_get(metrics).items()
               if np.ndim(value) == 0}
        row.update(rollout_metrics(groups, version))
        row.update(learning_rate=float(self.schedule(learner_step)), groups_trained=len(groups),
                   reward=float(rewards.mean()),
                   equal_reward_groups=int(np.all(rewards == rewards[:, :1], axis=1).sum()))
        return row

    # Checkpoints.

    def _tree(self) -> dict:
        tree = {"policy": self.trainer.state, "rollouts": self.rollouts, "ready": self.ready}
        if self.reference is not None:
            tree["reference"] = self.reference
        return tree

    def save(self, checkpointer: Checkpointer, metadata: dict | None = None) -> None:
        """Starts checkpoint `self.iteration` (written in the background)."""
        shapes = {name: {field: list(np.shape(value)) for field, value in
                         dataclasses.asdict(getattr(self, name)).items()} for name in _BUFFERS}
        checkpointer.save(self.iteration, self._tree(), _Position(self),
                          metadata={**(metadata or {}), "buffer_shapes": shapes})

    def restore(self, checkpointer: Checkpointer, step: int | None = None) -> dict:
        """Loads checkpoint `step` (default: the newest) into this run; returns its metadata.
        Raises FileNotFoundError without a checkpoint, `CheckpointError` for a damaged one."""
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpointer.directory}")
        shapes = checkpointer.metadata(step)["buffer_shapes"]
        empty = RolloutBuffer.of([], 0)
        policy = abstract_like(self.trainer.state, self.trainer.shardings)
        target = {"policy": policy}
        for name in _BUFFERS:  # numpy leaves: orbax restores them as numpy, dtypes exact
            target[name] = RolloutBuffer(**{
                field: np.zeros(shapes[name][field], np.asarray(value).dtype)
                for field, value in dataclasses.asdict(empty).items()})
        if self.reference_logp is not None:
            target["reference"] = policy["model"]
        tree, metadata = checkpointer.restore(target, _Position(self), step=step)
        self.trainer.state = tree["policy"]
        self.rollouts, self.ready = tree["rollouts"], tree["ready"]
        self.reference = tree.get("reference")
        return metadata


@dataclasses.dataclass
class RLResult:
    """What `train_rl` returns: the run (policy, buffers), its metrics rows, the run folder."""

    run: RLRun
    rows: list[dict]
    run_dir: str


IterationHook = Callable[[RLRun], dict]


def _prepare(run_dir: str, config_json: dict, resume: bool) -> None:
    """Creates the run folder (config.json) or checks a resumed one against the config; raises
    ValueError for a folder that does not fit."""
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    has_checkpoints = os.path.isdir(checkpoints) and any(
        name.isdigit() for name in os.listdir(checkpoints))
    config_path = os.path.join(run_dir, "config.json")
    if resume:
        if not has_checkpoints:
            raise ValueError(f"--resume: {run_dir!r} holds no RL checkpoint to continue from; "
                             "run without --resume to start it")
        with open(config_path) as f:
            if json.load(f) != config_json:
                raise ValueError(f"--resume: the config differs from the one {run_dir!r} was "
                                 "started with; resume with the same settings, or start a new "
                                 "run with another --out")
        return
    if has_checkpoints:
        raise ValueError(f"{run_dir!r} already holds RL checkpoints; pass --resume to continue "
                         "it or choose another --out")
    os.makedirs(run_dir, exist_ok=True)
    with open(config_path, "w") as f:
        json.dump(config_json, f, indent=2)


def train_rl(config: RLConfig, task: RLTask, environment: ToolEnvironment, run_dir: str, *,
             policy: nnx.State | None = None, resume: bool = False,
             until_iteration: int | None = None, every: int = 0,
             after_iteration: IterationHook | None = None) -> RLResult:
    """Runs (or continues) RL to config.iterations, or only to `until_iteration` (checkpointed
    there, so a job with a time limit can stop and be resumed).

    policy: the starting policy's model state (`nnx.state(model)`); needed unless `resume`.
    environment: answers the calls (`ToolEnvironment` of the task's tools), built afresh for
        each call: a resumed run sets each of its `FlakyTool`s' call count from the checkpoint.
    every, after_iteration: after every `every`-th iteration, `after_iteration(run)` returns a
        dict merged into that iteration's metrics row (an evaluation).
    Writes run_dir/config.json, metrics.jsonl (one row per iteration; "step": iterations done)
    and checkpoints/ (every train.checkpoint_every iterations and at the end). Raises ValueError
    for a run folder that does not fit (checkpoints of another config, none to resume, a fresh
    start over existing checkpoints), `train.loop.RunDiverged` when the policy's state turns
    non-finite or too many steps in a row are skipped.
    """
    if until_iteration is not None and not 1 <= until_iteration <= config.iterations:
        raise ValueError(f"until_iteration must lie in [1, {config.iterations}], got "
                         f"{until_iteration}")
    if not resume and policy is None:
        raise ValueError("train_rl needs policy= (the starting model's state) unless resume")
    stop = config.iterations if until_iteration is None else until_iteration
    config_json = json.loads(json.dumps(config_dict(config)))
    _prepare(run_dir, config_json, resume)
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    checkpointer = Checkpointer(os.path.join(run_dir, CHECKPOINT_DIR),
                                max_to_keep=config.train.keep_checkpoints)
    try:
        if resume:
            run = RLRun(config, task, environment, Trainer.create(config.train, abstract=True))
            run.restore(checkpointer)
            rows = [row for row in read_metrics(metrics_path) if row["step"] <= run.iteration]
            os.remove(metrics_path)  # rows past the checkpoint: the resumed run writes them
        else:
            run = RLRun.start(config, task, environment, policy)
            rows = []
            if os.path.exists(metrics_path):
                os.remove(metrics_path)
        writer = MetricsWriter(metrics_path)
        writer.write(rows)
        bar = tqdm.tqdm(total=config.iterations, initial=run.iteration, unit="it",
                        disable=not config.train.progress, dynamic_ncols=True)
        skips_in_a_row, last_saved = 0, run.iteration or None
        while run.iteration < stop:
            row = run.iterate()
            if after_iteration is not None and every and run.iteration % every == 0:
                row.update(after_iteration(run))
            writer.write([row])
            rows.append(row)
            if "skipped" in row:
                skips_in_a_row = check_health([row], skips_in_a_row,
                                              config.train.max_consecutive_skips, last_saved)
            bar.set_postfix({key: f"{row[key]:.3f}" for key in ("reward", "loss") if key in row})
            bar.update(1)
            period = config.train.checkpoint_every
            if run.iteration == stop or (period and run.iteration % period == 0):
                run.save(checkpointer, metadata={"config": config_json})
                last_saved = run.iteration
        bar.close()
    finally:
        checkpointer.close()
    return RLResult(run, rows, run_dir)
