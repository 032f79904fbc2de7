"""Multi-turn rollouts on the serving engine, and partial rollouts across iterations (Kimi k1.5).

    config = RolloutConfig(group_size=8, max_length=1024, max_turns=8, max_turn_tokens=256,
                           stop_tokens=(EOS,), token_budget=256, max_staleness=2, seed=0)
    environment = ToolEnvironment({"c": calculate})
    buffer = None
    for step in range(steps):
        engine = Engine(policy_model, slots=32, num_pages=4096, max_seq_len=config.max_length,
                        prefix_sharing=True)
        groups, buffer = rollout(engine, prompts_for(step), config, environment, version=step,
                                 buffer=buffer)
        batch = make_batch(groups, reward_fn, length=config.max_length - 1, num_groups=P)
        state, metrics = rl_step(state, batch)     # train.rl.learner.make_rl_step

A trajectory is the tokens the policy is trained on, exactly: the prompt, the model's sampled
tokens and the tools' results, as token ids, never re-tokenized text. The model's tokens are
sampled on the engine; when a turn ends in one of the environment's pause sequences (a tool
call's closing tag, `</c>`), the engine pauses the sequence in its slot, the environment answers,
and the answer's tokens are appended as forced tokens (`Engine.resume`): only they are prefilled,
from the KDA state and pages the slot holds, never the whole conversation. Per token the
trajectory keeps whether the policy sampled it (the loss mask: 1 on the model's tokens, 0 on
prompt and tool tokens), its behaviour log-prob (under the distribution it was drawn from, see
`models.serving.sample_rows`) and the policy version that sampled it.

A group is G trajectories of one prompt, each with its own seed (from the config's seed, the
group's id and the member's index); they are submitted together, so with the engine's prefix
sharing the first prefills the prompt and the others start from its pages and KDA state. Token i
past the prompt is drawn with the key index i (`Request.key_offset`), however the trajectory was
cut: the same seeds give the same tokens.

Limits: a trajectory holds at most `max_length` tokens, a turn (the model's tokens between two
tool results) at most `max_turn_tokens`, and the model makes at most `max_turns` turns. Finish
reasons: "stop" (a stop token: the answer is complete), "length" (a length limit, or a tool
result that leaves no room for a model token), "turns" (a call in the last turn).

Partial rollouts: with `token_budget`, each trajectory samples at most that many tokens per
iteration; an unfinished one waits in the `RolloutBuffer` and continues in the next iteration,
whose engine carries the policy of that iteration. Its tokens are prefilled again there rather
than its engine state kept: a KDA state and latents computed by the old weights would make the
new policy's log-probs those of neither policy (the learner recomputes them with one set of
weights), the slots stay free while the learner runs, and the buffer is a few numpy arrays a
checkpoint holds as they are. The re-prefill costs one prefill of each continued trajectory per
iteration, linear in its length (KDA's state is constant-size); tool turns within an iteration
never re-prefill. Bounded staleness: a group whose oldest token is `max_staleness` versions behind
the iteration's policy runs to its end in that iteration, whatever the budget, so no trajectory
spans more than max_staleness + 1 versions; finishing rather than dropping keeps the long
trajectories that partial rollouts exist for (dropping them biases the batch to short ones).
Importance correction: the batch carries each token's stored behaviour log-prob, so the
learner's ratio exp(logp - logp_behaviour) (clipped, `train.rl.losses`) is the importance weight
of every token against the policy version that sampled it.

With a deterministic environment, partial rollouts under an unchanged policy give the tokens of
unbounded rollouts (same seeds, same keys; the log-probs agree to float32 rounding of the
re-prefill). An environment with state across calls (`train.rl.tools.FlakyTool` counts calls)
sees the calls in another order and may answer differently.
"""

import dataclasses
import math
import numbers
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol

import jax
import numpy as np

from models.generate import Sampling
from models.serving import Engine, Request
from train.rl.tools import TOOL_TAGS, Tool, ToolResult, find_call, run_call
from train.tokenizer import NUM_BYTES, PAD_ID, encode

Finish = Literal["stop", "length", "turns"]
FINISHES = typing.get_args(Finish)


class Environment(Protocol):
    """What answers a trajectory's calls: the engine pauses a turn that ends in one of
    `pause_sequences` (token ids), and `respond` turns the turn's model tokens (int32 [n], the
    pause sequence at their end) into the forced tokens (int32 [m]) and the `ToolResult`."""

    pause_sequences: tuple[tuple[int, ...], ...]

    def respond(self, turn: np.ndarray) -> tuple[np.ndarray, ToolResult]: ...


