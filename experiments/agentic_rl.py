"""Agentic RL on the embedded arithmetic task: warm-start the `tiny` hybrid on mixed traces, then
GRPO with the calculator tool, a curriculum over the number of dependent steps and injected tool
failures; pass@1, pass@8, valid-call rate, mean turns and recovery on held-out problems before
and after RL.

    python -m experiments.agentic_rl                          # benchmarks/agentic_rl.md: its numbers
    python -m experiments.agentic_rl --set curriculum.max_steps=1,2,4,8,16 \\
        --set rl.train.steps=80 --set rl.rollout.max_length=768 --set rl.rollout.max_turns=24 \\
        --set warm_start.data.seq_len=1024          # the whole curriculum, 1 -> 16 steps
    python -m experiments.agentic_rl --out runs/agentic_rl --resume

The problems (`train.rl.arithmetic`) are chains like `Q:((37*12)+905)-88=`: a byte model of a
few hundred thousand parameters cannot multiply in its head, but it can copy: each step is one
calculator call (`<c>37*12</c>`, answered `<r>444</r>` by the environment as forced tokens),
and the final answer copies the last result (`A:1261`). The warm start trains on traces of
which `traces.guess_share` answer at once without a call (mostly wrong): the warm-started
policy guesses about that often, and RL has to learn that calling the tool pays. Injected
"ERR busy" results (`busy_probability`, in the traces too) teach retrying the call.

Phases, each resumable from the run folder: the warm start (warm_start/), the evaluation before
RL (before.json), GRPO (rl/: `train.rl.loop.train_rl`, a held-out pass@1 point every
`curve_every` iterations), the evaluation after RL. The report: agentic_rl.md (the table),
summary.json, reward.png and pass_at_1.png, trajectories.jsonl (sampled held-out trajectories
with their loss masks).
"""

import dataclasses
import json
import math
import os
import sys

import jax
import numpy as np
import tqdm
from flax import nnx

from models.config import preset
from models.lm import HybridLM
from train.checkpoint import Checkpointer
from train.cli import config_dict, make_parser, one_line_errors, resolve_config, run_folder
from train.data import EVAL_TASK_SEED, DataConfig
from train.loop import MeshConfig, TrainConfig, Trainer
from train.optim import OptimConfig
from train.rl.arithmetic import (STOP_TOKEN, ArithmeticTask, Curriculum, Problem, TraceConfig,
                                 completion_bytes, grade, trace_batches)
from train.rl.loop import RLConfig, make_engine, train_rl
from train.rl.losses import RLLossConfig
from train.rl.rollout import RolloutConfig, ToolEnvironment, Trajectory, rollout
from train.tokenizer import BOS_ID

DEFAULT_OUT = "runs/agentic_rl"
EVAL_TOOL_SEED = 2**31  # the evaluations' injected failures: apart from training's tool seeds
EVAL_SAMPLING_SEED = 2**30


