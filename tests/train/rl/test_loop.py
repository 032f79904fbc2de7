"""train.rl.loop: every failure of a trajectory handled and counted (malformed calls, unknown
tools, tools that crash or time out, injected "ERR busy", trajectories over the length or turn
limit, groups of equal rewards), and an RL run interrupted after k iterations and resumed from
its checkpoint equal to the uninterrupted run, bit for bit (losses, metrics, parameters,
optimizer, buffers), with partial rollouts, a KL reference and injected failures all in play.

An untrained one-layer model writes random bytes, so its tool calls are single tokens: any of
PAUSES ends a turn, and which one picks the call (`TokenCalls`).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models.config import preset
from train.loop import MeshConfig, TrainConfig, Trainer
from train.optim import OptimConfig
from train.rl.loop import RLConfig, RLRun, train_rl
from train.rl.losses import RLLossConfig
from train.rl.rollout import RolloutConfig, ToolEnvironment
from train.rl.tools import FlakyTool, ToolCall, ToolResult, calculate, run_call
from train.tokenizer import encode

PAUSES = tuple(range(200, 224))
STOPS = tuple(range(240, 256))


def crash(argument: str) -> ToolResult:
    raise RuntimeError("the tool fell over")


def timeout(argument: str) -> ToolResult:
    return ToolResult.failure("timeout", "wall time over 1 s")  # as the Python sandbox says


# Token PAUSES[i] makes the call CALLS[i % 6], whose result is KINDS[i % 6].
CALLS = (ToolCall("c", b"", 0, 0, "empty <c> call"),  # malformed
         ToolCall("x", b"1", 0, 0),  # no such tool
         ToolCall("py", b"1", 0, 0),  # the tool raises
         ToolCall("n", b"1", 0, 0),  # the tool times out
         ToolCall("c", b"2+3", 0, 0),  # the calculator, with injected failures
         ToolCall("k", b"2+3", 0, 0))  # the calculator
KINDS = ("malformed", "unavailable", "crash", "timeout", None, "ok")


@dataclasses.dataclass(frozen=True)
class TokenCalls(ToolEnvironment):
    """ToolEnvironment's answers to calls made of single tokens (results cut to 3 bytes of text:
    "<r>ERR</r>", "<r>5</r>")."""

    max_result_bytes: int = 3

    @property
    def pause_sequences(self):
        return tuple((token,) for token in PAUSES)

    def respond(self, turn):
        result = run_call(CALLS[(int(turn[-1]) - PAUSES[0]) % len(CALLS)], self.tools)
        return encode(result.encode(self.max_result_bytes), bos=False), result


def environment(busy_probability: float) -> TokenCalls:
    """Fresh tools: the flaky calculator's call count starts at 0."""
    return TokenCalls({"c": FlakyTool(calculate, busy_probability, seed=7), "k": calculate,
                       "py": crash, "n": timeout})


class ByteTask:
    """Prompts of random bytes; reward: 1 for every member of an even prompt (a group of equal
    rewards), else the count of bytes below 100 in the completion, mod 3."""

    @staticmethod
    def prompt(index):
        return np.random.default_rng([index, 11]).integers(0, 256, 5 + index % 4).astype(np.int32)

    @staticmethod
    def reward(index, completion):
        return 1.0 if index % 2 == 0 else float(np.sum(np.asarray(completion) < 100) % 3)


# The model, engine and learner of tests/experiments/test_agentic_rl.py's SETTINGS: the suite's
# persistent compilation cache then compiles the engine's programs and the RL step once for both.
MODEL = preset("tiny", num_layers=1, kda_layers=(1,), full_attn_layers=())
CONFIG = RLConfig(
    train=TrainConfig(model=MODEL, mesh=MeshConfig(data=1), steps=4, fast_compile=True,
                      optim=OptimConfig(learning_rate=1e-3, warmup_steps=3,
                                        schedule="constant", weight_decay=0.0),
                      checkpoint_every=1, keep_checkpoints=5, progress=False),
    loss=RLLossConfig("dapo", kl="k3", kl_coef=0.1),
    rollout=RolloutConfig(group_size=3, max_length=40, max_turns=4, max_turn_tokens=12,
                          stop_tokens=STOPS, token_budget=7, max_staleness=1, seed=3),
    prompts_per_iteration=6, slots=8, page_size=1, prefill_chunk_tokens=1)
TIMING = ("rollout_seconds", "seconds", "cpu_seconds")


@pytest.fixture(scope="module")
def policy():
    """An untrained model's state: the starting policy (and reference)."""
    return nnx.state(Trainer.create(CONFIG.train).model)