@dataclasses.dataclass(frozen=True)
class ToolEnvironment:
    """`train.rl.tools`' syntax as an environment: a turn pauses at a closing tag (`</c>`,
    `</py>`, `</n>`), the call it closes runs with `tools` (tag -> tool; `run_call` turns every
    failure, a malformed call or a missing tool included, into an "ERR ..." result), and the
    result's `<r>text</r>` bytes (text cut to max_result_bytes) are the forced tokens."""

    tools: Mapping[str, Tool]
    max_result_bytes: int = 4096

    @property
    def pause_sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(encode(f"</{tag}>", bos=False).tolist()) for tag in TOOL_TAGS)

    def respond(self, turn: np.ndarray) -> tuple[np.ndarray, ToolResult]:
        # Special tokens are no bytes: 0xFF stands for them (invalid UTF-8, a malformed call).
        turn = np.asarray(turn)
        data = np.where(turn < NUM_BYTES, turn, 0xFF).astype(np.uint8).tobytes()
        call = find_call(data)
        result = (ToolResult.failure("malformed", "no complete call") if call is None
                  else run_call(call, self.tools))
        return encode(result.encode(self.max_result_bytes), bos=False), result


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are generated.

    group_size: G, trajectories per prompt.
    max_length: tokens of a trajectory at most, prompt included (a batch of length
        max_length - 1 holds any trajectory).
    max_turns: model turns at most (a turn ends at a tool call or at the end of the answer).
    max_turn_tokens: sampled tokens of one turn at most; None: max_length.
    sampling: how tokens are drawn; the learner's log-probs equal the behaviour log-probs only
        for temperature 1 without top_k / top_p (`train.rl.losses`).
    stop_tokens: tokens that end a trajectory (its answer is complete).
    token_budget: partial rollouts: tokens a trajectory samples per iteration at most; None:
        every trajectory runs to its end in the iteration it starts.
    max_staleness: versions a group's oldest token may lag the iteration's policy before the
        group runs to its end regardless of the budget (>= 0).
    seed: the seed that trajectory seeds derive from (with group id and member index).
    """

    group_size: int
    max_length: int
    max_turns: int = 8
    max_turn_tokens: int | None = None
    sampling: Sampling = Sampling(temperature=1.0)
    stop_tokens: tuple[int, ...] = ()
    token_budget: int | None = None
    max_staleness: int = 4
    seed: int = 0

    def __post_init__(self):
        for name in ("group_size", "max_length", "max_turns"):
            _require_count(name, getattr(self, name))
        if self.max_turn_tokens is None:
            object.__setattr__(self, "max_turn_tokens", self.max_length)
        _require_count("max_turn_tokens", self.max_turn_tokens)
        if self.token_budget is not None:
            _require_count("token_budget", self.token_budget)
        if not (_is_int(self.max_staleness) and self.max_staleness >= 0):
            raise ValueError(f"max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if not (_is_int(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a models.generate.Sampling, got {self.sampling!r}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require_count(name: str, value) -> None:
    if not (_is_int(value) and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass
class Trajectory:
    """One rollout. Per-token arrays, each [L] in token order:

    tokens int32: the prompt (tokens[:prompt_length]), the model's tokens and the tools' results.
    sampled bool: True where the policy sampled the token (its loss mask).
    logprobs float32: a sampled token's behaviour log-prob; 0 elsewhere.
    versions int32: the policy version that sampled the token; -1 elsewhere.

    group, member: the group's id and the trajectory's index in it (0 .. G - 1); seed: its draws'.
    turn_start: where the current turn's model tokens begin; turns: turns begun (1 at the start).
    tool_calls, tool_errors: tool results in the trajectory, and those that are failures.
    finish: None while unfinished, else why it ended (module docstring).
    """

    group: int
    member: int
    seed: int
    prompt_length: int
    tokens: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    turn_start: int
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    finish: Finish | None = None

    def __len__(self) -> int:
        return self.tokens.size

    @property
    def truncated(self) -> bool:
        """Ended by a limit rather than by a stop token (DAPO's over-long filtering)."""
        return self.finish in ("length", "turns")

    @property
    def turn_tokens(self) -> int:
        return len(self) - self.turn_start

    def extend(self, tokens, logprobs=None, version: int = -1) -> None:
        """Appends tokens: sampled by policy `version` with behaviour `logprobs`, or forced
        (logprobs None)."""
        count = len(tokens)
        sampled = logprobs is not None
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int32)])
        self.sampled = np.concatenate([self.sampled, np.full(count, sampled)])
        self.logprobs = np.concatenate(
            [self.logprobs, np.asarray(logprobs if sampled else np.zeros(count), np.float32)])
        self.versions = np.concatenate([self.versions,
                                        np.full(count, version if sampled else -1, np.int32)])


