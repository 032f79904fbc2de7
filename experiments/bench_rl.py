"""Agentic RL benchmark: one GRPO iteration of `train.rl.loop` (rollouts on the serving engine,
then the learner step), each phase timed, with rollout tokens/s, learner tokens/s and MFU.

    python -m experiments.bench_rl --gpu     # `1b`, 2 prompts x 8 trajectories of 4,097 tokens
                                             # -> benchmarks/rl_<card>.md (about 5 minutes on an
                                             # H200, most of it compiling)
    python -m experiments.bench_rl --smoke   # a two-layer `tiny` on CPU, trajectories of 33

What runs is the RL loop's own iteration, `train.rl.loop.RLRun.iterate`: a fresh engine of the
current policy (`make_engine`: P * G slots, pages for every slot at full length, prefix sharing),
`train.rl.rollout.rollout` of G = 8 trajectories for each of P prompts (one engine slot each), the
rewards, `make_batch` (B = P * G rows of max_length - 1 = 4,096 positions) and one GRPO step of
`train.rl.learner.make_rl_step` (AdamW, Quantile Balancing, the finite checks). The model is the
preset as `train` builds it (`experiments.bench_train.train_config`): float32 master parameters,
bfloat16 compute; the engine reads the train state's parameters as `train_rl` hands them over.

Trajectories of 4K tokens: the prompts are arithmetic problems of the RL task
(`train.rl.arithmetic.Curriculum`, chains of 1 to 16 steps), its calculator behind the tool-call
pause sequences and its verifier as the reward, but the rollouts have no stop token, so every
trajectory runs to the length limit (`max_length`; finish "length"). An untrained model calls no
tool (a call needs its tag's bytes in a row), so the rollout is prefill and decode at full
length: what the engine spends on a 4K-token trajectory, not on the task. The problems are those
whose prompt is `prefill_chunk + 1` tokens long: a group's first member prefills one chunk, the
other seven start from its kept prefix (the prompt's last token goes in through decode), and the
engine compiles prefill programs of one chunk length only.

2 prompts (16 trajectories, 65,536 learner positions): the learner's batch is one step, and 16
rows of 4,096 with `remat full` fit an H200 (`models.memory` plans 97 GiB; 32 rows, 132 GiB, do
not), while the whole run stays near 5 minutes. The engine is built and dropped inside the
rollout phase, so the learner has the device to itself.

Warm-up (compile) iteration, timed apart: the engine's programs through a short rollout of
the same prompts on the engine an iteration builds (`RLRun.rollout_engine`: the same shapes, and
the policy's bf16 expert weights rather than the float32 masters, whose programs would differ;
`WARMUP_TOKENS` tokens a trajectory), the learner step compiled ahead of time for the batch of
those trajectories (padded to the full length: the shapes of the timed batch) and run once, and
the learning-rate schedule's eager ops.
The run's step is then that compiled executable, so the timed iteration compiles nothing.

Numbers: rollout = the iteration's `rollout_seconds` (engine built, every token sampled); learning
= the rest of the iteration until the new state is ready (rewards, batch, the step, its metrics);
rollout tokens/s = tokens sampled / rollout; learner tokens/s = B * T positions / learning; MFU =
learner tokens/s * `train.metrics.train_flops_per_token` (model FLOPs, 6 N_active per token plus
attention; recomputation not counted) over the device's dense bf16 peak (none on a CPU). The
table and JSON are rewritten as each number is measured.
"""

import argparse
import dataclasses
import functools
import os
import time
from pathlib import Path

import jax
import numpy as np

from experiments.bench_train import (GPU_MEMORY_FRACTION, BenchSetup, device_memory_limit,
                                     memory_analysis, train_config)
from experiments.harness import (cell, command_line, gpu_table, package_version, report_preamble,
                                 table_row, write_json, write_markdown)
