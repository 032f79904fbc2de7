"""`python -m experiments.bench_rl --smoke` on CPU: one GRPO iteration of the RL loop after a
warm-up, its tokens counted from the trajectories, its rates and shares from its times, nothing
compiled in the timed iteration, and the table and JSON it writes; the engine warm-up of a
bf16-compute policy (the GPU size's) compiles the programs its rollouts run."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments import bench_rl
from models.serving import compiled_programs
from train.loop import Trainer
from train.metrics import train_flops_per_token
from train.rl.arithmetic import Curriculum
from train.rl.loop import RLRun
from train.rl.rollout import ToolEnvironment, rollout

SIZE = bench_rl.SMOKE


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(result, markdown, saved JSON, the programs compiled during the timed iteration) of one
    smoke run."""
    out = tmp_path_factory.mktemp("bench") / "rl.md"
    compiles, timing = [], []

    def on_duration(event, seconds, **kwargs):
        if timing and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name", event))

    def timed_iteration(run, size):
        timing.append(True)
        try:
            return original(run, size)
        finally:
            timing.clear()

    original = bench_rl.timed_iteration
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_rl, "timed_iteration", timed_iteration)
        try:
            result = bench_rl.main(["--smoke", "--out", str(out)])
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
    return result, out.read_text(), json.loads(out.with_suffix(".json").read_text()), compiles


def test_prompts_of_length_are_the_curriculum_problems_of_that_length():
    curriculum = Curriculum(max_steps=(16,))
    task = bench_rl.PromptsOfLength(curriculum, length=17, count=3)
    lengths = [len(curriculum.prompt(i)) for i in range(task.indices[-1] + 1)]
    assert list(task.indices) == [i for i, n in enumerate(lengths) if n == 17][:3]
    for i, source in enumerate(task.indices):
        np.testing.assert_array_equal(task.prompt(i), curriculum.prompt(source))
        answer = f"A:{curriculum.problem(source).answer}\n".encode()
        assert task.reward(i, np.frombuffer(answer, np.uint8)) == 1.0
    with pytest.raises(ValueError, match="outside the 3 selected"):
        task.prompt(3)
    with pytest.raises(ValueError, match="choose another prefill_chunk"):
        _ = bench_rl.PromptsOfLength(curriculum, length=2, count=1, search=50).indices


@pytest.mark.slow
def test_every_trajectory_runs_to_the_limit_and_every_sampled_token_is_trained(smoke):
    timed = smoke[0]["iteration"]
    rows = SIZE.prompts * SIZE.group_size
    assert timed["trajectories"] == rows
    assert timed["trajectory_tokens"] == [SIZE.max_length] * rows
    assert timed["finishes"] == ["length"]
    # Every token after the prompt was sampled, and the step's loss mask holds exactly them.
    assert timed["sampled_tokens"] == rows * (SIZE.max_length - SIZE.prompt_length)
    assert timed["metrics"]["targets"] == timed["sampled_tokens"]
    assert timed["learner_positions"] == rows * (SIZE.max_length - 1)
    assert timed["metrics"]["groups_trained"] == SIZE.prompts


@pytest.mark.slow
def test_rates_and_shares_follow_from_the_times(smoke):
    result = smoke[0]
    timed = result["iteration"]
    assert timed["rollout_seconds"] > 0 and timed["learning_seconds"] > 0
    assert timed["rollout_seconds"] + timed["learning_seconds"] == pytest.approx(
        timed["iteration_seconds"])
    assert timed["rollout_share"] + timed["learning_share"] == pytest.approx(1.0)
    assert timed["rollout_tokens_per_second"] == pytest.approx(
        timed["sampled_tokens"] / timed["rollout_seconds"])
    assert timed["learner_tokens_per_second"] == pytest.approx(
        timed["learner_positions"] / timed["learning_seconds"])
    config = bench_rl.rl_config(SIZE).train.model
    flops = train_flops_per_token(config, SIZE.max_length - 1)["total"]
    assert timed["model_tflops_per_second"] == pytest.approx(
        timed["learner_tokens_per_second"] * flops / 1e12)
    assert timed["mfu"] is None  # no peak is defined for a CPU
    warmup = result["warmup"]
    assert all(warmup[key] > 0 for key in ("engine_seconds", "learner_compile_seconds",
                                           "first_step_seconds"))


@pytest.mark.slow
def test_the_timed_iteration_compiles_nothing(smoke):
    assert smoke[3] == []


@pytest.mark.slow
def test_the_engine_warm_up_of_a_bf16_policy_compiles_what_its_rollouts_run():
    # bf16 compute over float32 masters: the policy samples with the trainer's bf16 copies of the
    # expert weights, so an engine warmed up on the masters leaves the rollout programs to
    # compile. One KDA + MoE layer: a CPU has no bf16 dot with float32 output for MLA.
    size = dataclasses.replace(SIZE, overrides=dict(num_layers=1, kda_layers=(1,),
                                                    full_attn_layers=(), first_k_dense=0,
                                                    dtype="bfloat16"))
    config = bench_rl.rl_config(size)
    task = bench_rl.PromptsOfLength(Curriculum(max_steps=(16,)), size.prompt_length, size.prompts)
    run = RLRun(config, task, ToolEnvironment(task.curriculum.task.tools()),
                Trainer.create(config.train))
    bench_rl.warm_up_engine(run, size)
    before = compiled_programs()
    groups, _ = rollout(run.rollout_engine(), [task.prompt(i) for i in range(size.prompts)],
                        config.rollout, run.environment)
    assert len(groups) == size.prompts
    assert compiled_programs() == before


@pytest.mark.slow
def test_table_and_json_hold_the_numbers(smoke):
    result, markdown, saved, _ = smoke
    timed = result["iteration"]
    assert saved == json.loads(json.dumps(result))
    assert markdown.startswith(f"# Agentic RL: one GRPO iteration of the `{SIZE.preset}` preset")
    assert "| phase | seconds | share | tokens | tokens/s | model TFLOP/s | MFU % |" in markdown
    assert (f"| rollout (tokens sampled) | {timed['rollout_seconds']:.2f} | "
            f"{100 * timed['rollout_share']:.1f} | {timed['sampled_tokens']:,} | "
            f"{timed['rollout_tokens_per_second']:,.0f} |") in markdown
    assert (f"| learning (positions) | {timed['learning_seconds']:.2f} | "
            f"{100 * timed['learning_share']:.1f} | {timed['learner_positions']:,} | "
            f"{timed['learner_tokens_per_second']:,.0f} | "
            f"{timed['model_tflops_per_second']:.1f} | – |") in markdown
    assert (f"| learner step compiled (XLA peak {result['warmup']['memory_gib']['peak']:.1f} GiB)"
            f" | {result['warmup']['learner_compile_seconds']:.1f} |") in markdown