def start_group(prompt: Sequence[int], group: int, config: RolloutConfig) -> list[Trajectory]:
    """The G trajectories of a new group on `prompt` (token ids), none of them sampled yet."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if not 1 <= prompt.size < config.max_length:
        raise ValueError(f"a prompt must hold 1 to max_length - 1 = {config.max_length - 1} "
                         f"tokens, got {prompt.size}")
    return [Trajectory(group, member, trajectory_seed(config.seed, group, member), prompt.size,
                       prompt.copy(), np.zeros(prompt.size, bool),
                       np.zeros(prompt.size, np.float32), np.full(prompt.size, -1, np.int32),
                       turn_start=prompt.size)
            for member in range(config.group_size)]


def trajectory_seed(seed: int, group: int, member: int) -> int:
    """The engine seed, in [0, 2^32), of member `member` of group `group`."""
    return int(np.random.SeedSequence([seed, group, member]).generate_state(1)[0])


# The buffer's per-trajectory integer fields, in the column order of `RolloutBuffer.fields`.
_FIELDS = ("group", "member", "seed", "prompt_length", "turn_start", "turns", "tool_calls",
           "tool_errors", "finish")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBuffer:
    """The trajectories of unfinished groups between iterations (unfinished ones and finished
    members waiting for the rest of their group), as numpy arrays: a pytree that an orbax
    checkpointer saves as it is; `RolloutBuffer(**checkpointer.restore(path))` reads it back
    without knowing its shapes. No array is ever empty (orbax refuses empty arrays): the token
    arrays start with one padding element and `fields` with one padding row.

    next_group: int64 [], the id the next new group takes.
    offsets: int64 [N + 1], trajectory n's tokens are at offsets[n]:offsets[n + 1] (from 1) of
    tokens int32, sampled bool, logprobs float32, versions int32: [offsets[-1]] (`Trajectory`).
    fields: int64 [N + 1, 9], row n + 1 trajectory n's group, member, seed, prompt_length,
        turn_start, turns, tool_calls, tool_errors, finish (0: unfinished, 1 + its index in
        FINISHES).
    """

    next_group: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    fields: np.ndarray

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory], next_group: int) -> "RolloutBuffer":
        """The buffer of `trajectories` (copied) before the group id `next_group`."""
        def joined(name, dtype):
            return np.concatenate([np.zeros(1, dtype)]
                                  + [getattr(t, name) for t in trajectories]).astype(dtype)
        fields = [[0] * len(_FIELDS)] + [
            [getattr(t, name) for name in _FIELDS[:-1]]
            + [0 if t.finish is None else 1 + FINISHES.index(t.finish)] for t in trajectories]
        return cls(np.asarray(next_group, np.int64),
                   np.cumsum([1] + [len(t) for t in trajectories]).astype(np.int64),
                   joined("tokens", np.int32), joined("sampled", bool),
                   joined("logprobs", np.float32), joined("versions", np.int32),
                   np.asarray(fields, np.int64))

    def __len__(self) -> int:
        """Trajectories held."""
        return len(self.offsets) - 1

    def trajectories(self) -> list[Trajectory]:
        """The buffer's trajectories (copies)."""
        out = []
        for n, row in enumerate(np.asarray(self.fields)[1:]):
            start, end = int(self.offsets[n]), int(self.offsets[n + 1])
            values = dict(zip(_FIELDS, (int(v) for v in row)))
            finish = values.pop("finish")
            out.append(Trajectory(
                **values, tokens=np.array(self.tokens[start:end], np.int32),
                sampled=np.array(self.sampled[start:end], bool),
                logprobs=np.array(self.logprobs[start:end], np.float32),
                versions=np.array(self.versions[start:end], np.int32),
                finish=None if finish == 0 else FINISHES[finish - 1]))
        return out


def _check_engine(engine: Engine, config: RolloutConfig) -> None:
    if engine.max_seq_len < config.max_length:
        raise ValueError(f"the engine's max_seq_len ({engine.max_seq_len}) is below the "
                         f"config's max_length ({config.max_length}); build the engine with "
                         "max_seq_len >= max_length")
    if engine.has_work or engine.paused:
        raise ValueError("rollout needs an idle engine (no request waiting, running or paused)")