from models.config import count_params, format_count, preset
from train.loop import Trainer
from train.metrics import peak_flops_per_device, train_flops_per_token
from train.rl.arithmetic import Curriculum
from train.rl.loop import RLConfig, RLRun
from train.rl.losses import RLLossConfig
from train.rl.rollout import RolloutConfig, ToolEnvironment, Trajectory, make_batch, rollout

# Tokens each trajectory samples in the warm-up rollout: enough to run every program once.
WARMUP_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmark size: the model, P prompts x G trajectories of max_length tokens, the
    engine's pages and prefill chunks, and the learner's recomputation and loss chunks."""

    preset: str
    overrides: dict  # preset fields replaced (the smoke size's fewer layers)
    prompts: int  # P
    group_size: int  # G
    max_length: int  # tokens of a trajectory, prompt included
    page_size: int
    prefill_chunk: int  # the prompts are prefill_chunk + 1 tokens
    remat: str
    loss_chunk_tokens: int
    fast_compile: bool  # XLA's cheapest optimisation for the learner step (`TrainConfig`)

    @property
    def prompt_length(self) -> int:
        return self.prefill_chunk + 1


GPU = Size("1b", {}, prompts=2, group_size=8, max_length=4097, page_size=64, prefill_chunk=64,
           remat="full", loss_chunk_tokens=4096, fast_compile=False)
SMOKE = Size("tiny", dict(num_layers=2, kda_layers=(1,), full_attn_layers=(2,)), prompts=2,
             group_size=4, max_length=33, page_size=4, prefill_chunk=16, remat="none",
             loss_chunk_tokens=16, fast_compile=True)


def rl_config(size: Size) -> RLConfig:
    """The RL run of `size`: GRPO without KL, the trainer of `bench_train` (one device, AdamW) at
    B = P * G rows of max_length - 1, an engine slot per trajectory, no stop token."""
    setup = BenchSetup(size.preset, batch=size.prompts * size.group_size,
                       seq_len=size.max_length - 1, steps=1, warmup=0, remat=size.remat)
    train = dataclasses.replace(
        train_config(setup, "adamw"),
        model=preset(size.preset, remat=size.remat, **size.overrides),
        loss_chunk_tokens=size.loss_chunk_tokens, fast_compile=size.fast_compile)
    return RLConfig(train=train, loss=RLLossConfig("grpo"),
                    rollout=RolloutConfig(group_size=size.group_size, max_length=size.max_length),
                    prompts_per_iteration=size.prompts, slots=size.prompts * size.group_size,
                    page_size=size.page_size, prefill_chunk_tokens=size.prefill_chunk)


@dataclasses.dataclass(frozen=True)
class PromptsOfLength:
    """The problems of `curriculum` whose prompt is `length` tokens, in order: an `RLTask`
    (`train.rl.loop`) whose prompt i is the i-th of them, with the curriculum's reward."""

    curriculum: Curriculum
    length: int
    count: int
    search: int = 100_000  # problems looked at, at most

    @functools.cached_property
    def indices(self) -> tuple[int, ...]:
        """The selected problems' indices in the curriculum."""
        found = []
        for index in range(self.search):
            if len(self.curriculum.prompt(index)) == self.length:
                found.append(index)
                if len(found) == self.count:
                    return tuple(found)
        raise ValueError(f"only {len(found)} of the first {self.search} problems have prompts of "
                         f"{self.length} tokens, {self.count} needed; choose another "
                         "prefill_chunk")

    def prompt(self, index: int) -> np.ndarray:
        return self.curriculum.prompt(self._source(index))

    def reward(self, index: int, completion) -> float:
        return self.curriculum.reward(self._source(index), completion)

    def _source(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise ValueError(f"prompt index {index} outside the {self.count} selected prompts")
        return self.indices[index]


def warm_up_engine(run: RLRun, size: Size) -> list[list[Trajectory]]:
    """The warm-up's rollout: the iteration's prompts, `WARMUP_TOKENS` tokens a trajectory, on
    the engine an iteration builds (`RLRun.rollout_engine`: the policy's parameter dtypes, so
    its programs are those the timed rollout runs). Returns its finished groups."""
    config = run.config
    prompts = [run.task.prompt(i) for i in range(config.prompts_per_iteration)]
    short = dataclasses.replace(config.rollout, max_length=size.prompt_length + WARMUP_TOKENS)
    groups, _ = rollout(run.rollout_engine(), prompts, short, run.environment)
    return groups


def warm_up(run: RLRun, size: Size) -> dict:
    """The warm-up (compile) iteration (module docstring): compiles the engine's programs and
    the learner step, runs the step once, and makes the compiled step the run's. Returns
    {engine_seconds, learner_compile_seconds, first_step_seconds, memory_gib}."""
    config = run.config
    start = time.perf_counter()
    groups = warm_up_engine(run, size)
    engine_seconds = time.perf_counter() - start
    print(f"warm-up: engine programs compiled and a {WARMUP_TOKENS}-token rollout in "
          f"{engine_seconds:.1f} s", flush=True)
    batch = make_batch(groups, lambda t: run.task.reward(t.group, t.tokens[t.prompt_length:]),
                       length=config.rollout.max_length - 1,
                       num_groups=config.prompts_per_iteration)
    trainer = run.trainer
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        placed = trainer.place(batch)
        compiled = run.step_fn.lower(trainer.state, placed).compile()
    compile_seconds = time.perf_counter() - start
    memory = memory_analysis(compiled)
    limit = device_memory_limit()
    print(f"warm-up: learner step compiled in {compile_seconds:.1f} s; XLA plans a peak of "
          f"{memory['peak']:.2f} GiB" + ("" if limit is None else f" of {limit:.2f} GiB"),
          flush=True)
    if limit is not None and memory["peak"] > limit:
        raise RuntimeError(
            f"the learner step of {size.prompts} x {size.group_size} rows of "
            f"{size.max_length - 1} positions needs {memory['peak']:.1f} GiB, more than the "
            f"{limit:.1f} GiB the device allocator has; rerun with fewer --prompts or a shorter "
            "--max-length")
    run.step_fn = compiled  # the run's own step, compiled: the timed iteration compiles nothing
    run.schedule(0)  # the learning-rate schedule's eager ops, which the iteration reads
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        trainer.state, metrics = compiled(trainer.state, placed)
    jax.block_until_ready((trainer.state, metrics))
    first_step_seconds = time.perf_counter() - start
    print(f"warm-up: first learner step {first_step_seconds:.2f} s", flush=True)
    return dict(engine_seconds=engine_seconds, learner_compile_seconds=compile_seconds,
                first_step_seconds=first_step_seconds, memory_gib=memory)


def timed_iteration(run: RLRun, size: Size) -> dict:
    """One iteration of the run (`RLRun.iterate`), split into rollout and learning; its
    metrics row and the throughputs (module docstring)."""
    start = time.perf_counter()
    row = run.iterate()
    jax.block_until_ready(run.trainer.state)
    seconds = time.perf_counter() - start
    rollout_seconds = row["rollout_seconds"]
    learning_seconds = seconds - rollout_seconds
    trajectories = [t for group in run.batch_groups for t in group]
    sampled = int(sum(t.sampled.sum() for t in trajectories))
    positions = size.prompts * size.group_size * (size.max_length - 1)
    flops = train_flops_per_token(run.config.train.model, size.max_length - 1)["total"]
    learner_rate = positions / learning_seconds
    peak = peak_flops_per_device()
    numbers = dict(
        iteration_seconds=seconds, rollout_seconds=rollout_seconds,
        learning_seconds=learning_seconds, rollout_share=rollout_seconds / seconds,
        learning_share=learning_seconds / seconds, trajectories=len(trajectories),
        trajectory_tokens=[len(t) for t in trajectories],
        finishes=sorted({t.finish for t in trajectories}),
        sampled_tokens=sampled, rollout_tokens_per_second=sampled / rollout_seconds,
        learner_positions=positions, learner_tokens_per_second=learner_rate,
        model_tflops_per_second=learner_rate * flops / 1e12,
        mfu=None if peak is None else learner_rate * flops / peak,
        metrics=row)
    print(f"iteration: {seconds:.1f} s; rollout {rollout_seconds:.1f} s "
          f"({100 * numbers['rollout_share']:.0f}%), {numbers['rollout_tokens_per_second']:,.0f} "
          f"tokens/s; learning {learning_seconds:.2f} s, {learner_rate:,.0f} tokens/s, "
          f"{numbers['model_tflops_per_second']:.1f} TFLOP/s, MFU "
          f"{cell(None if numbers['mfu'] is None else 100 * numbers['mfu'], '.1f')}%", flush=True)
    return numbers


def markdown(result: dict, command: str) -> list[str]:
    """The table of `result` (what a run cut short measured)."""
    size, params = result["size"], result["params"]
    lines = report_preamble(f"Agentic RL: one GRPO iteration of the `{size['preset']}` preset",
                            command, f"flax {package_version('flax')}")
    lines += [
        "",
        f"{format_count(params['total'])} parameters, {format_count(params['active'])} active "
        f"per token (embedding excluded), {result['dtypes']['param']} master weights and "
        f"{result['dtypes']['compute']} compute (the engine reads the train state's parameters, "
        f"as `train_rl` does). {size['prompts']} prompts x "
        f"{size['group_size']} trajectories of {size['max_length']:,} tokens (arithmetic "
        f"problems with {size['prefill_chunk'] + 1}-token prompts, no stop token: every "
        "trajectory runs to the length limit); engine slots "
        f"{size['prompts'] * size['group_size']}, pages of {size['page_size']}, prefix sharing; "
        f"learner batch {size['prompts'] * size['group_size']} x {size['max_length'] - 1:,}, "
        f"GRPO, AdamW, remat {size['remat']}, loss chunks of {size['loss_chunk_tokens']:,}. "
        f"Why {size['prompts']} prompts: the docstring of `experiments/bench_rl.py`.",
        "",
        "## Warm-up (compile) iteration",
        "",
        table_row("part", "seconds"),
        table_row("---", "---"),
        table_row("model and optimizer initialised", cell(result.get("build_seconds"), ".1f")),
    ]
    warm = result.get("warmup", {})
    memory = warm.get("memory_gib", {})
    lines += [
        table_row(f"engine programs compiled (a {WARMUP_TOKENS}-token rollout)",
                  cell(warm.get("engine_seconds"), ".1f")),
        table_row("learner step compiled (XLA peak "
                  f"{cell(memory.get('peak'), '.1f')} GiB)",
                  cell(warm.get("learner_compile_seconds"), ".1f")),
        table_row("first learner step", cell(warm.get("first_step_seconds"), ".2f")),
    ]
    timed = result.get("iteration")
    if timed is None:
        return lines + ["", "The run stopped before the timed iteration."]
    mfu = None if timed["mfu"] is None else 100 * timed["mfu"]
    row = timed["metrics"]
    lines += [
        "",
        "## One GRPO iteration",
        "",
        table_row("phase", "seconds", "share", "tokens", "tokens/s", "model TFLOP/s", "MFU %"),
        table_row(*["---"] * 7),
        table_row("rollout (tokens sampled)", cell(timed["rollout_seconds"], ".2f"),
                  cell(100 * timed["rollout_share"], ".1f"), f"{timed['sampled_tokens']:,}",
                  cell(timed["rollout_tokens_per_second"], ",.0f"), "", ""),
        table_row("learning (positions)", cell(timed["learning_seconds"], ".2f"),
                  cell(100 * timed["learning_share"], ".1f"), f"{timed['learner_positions']:,}",
                  cell(timed["learner_tokens_per_second"], ",.0f"),
                  cell(timed["model_tflops_per_second"], ".1f"), cell(mfu, ".1f")),
        table_row("iteration", cell(timed["iteration_seconds"], ".2f"), "100.0", "", "", "", ""),
        "",
        f"{timed['trajectories']} trajectories of {min(timed['trajectory_tokens']):,} to "
        f"{max(timed['trajectory_tokens']):,} tokens (finish: {', '.join(timed['finishes'])}); "
        f"tool calls per trajectory {row.get('tool_calls', 0):.2f}; mean reward "
        f"{row.get('reward', 0):.2f}. Rollout: the engine built and every token sampled; "
        "learning: rewards, the batch, the step and its metrics, until the new state is ready. "
        "MFU counts model FLOPs (`train.metrics.train_flops_per_token`), not the recomputation of "
        f"remat {size['remat']}, against the device's dense bf16 peak.",
    ]
    return lines


def report(result: dict, command: str, out: Path | None) -> None:
    """Rewrites the table at `out` and the numbers next to it (.json); nothing without `out`."""
    if out is not None:
        write_markdown(out, markdown(result, command))
        write_json(out.with_suffix(".json"), result)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_rl",
                                     description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="store_true",
                       help=f"{GPU.preset}, {GPU.prompts} prompts x {GPU.group_size}, "
                       f"trajectories of {GPU.max_length} tokens (about 5 minutes on an H200)")
    which.add_argument("--smoke", action="store_true", help="a two-layer tiny model on CPU")
    parser.add_argument("--prompts", type=int,
                        help="P, prompts of the iteration (G trajectories each)")
    parser.add_argument("--max-length", type=int,
                        help="tokens of a trajectory, prompt included (the batch's rows hold "
                        "one less)")
    parser.add_argument("--out", type=Path, help="markdown table (--gpu default: "
                        "benchmarks/rl_<card>.md), the numbers next to it as .json")
    args = parser.parse_args(argv)
    size = GPU if args.gpu else SMOKE
    for name, value in (("prompts", args.prompts), ("max_length", args.max_length)):
        if value is not None:
            size = dataclasses.replace(size, **{name: value})
    if size.prompts < 1 or size.max_length <= size.prompt_length:
        parser.error(f"--prompts must be at least 1 and --max-length above the prompts' "
                     f"{size.prompt_length} tokens")
    if args.gpu:  # before anything starts the backend, which reads it once
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
        if jax.default_backend() != "gpu":
            parser.error(f"--gpu needs a CUDA backend, but JAX runs on {jax.default_backend()!r}")
    out = args.out or (gpu_table("rl") if args.gpu else None)
    command = command_line("experiments.bench_rl", argv)
    config = rl_config(size)
    task = PromptsOfLength(Curriculum(max_steps=(16,)), size.prompt_length, size.prompts)
    counts = count_params(config.train.model)
    result = {"size": dataclasses.asdict(size),
              "params": {k: counts[k] for k in ("total", "active", "embedding")},
              "dtypes": {"param": config.train.model.param_dtype,
                         "compute": config.train.model.dtype},
              "prompt_indices": list(task.indices), "device": jax.devices()[0].device_kind}
    start = time.perf_counter()
    trainer = Trainer.create(config.train)
    jax.block_until_ready(trainer.state)
    result["build_seconds"] = time.perf_counter() - start
    print(f"model and optimizer initialised in {result['build_seconds']:.1f} s", flush=True)
    report(result, command, out)
    run = RLRun(config, task, ToolEnvironment(task.curriculum.task.tools()), trainer)
    result["warmup"] = warm_up(run, size)
    report(result, command, out)
    result["iteration"] = timed_iteration(run, size)
    report(result, command, out)
    return result


if __name__ == "__main__":
    main()