@dataclasses.dataclass(frozen=True)
class AgenticRLConfig:
    """The experiment.

    warm_start: the supervised warm start on traces (model, optimizer, steps; data.seq_len and
        data.batch_size shape its packed batches, data.seed their order).
    traces: how warm-start traces are written (guess_share: the lever; busy_probability).
    curriculum: RL's problem stream (max_steps per stage, stage_problems) and its task; the
        warm-start traces and the held-out problems use the last stage's max_steps.
    rl: the RL run (GRPO settings, rollout limits, prompts and iterations).
    busy_probability: injected "ERR busy" rate of the tools in RL and in the evaluations.
    eval_problems, eval_samples: held-out problems and samples of each (pass@1 and
        pass@eval_samples).
    curve_every, curve_problems: a pass@1 point on the first curve_problems held-out problems
        every curve_every RL iterations (0: only before and after).
    """

    warm_start: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(
        model=preset("tiny"), data=DataConfig(seq_len=256, batch_size=8),
        optim=OptimConfig(learning_rate=4e-3, warmup_steps=20, decay_fraction=0.3),
        mesh=MeshConfig(data=1), steps=300, log_every=10))
    traces: TraceConfig = TraceConfig(guess_share=0.5, busy_probability=0.1)
    curriculum: Curriculum = Curriculum(max_steps=(1, 2), stage_problems=48)
    rl: RLConfig = dataclasses.field(default_factory=lambda: RLConfig(
        train=TrainConfig(model=preset("tiny"), mesh=MeshConfig(data=1), steps=16,
                          optim=OptimConfig(learning_rate=1e-3, warmup_steps=3,
                                            schedule="constant", weight_decay=0.0),
                          checkpoint_every=8),
        loss=RLLossConfig("grpo"),
        rollout=RolloutConfig(group_size=8, max_length=128, max_turns=8, max_turn_tokens=32,
                              stop_tokens=(STOP_TOKEN,)),
        prompts_per_iteration=8, slots=64, page_size=4, prefill_chunk_tokens=16))
    busy_probability: float = 0.1
    eval_problems: int = 256
    eval_samples: int = 8
    curve_every: int = 4
    curve_problems: int = 16

    def __post_init__(self):
        for name in ("eval_problems", "eval_samples", "curve_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.curve_every < 0:
            raise ValueError(f"curve_every must be >= 0, got {self.curve_every}")
        if self.warm_start.model != self.rl.train.model:
            raise ValueError("warm_start.model and rl.train.model must be the same model; set "
                             "both (e.g. --set warm_start.model.d_model=96 --set "
                             "rl.train.model.d_model=96)")

    @property
    def heldout_task(self) -> ArithmeticTask:
        return dataclasses.replace(self.curriculum.task,
                                   max_steps=self.curriculum.max_steps[-1])

    def heldout_problems(self) -> list[Problem]:
        return [self.heldout_task.problem(EVAL_TASK_SEED, i) for i in range(self.eval_problems)]


# ------------------------------------------------------------------------------- warm start


def warm_start(config: AgenticRLConfig, run_dir: str, resume: bool) -> nnx.State:
    """The supervised warm start on mixed traces (`trace_batches`); returns the model's state.
    Checkpointed at its end (run_dir/checkpoints): a resumed run reads it back."""
    train = config.warm_start
    batches = trace_batches(config.heldout_task, config.traces, seq_len=train.data.seq_len,
                            batch_size=train.data.batch_size, seed=train.data.seed)
    iterator = iter(batches)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=1)
    try:
        if resume and checkpointer.latest_step() == train.steps:
            abstract = Trainer.create(train, abstract=True)
            state, _ = checkpointer.restore(abstract.state, iterator)
            return nnx.state(nnx.merge(abstract.graphdef, state).model)
        trainer = Trainer.create(train)
        bar = tqdm.tqdm(total=train.steps, desc="warm start", unit="step",
                        disable=not train.progress, dynamic_ncols=True)
        losses = []
        for step in range(1, train.steps + 1):
            metrics = trainer.step(next(iterator))
            if step % train.log_every == 0 or step == train.steps:
                losses.append({"step": step, "loss": float(metrics["loss"])})
                bar.set_postfix(loss=f"{losses[-1]['loss']:.3f}")
            bar.update(1)
        bar.close()
        checkpointer.save(train.steps, trainer.state, iterator,
                          metadata={"config": json.loads(json.dumps(config_dict(train)))})
        with open(os.path.join(run_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
        return nnx.state(trainer.model)
    finally:
        checkpointer.close()


# ------------------------------------------------------------------------------- evaluation


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from `correct` right answers among `samples` (Chen et al.):
    1 - C(samples - correct, k) / C(samples, k)."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@k needs 1 <= k <= samples={samples}, got k={k}")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def heldout_metrics(problems: list[Problem], groups: list[list[Trajectory]]) -> dict:
    """The report's metrics of G sampled trajectories of each problem (`grade`):

    pass@1, pass@G: unbiased estimates, averaged over problems;
    valid_call_rate: answered calls that are not invalid (an injected "ERR busy" is valid);
    tool_use: trajectories with a call; guess_rate: trajectories answering without one;
    mean_turns: model turns a trajectory (calls + the answer);
    recovery_rate: trajectories that met an injected "ERR busy" and still answered right;
    retry_rate: "ERR busy" results followed by the same call again; busy_results: their count;
    no_answer: trajectories without a readable answer; over_length: cut by a limit.
    """
    samples = len(groups[0])
    grades = [[grade(problem, t.tokens[t.prompt_length:]) for t in group]
              for problem, group in zip(problems, groups)]
    flat = [g for row in grades for g in row]
    trajectories = [t for group in groups for t in group]
    correct = [sum(g.correct for g in row) for row in grades]
    calls = sum(g.calls for g in flat)
    busy = sum(g.busy for g in flat)
    met_error = [g for g in flat if g.busy]
    return {
        "pass@1": float(np.mean([pass_at_k(samples, c, 1) for c in correct])),
        f"pass@{samples}": float(np.mean([pass_at_k(samples, c, samples) for c in correct])),
        "valid_call_rate": 1.0 - sum(g.invalid_calls for g in flat) / max(calls, 1),
        "tool_use": float(np.mean([g.calls > 0 for g in flat])),
        "guess_rate": float(np.mean([g.calls == 0 and g.answer is not None for g in flat])),
        "mean_turns": float(np.mean([t.turns for t in trajectories])),
        "recovery_rate": (float(np.mean([g.correct for g in met_error])) if met_error
                          else math.nan),
        "retry_rate": sum(g.retried for g in flat) / busy if busy else math.nan,
        "busy_results": busy,
        "no_answer": float(np.mean([g.answer is None for g in flat])),
        "over_length": float(np.mean([t.truncated for t in trajectories])),
    }


def sample_heldout(config: AgenticRLConfig, model, problems: list[Problem],
                   samples: int) -> list[list[Trajectory]]:
    """`samples` trajectories of each problem under the RL rollout's limits, with fresh tools
    (their injected failures start from the same draws in every evaluation)."""
    rollout_config = dataclasses.replace(config.rl.rollout, group_size=samples,
                                         token_budget=None, seed=EVAL_SAMPLING_SEED)
    tools = config.heldout_task.tools(config.busy_probability, seed=EVAL_TOOL_SEED)
    groups, _ = rollout(make_engine(model, config.rl), [p.prompt_tokens() for p in problems],
                        rollout_config, ToolEnvironment(tools))
    return groups


def trajectory_record(problem: Problem, t: Trajectory, **extra) -> dict:
    """A JSON line: the trajectory's bytes after the prompt as text (bytes that are no UTF-8 as
    surrogate escapes, so `record["completion"].encode("utf-8", "surrogateescape")` gives the
    bytes back; a special token reads as 0xFF, as in `grade`), its loss mask (one digit a
    token), and what the verifier read."""
    completion = t.tokens[t.prompt_length:]
    verdict = grade(problem, completion)
    return {**extra, "prompt": problem.prompt.decode(), "steps": problem.steps,
            "answer": problem.answer,
            "completion": completion_bytes(completion).decode("utf-8", "surrogateescape"),
            "loss_mask": "".join("1" if s else "0" for s in t.sampled[t.prompt_length:]),
            **dataclasses.asdict(verdict), "turns": t.turns, "finish": t.finish}


def evaluate(config: AgenticRLConfig, model, phase: str) -> tuple[dict, list[dict]]:
    """The held-out report of `model` (`heldout_metrics`, and pass@1 of the curve problems) and
    a record of every trajectory (`trajectory_record`)."""
    problems = config.heldout_problems()
    groups = sample_heldout(config, model, problems, config.eval_samples)
    metrics = heldout_metrics(problems, groups)
    curve = heldout_metrics(problems[:config.curve_problems], groups[:config.curve_problems])
    metrics["curve_pass@1"] = curve["pass@1"]
    records = [trajectory_record(problem, t, phase=phase, problem_index=i, sample=t.member)
               for i, (problem, group) in enumerate(zip(problems, groups)) for t in group]
    return metrics, records


def show(tokens, mask, width: int = 64) -> str:
    """Tokens as one character each (^ for BOS, a return arrow for the end byte, a dot for
    other bytes that do not print) over their loss mask, in lines of `width`."""
    text = "".join("^" if token == BOS_ID else "\u23ce" if token == STOP_TOKEN
                   else chr(token) if 32 <= token < 127 else "\u00b7" for token in tokens)
    digits = "".join("1" if m else "0" for m in mask)
    return "\n".join(f"{text[i:i + width]}\n{digits[i:i + width]}"
                     for i in range(0, len(text), width))


# --------------------------------------------------------------------------------- report

ROWS = (("pass@1", "{:.3f}"), ("pass@{k}", "{:.3f}"), ("valid_call_rate", "{:.3f}"),
        ("tool_use", "{:.3f}"), ("guess_rate", "{:.3f}"), ("mean_turns", "{:.2f}"),
        ("recovery_rate", "{:.3f}"), ("retry_rate", "{:.3f}"), ("no_answer", "{:.3f}"))


def table(before: dict, after: dict, samples: int) -> str:
    lines = ["| metric | warm start | after RL | change |", "|---|---|---|---|"]
    for name, form in ROWS:
        name = name.format(k=samples)
        change = after[name] - before[name]
        lines.append(f"| {name} | {form.format(before[name])} | {form.format(after[name])} | "
                     f"{change:+.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], before: dict, after: dict, iterations: int, out: str) -> None:
    """reward.png (mean training reward an iteration) and pass_at_1.png (held-out pass@1 of the
    curve problems: before RL, every curve_every iterations, after RL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [row for row in rows if "reward" in row]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in trained], [r["reward"] for r in trained], lw=1,
              label="batch mean")
    if len(trained) >= 5:
        smooth = np.convolve([r["reward"] for r in trained], np.ones(5) / 5, mode="valid")
        axis.plot([r["step"] for r in trained][4:], smooth, lw=2, label="mean of 5")
    axis.set(xlabel="RL iteration", ylabel="reward", title="training reward")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, "reward.png"), dpi=100)
    plt.close(figure)

    points = [(0, before["curve_pass@1"])]
    points += [(r["step"], r["curve_pass@1"]) for r in rows if "curve_pass@1" in r]
    points.append((iterations, after["curve_pass@1"]))
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(*zip(*sorted(set(points))), "o-")
    axis.set(xlabel="RL iteration", ylabel="pass@1", ylim=(0, 1),
             title="held-out pass@1 (curve problems)")
    figure.tight_layout()
    figure.savefig(os.path.join(out, "pass_at_1.png"), dpi=100)
    plt.close(figure)


def _cached(path: str, resume: bool, compute):
    """compute()'s JSON result, kept at `path`; a resumed run reads it back."""
    if resume and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = compute()
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return result


def run(config: AgenticRLConfig, out: str, resume: bool = False) -> dict:
    """The experiment (module docstring); returns the summary."""
    os.makedirs(out, exist_ok=True)
    policy = warm_start(config, os.path.join(out, "warm_start"), resume)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(
        lambda: HybridLM(config.warm_start.model, rngs=nnx.Rngs(0)))), policy)

    def evaluated(phase, model):
        metrics, records = evaluate(config, model, phase)
        return {"metrics": metrics, "trajectories": records}

    before = _cached(os.path.join(out, "before.json"), resume, lambda: evaluated("before", model))
    print(f"warm start: {_line(before['metrics'], config.eval_samples)}")
    curve = config.heldout_problems()[:config.curve_problems]

    def curve_point(rl_run):
        if rl_run.iteration == config.rl.iterations:
            return {}  # the evaluation after RL gives the last point
        groups = sample_heldout(config, rl_run.model, curve, config.eval_samples)
        return {"curve_pass@1": heldout_metrics(curve, groups)["pass@1"]}

    rl_dir = os.path.join(out, "rl")
    environment = ToolEnvironment(config.curriculum.task.tools(config.busy_probability))
    resuming_rl = resume and os.path.isdir(os.path.join(rl_dir, "checkpoints"))
    result = train_rl(config.rl, config.curriculum, environment, rl_dir, policy=policy,
                      resume=resuming_rl, every=config.curve_every, after_iteration=curve_point)
    after = evaluated("after", result.run.model)
    with open(os.path.join(out, "after.json"), "w") as f:
        json.dump(after, f, indent=2)
    with open(os.path.join(out, "trajectories.jsonl"), "w") as f:
        for record in before["trajectories"] + after["trajectories"]:
            f.write(json.dumps(record) + "\n")
    markdown = table(before["metrics"], after["metrics"], config.eval_samples)
    with open(os.path.join(out, "agentic_rl.md"), "w") as f:
        f.write(markdown + "\n")
    plot(result.rows, before["metrics"], after["metrics"], config.rl.iterations, out)
    summary = {"before": before["metrics"], "after": after["metrics"],
               "iterations": config.rl.iterations,
               "rl_cpu_seconds": sum(r["cpu_seconds"] for r in result.rows),
               "table": markdown}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"after RL:   {_line(after['metrics'], config.eval_samples)}\n\n{markdown}\n\n"
          f"run folder: {out}/")
    return summary


def _line(metrics: dict, samples: int) -> str:
    return (f"pass@1 {metrics['pass@1']:.3f}, pass@{samples} {metrics[f'pass@{samples}']:.3f}, "
            f"tool use {metrics['tool_use']:.2f}, valid calls {metrics['valid_call_rate']:.2f}")


def main(argv=None) -> dict:
    parser = make_parser("python -m experiments.agentic_rl", __doc__.split("\n\n")[0])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = resolve_config(parser, args, AgenticRLConfig())
    out = run_folder(args, config, DEFAULT_OUT)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; run folder: {out}")
    with one_line_errors(args.debug):
        return run(config, out, resume=args.resume)


if __name__ == "__main__":
    main()
