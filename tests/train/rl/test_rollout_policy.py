"""train.rl.loop's rollout engine on a bf16-compute MoE policy: it samples with the expert weights in
bf16 (the trainer's compute copies, rewritten by each learner step), which gives exactly the
tokens and log-probs of the float32 masters under bf16 compute; and on the trainer's mesh each
serving program compiles once (the fresh caches carry the mesh's sharding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import preset
from models.generate import Sampling
from models.serving import Request, compiled_programs
from train.loop import MeshConfig, TrainConfig, Trainer
from train.optim import OptimConfig
from train.rl.loop import RLConfig, RLRun, make_engine, rollout_policy
from train.rl.losses import RLLossConfig
from train.rl.rollout import RolloutConfig, ToolEnvironment
from train.step import state_path_key

# One KDA + MoE layer, bf16 compute over float32 parameters.
MODEL = preset("tiny", num_layers=1, kda_layers=(1,), full_attn_layers=(), first_k_dense=0,
               dtype="bfloat16")
CONFIG = RLConfig(
    train=TrainConfig(model=MODEL, mesh=MeshConfig(data=1), steps=2, fast_compile=True,
                      optim=OptimConfig(learning_rate=1e-2, warmup_steps=1,
                                        schedule="constant", weight_decay=0.0),
                      progress=False),
    loss=RLLossConfig("grpo"),
    rollout=RolloutConfig(group_size=4, max_length=10, seed=1),
    prompts_per_iteration=2, slots=8, page_size=1, prefill_chunk_tokens=1)
# A group's four members share their prompt (prefix sharing: the slot copies run).
REQUESTS = [Request((5, 6, 7), Sampling(temperature=1.0), seed=member, max_tokens=5)
            for member in range(4)]


class ParityTask:
    """Prompts of three bytes; reward: the parity of the completion's sum (rewards differ within
    a group, so the step moves the policy)."""

    @staticmethod
    def prompt(index):
        return np.array([10 + index, 20, 30], np.int32)

    @staticmethod
    def reward(index, completion):
        return float(np.sum(completion) % 2)


def leaves(model) -> dict[str, np.ndarray]:
    """The model's state by path key, on the host."""
    state = jax.device_get(jax.tree_util.tree_leaves_with_path(nnx.state(model)))
    return {state_path_key(tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))):
            np.asarray(leaf) for path, leaf in state}


@pytest.fixture(scope="module")
def run():
    return RLRun(CONFIG, ParityTask(), ToolEnvironment({}), Trainer.create(CONFIG.train))


@pytest.fixture(scope="module")
def sampled(run):
    """(programs compiled by the first engine of the rollout policy, its completions, the
    completions of an engine of the float32 masters)."""
    jax.clear_caches()  # count this engine's programs alone, whatever ran before in the process
    before = compiled_programs()
    policy = make_engine(rollout_policy(run.trainer), CONFIG).run(REQUESTS)
    compiled = compiled_programs() - before
    return compiled, policy, make_engine(run.model, CONFIG).run(REQUESTS)


@pytest.mark.slow
def test_the_engine_reads_bf16_expert_weights_and_samples_the_f32_model_s_tokens(run, sampled):
    masters, policy = leaves(run.model), leaves(rollout_policy(run.trainer))
    copies = set(run.trainer.state["compute_copies"])
    assert copies and copies <= set(policy)  # the expert weights of the MoE layer
    for key, value in policy.items():
        if key in copies:
            assert value.dtype == jnp.bfloat16 and masters[key].dtype == np.float32
            np.testing.assert_array_equal(value, masters[key].astype(value.dtype))
        else:
            assert value.dtype == masters[key].dtype
    _, bf16, f32 = sampled
    for got, want in zip(bf16, f32, strict=True):
        assert got.tokens == want.tokens and got.logprobs == want.logprobs


@pytest.mark.slow
def test_each_serving_program_compiles_once_on_the_trainer_s_mesh(sampled):
    compiled, _, _ = sampled
    assert compiled == 4  # the one prefill bucket, decode, and the two prefix copies


@pytest.mark.slow
def test_the_rollout_policy_is_refreshed_after_a_learner_step(run):
    copies = set(run.trainer.state["compute_copies"])
    before = {key: value for key, value in leaves(rollout_policy(run.trainer)).items()
              if key in copies}
    row = run.iterate()
    assert row["groups_trained"] == 2 and row["skipped"] == 0
    masters, after = leaves(run.model), leaves(rollout_policy(run.trainer))
    for key in copies:
        np.testing.assert_array_equal(after[key], masters[key].astype(after[key].dtype))
        assert not np.array_equal(after[key], before[key]), key
