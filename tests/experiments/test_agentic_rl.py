"""`python -m experiments.agentic_rl`: pass@k against counting subsets, the held-out metrics on
trajectories whose outcome is known by construction, and the whole experiment end to end at a
tiny size (warm start, evaluations, GRPO with checkpoints, report, resume)."""

import dataclasses
import itertools
import json
import math
import os

import numpy as np
import pytest

from experiments import agentic_rl
from experiments.agentic_rl import heldout_metrics, pass_at_k
from train.rl.arithmetic import ArithmeticTask, TraceConfig, grade, make_trace
from train.rl.rollout import Trajectory

TASK = ArithmeticTask(max_steps=3)


def test_pass_at_k_is_the_chance_that_k_samples_hold_a_right_one():
    """Against the share of all k-subsets of n samples (c of them right) that hold a right one."""
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                share = sum(any(i < c for i in subset) for subset in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="k"):
        pass_at_k(4, 1, 5)


def as_trajectory(data: bytes, mask: list[bool], prompt_length: int, member: int,
                  turns: int) -> Trajectory:
    tokens = np.frombuffer(data, np.uint8).astype(np.int32)
    sampled = np.asarray(mask, bool)
    return Trajectory(0, member, 0, prompt_length, tokens, sampled,
                      np.zeros(tokens.size, np.float32), np.full(tokens.size, -1, np.int32),
                      tokens.size, turns=turns, finish="stop")


def kinds(problem_index: int) -> dict[str, tuple[bytes, list[bool], int, int]]:
    """Trajectories of one problem whose outcome is known by construction, each (bytes, loss
    mask, model turns, injected failures): `solved` (the trace's calls, answered right), `busy`
    (injected failures, each call retried, answered right), `wrong` (the calls, then the answer
    plus one), `guess` (no call, the answer plus one) and `malformed` (a refused call, then the
    right answer)."""
    solved = make_trace(TASK, TraceConfig(guess_share=0.0), 0, problem_index)
    busy_config = TraceConfig(guess_share=0.0, busy_probability=0.999, max_busy_in_a_row=1)
    busy = make_trace(TASK, busy_config, 0, problem_index)
    assert busy.busy > 0
    problem = solved.problem

    def of(trace):
        data = b"".join(d for d, _ in trace.segments)
        mask = [m for d, m in trace.segments for _ in d]
        return data, mask, sum(m for _, m in trace.segments), trace.busy

    prompt, answer = problem.prompt, f"A:{problem.answer}\n".encode()
    wrong_end = f"A:{problem.answer + 1}\n".encode()
    data, mask, turns, _ = of(solved)
    answer_start = data.rfind(b"A:")
    call, refusal = b"<c>1+</c>", b"<r>ERR syntax error</r>"
    return {
        "solved": of(solved),
        "busy": of(busy),
        "wrong": (data[:answer_start] + wrong_end, mask[:answer_start] + [True] * len(wrong_end),
                  turns, 0),
        "guess": (prompt + wrong_end, [False] * len(prompt) + [True] * len(wrong_end), 1, 0),
        "malformed": (prompt + call + refusal + answer, [False] * len(prompt) + [True] * len(call)
                      + [False] * len(refusal) + [True] * len(answer), 2, 0),
    }


def test_heldout_metrics_of_known_outcomes():
    """Four problems, four samples each, outcomes known by construction: pass@1 is the share of
    right samples, pass@4 the share of problems with one; valid calls, tool use, guesses, mean
    turns, recovery (right after an injected failure) and retries counted by hand."""
    plan = [("solved", "wrong", "guess", "busy"), ("guess", "guess", "guess", "guess"),
            ("malformed", "solved", "solved", "busy"), ("wrong", "wrong", "busy", "guess")]
    right = {"solved": True, "busy": True, "wrong": False, "guess": False, "malformed": True}
    problems, groups, turns, calls, invalid, busy = [], [], [], 0, 0, 0
    for index, members in enumerate(plan):
        table = kinds(index)
        problems.append(TASK.problem(0, index))
        group = []
        for member, kind in enumerate(members):
            data, mask, turn_count, failures = table[kind]
            group.append(as_trajectory(data, mask, len(problems[-1].prompt), member, turn_count))
            turns.append(turn_count)
            calls += turn_count - 1
            invalid += kind == "malformed"
            busy += failures
        groups.append(group)
    metrics = heldout_metrics(problems, groups)
    outcomes = [[right[kind] for kind in members] for members in plan]
    assert metrics["pass@1"] == pytest.approx(np.mean(outcomes))
    assert metrics["pass@4"] == pytest.approx(np.mean([any(row) for row in outcomes]))
    assert metrics["valid_call_rate"] == pytest.approx(1 - invalid / calls)
    flat = [kind for members in plan for kind in members]
    assert metrics["guess_rate"] == pytest.approx(flat.count("guess") / 16)
    assert metrics["tool_use"] == pytest.approx(1 - flat.count("guess") / 16)
    assert metrics["mean_turns"] == pytest.approx(np.mean(turns))
    assert metrics["recovery_rate"] == 1.0 and metrics["retry_rate"] == 1.0
    assert metrics["busy_results"] == busy
    assert metrics["no_answer"] == 0.0