class _Iteration:
    """One iteration's generation: submits the unfinished trajectories, answers their calls,
    and stops each at its end or at its budget."""

    def __init__(self, engine: Engine, config: RolloutConfig, environment: Environment,
                 version: int):
        self.engine, self.config, self.environment, self.version = (engine, config,
                                                                    environment, version)
        self.running: dict[int, Trajectory] = {}  # request id -> trajectory
        self.budget_left: dict[int, float] = {}  # id(trajectory) -> tokens it may still sample

    def run(self, trajectories: list[Trajectory]) -> None:
        oldest = {}
        for t in trajectories:
            versions = t.versions[t.sampled]
            first = int(versions.min()) if versions.size else self.version
            oldest[t.group] = min(oldest.get(t.group, first), first)
        for t in trajectories:
            if t.finish is not None:
                continue
            stale = self.version - oldest[t.group] >= self.config.max_staleness
            budget = self.config.token_budget
            self.budget_left[id(t)] = math.inf if budget is None or stale else budget
            request_id = self.engine.submit(Request(
                tuple(t.tokens.tolist()), self.config.sampling, seed=t.seed,
                max_tokens=self._segment_limit(t), stop_tokens=self.config.stop_tokens,
                pause_sequences=self.environment.pause_sequences,
                key_offset=len(t) - t.prompt_length))
            self.running[request_id] = t
        while self.engine.has_work:
            for event in self.engine.step():
                if event.finish_reason is not None:
                    self._segment_ended(event.request_id, event.finish_reason)

    def _segment_limit(self, t: Trajectory) -> int:
        """Tokens the next segment of `t` may sample: within its turn, its length and budget."""
        return int(min(self.config.max_turn_tokens - t.turn_tokens,
                       self.config.max_length - len(t), self.budget_left[id(t)]))

    def _segment_ended(self, request_id: int, reason: str) -> None:
        t = self.running.pop(request_id)
        done = self.engine.completion(request_id)
        t.extend(done.tokens, done.logprobs, self.version)
        self.budget_left[id(t)] -= len(done.tokens)
        if reason == "stop":
            t.finish = "stop"
        elif reason == "length":
            if (len(t) >= self.config.max_length
                    or t.turn_tokens >= self.config.max_turn_tokens):
                t.finish = "length"
            # else: the budget ran out and the trajectory waits for the next iteration.
        else:
            self._answer(request_id, t)

    def _answer(self, request_id: int, t: Trajectory) -> None:
        """Answers the call that paused `t`, and resumes it with the result's tokens (or ends
        or parks it)."""
        if t.turns >= self.config.max_turns:
            t.finish = "turns"
            self.engine.release(request_id)
            return
        forced, result = self.environment.respond(t.tokens[t.turn_start:])
        if len(t) + len(forced) >= self.config.max_length:
            t.finish = "length"
            self.engine.release(request_id)
            return
        t.extend(forced)
        t.tool_calls += 1
        t.tool_errors += not result.ok
        t.turns, t.turn_start = t.turns + 1, len(t)
        limit = self._segment_limit(t)
        if limit < 1:  # the budget ran out: the next iteration continues it
            self.engine.release(request_id)
            return
        self.engine.resume(request_id, forced, limit)
        self.running[request_id] = t


def rollout(engine: Engine, prompts: Sequence[Sequence[int]], config: RolloutConfig,
            environment: Environment, *, version: int = 0,
            buffer: RolloutBuffer | None = None,
            ) -> tuple[list[list[Trajectory]], RolloutBuffer]:
    """One rollout iteration: G trajectories of each new prompt, and the buffer's unfinished
    ones continued, with the policy the engine holds.

    engine: an idle `models.serving.Engine` of the current policy, max_seq_len >=
        config.max_length (prefix_sharing=True lets a group share its prompt's prefill).
    prompts: P' new prompts, each 1 .. max_length - 1 token ids; their groups take the ids
        buffer.next_group, +1, ... in order.
    version: the policy version (tags the tokens sampled now; staleness counts in versions).
    buffer: the previous iteration's buffer, or None.
    Returns the groups whose every trajectory has finished (each a list of G trajectories in
    member order), oldest group first, and the buffer of the rest. Without a token budget every
    group finishes and the buffer holds none.
    """
    _check_engine(engine, config)
    buffer = RolloutBuffer.of([], 0) if buffer is None else buffer
    trajectories = buffer.trajectories()
    next_group = int(buffer.next_group)
    for prompt in prompts:
        trajectories += start_group(prompt, next_group, config)
        next_group += 1
    _Iteration(engine, config, environment, version).run(trajectories)
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group, []).append(t)
    done = [sorted(members, key=lambda t: t.member) for _, members in sorted(groups.items())
            if all(t.finish is not None for t in members)]
    rest = [t for t in trajectories if any(t.finish is None for t in groups[t.group])]
    return done, RolloutBuffer.of(rest, next_group)