def expected_results(groups, max_length: int) -> dict[str, int]:
    """Tool results by kind, read back from the trajectories (the flaky calculator always busy):
    the call before each forced run; and a call that ends a trajectory cut at the length limit
    below max_length: it was answered, but its result did not fit."""
    counts = {}
    for t in (t for group in groups for t in group):
        ends = [i - 1 for i in range(t.prompt_length, len(t))
                if not t.sampled[i] and t.sampled[i - 1]]
        if t.finish == "length" and t.tokens[-1] in PAUSES and len(t) < max_length:
            ends.append(len(t) - 1)
        for end in ends:
            kind = KINDS[(int(t.tokens[end]) - PAUSES[0]) % len(CALLS)] or "busy"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.slow
def test_failures_are_handled_and_counted(policy):
    """One iteration without a token budget, so every trajectory is in the batch: the row
    counts each kind of tool failure as the trajectories show it, the trajectories over the
    length or turn limit, and the groups of equal rewards, which DAPO drops (and whose
    truncated rows it filters); the step runs and is finite."""
    config = dataclasses.replace(
        CONFIG, rollout=dataclasses.replace(CONFIG.rollout, token_budget=None, max_turns=3))
    run = RLRun.start(config, ByteTask(), environment(busy_probability=1.0), policy)
    row = run.iterate()
    groups = run.batch_groups
    assert len(groups) == 6 and len(run.rollouts) == 0
    expected = expected_results(groups, config.rollout.max_length)
    assert set(expected) == {"malformed", "unavailable", "crash", "timeout", "busy", "ok"}
    for kind, count in expected.items():
        if kind != "ok":
            assert row[f"tool_errors_{kind}"] == count, kind
    assert row["tool_results"] == sum(expected.values())
    trajectories = [t for group in groups for t in group]
    for reason in ("stop", "length", "turns"):
        cut = sum(t.finish == reason for t in trajectories)
        assert cut and row[f"finish_{reason}"] * len(trajectories) == pytest.approx(cut)
    truncated = [t for group in groups for t in group if t.truncated]
    assert truncated and row["filtered_rows"] == len(truncated)
    rewards = np.array([[ByteTask.reward(t.group, t.tokens[t.prompt_length:]) for t in group]
                        for group in groups])
    equal = int(np.all(rewards == rewards[:, :1], axis=1).sum())
    assert equal >= 3  # the even prompts' groups, at least
    assert row["equal_reward_groups"] == row["dropped_groups"] == equal
    assert row["reward"] == pytest.approx(rewards.mean())
    assert row["skipped"] == 0 and np.isfinite(row["loss"]) and row["grad_norm"] > 0


def state_leaves(state):
    return [(path, np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(
        jax.device_get(state))]


@pytest.mark.slow
def test_an_interrupted_run_resumes_bit_for_bit(policy, tmp_path):
    """A run stopped after two of four iterations and resumed from its folder (as a fresh
    process would: new tools, new objects), against the stopped run's objects going on in
    memory for two more iterations (the uninterrupted run): the same metrics rows, the same
    policy, optimizer, reference and buffers, bit for bit. The checkpoint held unfinished
    trajectories (the token budget), injected failures had been drawn, and the KL term reads
    the reference, so each part of the checkpoint matters."""
    def tools():
        return environment(busy_probability=0.5)

    first = train_rl(CONFIG, ByteTask(), tools(), str(tmp_path), policy=policy,
                     until_iteration=2)
    assert len(first.run.rollouts) > 0 and first.run.flaky_tools["c"].calls > 0
    resumed = train_rl(CONFIG, ByteTask(), tools(), str(tmp_path), resume=True)
    whole = first.run
    whole_rows = first.rows + [whole.iterate() for _ in range(2)]
    assert [row["step"] for row in resumed.rows] == [1, 2, 3, 4]
    assert sum(row.get("tool_errors_busy", 0) for row in whole_rows) > 0
    assert all(row["kl"] > 0 for row in whole_rows[1:] if "kl" in row)
    for got, want in zip(resumed.rows, whole_rows, strict=True):
        assert {k: v for k, v in got.items() if k not in TIMING} == {
            k: v for k, v in want.items() if k not in TIMING}
    for (path, got), (_, want) in zip(state_leaves(resumed.run._tree()),
                                      state_leaves(whole._tree()), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
    assert resumed.run.flaky_tools["c"].calls == whole.flaky_tools["c"].calls
    assert resumed.run.next_prompt == whole.next_prompt == 4 * CONFIG.prompts_per_iteration