# A few steps at a tiny size. The model, engine and learner are those of
# tests/train/rl/test_loop.py's CONFIG (DAPO with a k3 KL term; its fields spelled out here take
# the values rl.loss.algorithm=dapo alone gives them), so the suite's persistent
# compilation cache compiles the engine's programs and the RL step once for both, and once more
# for tests/notebooks/test_agentic_rl_notebook.py, which runs the notebook with these settings.
TINY_MODEL = {"num_layers": 1, "kda_layers": 1, "full_attn_layers": ""}  # one KDA layer
SETTINGS = {
    **{f"warm_start.model.{k}": v for k, v in TINY_MODEL.items()},
    **{f"rl.train.model.{k}": v for k, v in TINY_MODEL.items()},
    "warm_start.steps": 2, "warm_start.data.batch_size": 2, "warm_start.data.seq_len": 128,
    "warm_start.fast_compile": "true", "warm_start.progress": "false",
    "curriculum.max_steps": "1,2", "curriculum.stage_problems": 6,
    "rl.train.steps": 2, "rl.train.checkpoint_every": 1, "rl.train.fast_compile": "true",
    "rl.train.progress": "false",
    "rl.loss.algorithm": "dapo", "rl.loss.clip_high": 0.28, "rl.loss.aggregation": "token",
    "rl.loss.overlong": "filter", "rl.loss.dynamic_sampling": "true", "rl.loss.kl": "k3",
    "rl.loss.kl_coef": 0.1,
    "rl.prompts_per_iteration": 6, "rl.rollout.group_size": 3, "rl.rollout.max_length": 40,
    "rl.rollout.max_turn_tokens": 12, "rl.slots": 8, "rl.page_size": 1,
    "rl.prefill_chunk_tokens": 1,  # one prefill program, [1, 1]
    "eval_problems": 3, "eval_samples": 2, "curve_every": 1, "curve_problems": 2,
    "busy_probability": 0.5,
}
FLAGS = [flag for key, value in SETTINGS.items() for flag in ("--set", f"{key}={value}")]


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_resumes(tmp_path, capsys):
    """A tiny run: the table and summary hold every metric, finite where it must be; pass@1 is
    the mean of `grade` over the logged trajectories; the warm start and each RL iteration are
    checkpointed; the plots exist; --resume of the finished run reads everything back."""
    out = str(tmp_path / "run")
    summary = agentic_rl.main(["--out", out, *FLAGS])
    printed = capsys.readouterr().out
    assert "| pass@1 |" in printed and "| recovery_rate |" in printed
    for phase in ("before", "after"):
        metrics = summary[phase]
        for name in ("pass@1", "pass@2", "valid_call_rate", "tool_use", "mean_turns",
                     "no_answer", "curve_pass@1"):
            assert math.isfinite(metrics[name]), (phase, name)
    with open(os.path.join(out, "trajectories.jsonl")) as f:
        records = [json.loads(line) for line in f]
    config = dataclasses.replace(agentic_rl.AgenticRLConfig(), eval_problems=3)
    problems = config.heldout_problems()
    for phase in ("before", "after"):
        mine = [r for r in records if r["phase"] == phase]
        assert sorted((r["problem_index"], r["sample"]) for r in mine) == [
            (i, s) for i in range(3) for s in range(2)]
        correct = [grade(problems[r["problem_index"]],
                         r["completion"].encode("utf-8", "surrogateescape")).correct
                   for r in mine]
        assert correct == [r["correct"] for r in mine]
        assert summary[phase]["pass@1"] == pytest.approx(np.mean(correct))
        for r in mine:
            assert r["prompt"] == problems[r["problem_index"]].prompt.decode()
            assert len(r["loss_mask"]) == len(r["completion"].encode("utf-8", "surrogateescape"))
    rows = [json.loads(line) for line in open(os.path.join(out, "rl", "metrics.jsonl"))]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for name in ("loss", "reward", "grad_norm", "learning_rate", "tool_results"):
            assert math.isfinite(row[name]), name
    assert "curve_pass@1" in rows[0] and "curve_pass@1" not in rows[1]
    assert sorted(os.listdir(os.path.join(out, "rl", "checkpoints"))) == ["1", "2"]
    assert os.listdir(os.path.join(out, "warm_start", "checkpoints")) == ["2"]
    for name in ("reward.png", "pass_at_1.png", "agentic_rl.md", "summary.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name

    again = agentic_rl.main(["--out", out, "--resume", *FLAGS])
    np.testing.assert_equal(again["before"], summary["before"])  # NaN where no tool was busy
    assert again["after"]["pass@1"] == summary["after"]["pass@1"]