def make_batch(groups: Sequence[Sequence[Trajectory]], reward_fn: Callable[[Trajectory], float],
               length: int, num_groups: int | None = None) -> dict[str, np.ndarray]:
    """The learner's batch (`train.rl.losses`' layout) of finished groups.

    groups: P groups of G finished trajectories (`rollout`'s).
    reward_fn: a trajectory's reward.
    length: T, tokens per row: a trajectory of L tokens fills L - 1 (inputs tokens[:-1], targets
        tokens[1:]), so T = config.max_length - 1 holds any.
    num_groups: pads the batch to this many groups of empty rows (loss mask 0, reward 0, group
        id -1), so that every batch has one shape and the step compiles once; None: P. Padding
        rows count in the "constant" aggregation's normaliser (B * T) only.
    Returns numpy arrays, B = num_groups * G rows, row p * G + g = member g of group p:
        tokens, targets, segment_ids int32 [B, T]: inputs, next tokens (PAD_ID past the end),
            1 on the trajectory and 0 on padding;
        loss_mask, logp_behaviour float32 [B, T]: 1 / the behaviour log-prob where the target
            was sampled, 0 on prompt, tool and padding targets;
        versions int32 [B, T]: the policy version that sampled the target, -1 off the mask;
        rewards float32 [num_groups, G]; group_ids int32 [B]; truncated bool [B].
    A KL term's logp_reference [B, T] is `train.step.make_token_logp` of the reference policy on
    this batch.
    """
    if not groups:
        raise ValueError("make_batch needs at least one group")
    size = len(groups[0])
    num_groups = len(groups) if num_groups is None else num_groups
    if len(groups) > num_groups:
        raise ValueError(f"{len(groups)} groups do not fit num_groups={num_groups}")
    rows = num_groups * size
    batch = dict(tokens=np.full((rows, length), PAD_ID, np.int32),
                 targets=np.full((rows, length), PAD_ID, np.int32),
                 segment_ids=np.zeros((rows, length), np.int32),
                 loss_mask=np.zeros((rows, length), np.float32),
                 logp_behaviour=np.zeros((rows, length), np.float32),
                 versions=np.full((rows, length), -1, np.int32),
                 rewards=np.zeros((num_groups, size), np.float32),
                 group_ids=np.full(rows, -1, np.int32), truncated=np.zeros(rows, bool))
    for p, group in enumerate(groups):
        if len(group) != size:
            raise ValueError(f"every group needs {size} trajectories; group {p} has {len(group)}")
        for g, t in enumerate(group):
            if t.finish is None:
                raise ValueError(f"trajectory {g} of group {t.group} is unfinished")
            if len(t) - 1 > length:
                raise ValueError(f"a trajectory of {len(t)} tokens needs length >= {len(t) - 1}, "
                                 f"got {length}")
            row, n = p * size + g, len(t) - 1
            batch["tokens"][row, :n] = t.tokens[:-1]
            batch["targets"][row, :n] = t.tokens[1:]
            batch["segment_ids"][row, :n] = 1
            batch["loss_mask"][row, :n] = t.sampled[1:]
            batch["logp_behaviour"][row, :n] = t.logprobs[1:]
            batch["versions"][row, :n] = t.versions[1:]
            batch["rewards"][p, g] = reward_fn(t)
            batch["group_ids"][row] = t.group
            batch["truncated"][row] = t.truncated
    return batch


def rollout_metrics(groups: Sequence[Sequence[Trajectory]], version: int) -> dict[str, float]:
    """Means over the groups' trajectories: sampled_tokens, tool_tokens (forced), turns,
    tool_calls, tool_errors; fractions finished by each reason (finish_stop, finish_length,
    finish_turns); staleness_mean and staleness_max of the sampled tokens against `version`."""
    flat = [t for group in groups for t in group]
    if not flat:
        return {}
    sampled = np.concatenate([t.versions[t.sampled] for t in flat])
    staleness = version - sampled if sampled.size else np.zeros(1)
    metrics = dict(
        sampled_tokens=np.mean([t.sampled.sum() for t in flat]),
        tool_tokens=np.mean([len(t) - t.prompt_length - t.sampled.sum() for t in flat]),
        turns=np.mean([t.turns for t in flat]),
        tool_calls=np.mean([t.tool_calls for t in flat]),
        tool_errors=np.mean([t.tool_errors for t in flat]),
        staleness_mean=staleness.mean(), staleness_max=staleness.max())
    metrics.update({f"finish_{reason}": np.mean([t.finish == reason for t in flat])
                    for reason in FINISHES})
    return {name: float(value) for name, value in metrics.items()}
