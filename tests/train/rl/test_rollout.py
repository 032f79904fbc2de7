"""Rollouts on the serving engine: behaviour log-probs equal the learner's teacher-forced
log-probs of the same tokens, tool results forced verbatim and masked out, limits, a group's
shared prompt prefix, partial rollouts equal to unbounded ones (large budget; small budget over
iterations through a saved buffer), stale groups finished with each token's behaviour log-prob
from the policy version that sampled it, and the learner's batch layout.

One small hybrid (a KDA and a Gated MLA layer) and one engine shape: the serving programs and
the teacher-forced log-prob program compile once for the module.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from models.config import preset
from models.lm import HybridLM
from models.serving import Engine
from train.rl.losses import RLLossConfig, policy_loss
from train.rl.rollout import (RolloutBuffer, RolloutConfig, ToolEnvironment, Trajectory,
                              make_batch, rollout, rollout_metrics)
from train.rl.tools import ToolResult, calculate
from train.step import FAST_COMPILE_OPTIONS, make_token_logp
from train.tokenizer import BOS_ID, PAD_ID, encode

PAUSES = tuple(range(200, 224))  # single-token "calls": an untrained model makes several
STOPS = (250, 251, 252, 253)
MAX_LENGTH, PAGE = 48, 4
CONFIG = RolloutConfig(group_size=3, max_length=MAX_LENGTH, max_turns=3, max_turn_tokens=16,
                       stop_tokens=STOPS, seed=1)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 256, 9), RNG.integers(0, 256, 11)]


class EchoEnvironment:
    """Pauses a turn at any of PAUSES; answers `<r>n:last</r>`, n the turn's tokens and last its
    final token, so that every answer depends on what the model wrote."""

    pause_sequences = tuple((token,) for token in PAUSES)

    @staticmethod
    def respond(turn: np.ndarray) -> tuple[np.ndarray, ToolResult]:
        text = f"<r>{len(turn)}:{int(turn[-1])}</r>"
        return encode(text, bos=False), ToolResult(text)


ECHO = EchoEnvironment()


@pytest.fixture(scope="module")
def model():
    """The `tiny` hybrid cut to two layers, KDA (its recurrent oracle: the same maths, a faster
    compile) then Gated MLA with a MoE, initialised by one compiled program."""
    cfg = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,))
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
    state = jax.jit(lambda: nnx.state(HybridLM(cfg, rngs=nnx.Rngs(0))),
                    compiler_options=FAST_COMPILE_OPTIONS)()
    return nnx.merge(graphdef, state)


def make_engine(model) -> Engine:
    return Engine(model, slots=4, num_pages=96, page_size=PAGE, max_seq_len=MAX_LENGTH,
                  prefill_chunk_tokens=8, prefix_sharing=True)


@pytest.fixture(scope="module")
def unbounded(model):
    """(groups, engine) of one rollout of PROMPTS without a token budget."""
    engine = make_engine(model)
    groups, buffer = rollout(engine, PROMPTS, CONFIG, ECHO)
    assert len(buffer) == 0 and int(buffer.next_group) == len(PROMPTS)
    return groups, engine


@pytest.fixture(scope="module")
def token_logp(model):
    """(a model like `model`, batch) -> its log-probs of the batch's targets [B, T], as the
    learner computes them (train.step.make_token_logp)."""
    program = make_token_logp(nnx.graphdef(model))

    def logp(policy, batch):
        return np.asarray(program(nnx.state(policy), {k: jnp.asarray(v) for k, v in
                                                      batch.items()}))
    return logp


def length_reward(t: Trajectory) -> float:
    return float(t.sampled.sum() % 5)


def same_trajectories(got, want, logprob_atol):
    assert [(t.group, t.member) for g in got for t in g] == [
        (t.group, t.member) for g in want for t in g]
    for a, b in zip([t for g in got for t in g], [t for g in want for t in g]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.sampled, b.sampled)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=logprob_atol)
        assert (a.finish, a.turns, a.tool_calls) == (b.finish, b.turns, b.tool_calls)


@pytest.mark.slow
def test_behaviour_logprobs_are_the_learner_s_teacher_forced_logprobs(model, unbounded,
                                                                    token_logp):
    """The key check: every sampled token's behaviour log-prob, tokens after tool results
    included, equals the log-prob the learner computes for it by one full forward of the whole
    trajectory with the same parameters; so a GRPO step on fresh rollouts sees ratios of 1."""
    groups, _ = unbounded
    assert sum(t.tool_calls for g in groups for t in g) >= 3
    batch = make_batch(groups, length_reward, MAX_LENGTH - 1)
    logp = token_logp(model, batch)
    mask = batch["loss_mask"] > 0
    assert mask.sum() > 50
    # Cached decoding and the full forward differ by float32 rounding (tests/models).
    np.testing.assert_allclose(batch["logp_behaviour"][mask], logp[mask], rtol=0, atol=1e-4)
    _, metrics = policy_loss(RLLossConfig("grpo"), jnp.asarray(logp), batch)
    np.testing.assert_allclose(metrics["ratio_max"], 1.0, atol=1e-4)
    assert float(metrics["tokens"]) == mask.sum()


def test_tool_results_are_forced_verbatim_and_only_model_tokens_are_in_the_loss(unbounded):
    """Re-reading each trajectory from its tokens alone: a turn runs to a pause token, a stop
    token or a limit; after a pause the environment's answer to that turn follows verbatim.
    The loss mask is 1 exactly on the turns' tokens, never on the prompt or an answer; the
    limits hold and the finish reasons say which ended the trajectory."""
    groups, _ = unbounded
    finishes = set()
    for t in (t for g in groups for t in g):
        assert len(t) <= MAX_LENGTH and not t.sampled[: t.prompt_length].any()
        np.testing.assert_array_equal(t.tokens[: t.prompt_length], PROMPTS[t.group])
        sampled = np.zeros(len(t), bool)
        start, turns = t.prompt_length, 0
        while start < len(t):
            turns += 1
            ends = [i for i in range(start, len(t)) if t.tokens[i] in PAUSES + STOPS]
            end = ends[0] + 1 if ends else len(t)
            sampled[start:end] = True
            assert end - start <= CONFIG.max_turn_tokens
            if end == len(t):
                break
            forced, _ = ECHO.respond(t.tokens[start:end])
            np.testing.assert_array_equal(t.tokens[end : end + forced.size], forced)
            start = end + forced.size
        np.testing.assert_array_equal(t.sampled, sampled)
        assert (t.turns, t.tool_calls) == (turns, turns - 1) and turns <= CONFIG.max_turns
        np.testing.assert_array_equal(t.logprobs != 0, sampled)
        np.testing.assert_array_equal(t.versions, np.where(sampled, 0, -1))
        last = int(t.tokens[-1])
        if t.finish == "stop":
            assert last in STOPS
        elif t.finish == "turns":
            assert last in PAUSES and turns == CONFIG.max_turns
        else:
            assert (len(t) == MAX_LENGTH or t.turn_tokens == CONFIG.max_turn_tokens
                    or len(t) + ECHO.respond(t.tokens[t.turn_start:])[0].size >= MAX_LENGTH)
        finishes.add(t.finish)
    assert {"turns", "length"} <= finishes
    batch = make_batch(groups, length_reward, MAX_LENGTH - 1)
    for row, t in enumerate(t for g in groups for t in g):
        np.testing.assert_array_equal(batch["loss_mask"][row, : len(t) - 1], t.sampled[1:])
        assert batch["loss_mask"][row, len(t) - 1 :].sum() == 0
    metrics = rollout_metrics(groups, version=0)
    assert metrics["tool_calls"] == np.mean([t.tool_calls for g in groups for t in g])
    assert metrics["staleness_max"] == 0


def test_a_group_shares_its_prompt_prefill_and_tool_turns_prefill_only_the_results(unbounded):
    """The G members of a group start from the pages and KDA state of the prompt's full pages
    that the first of them prefilled, yet draw their own tokens; after that the engine prefills
    nothing but the tools' results (no turn prefills the conversation again)."""
    groups, engine = unbounded
    shared = sum((CONFIG.group_size - 1) * ((len(p) - 1) // PAGE * PAGE) for p in PROMPTS)
    assert engine.stats.shared_tokens == shared > 0
    for group in groups:
        assert len({tuple(t.tokens) for t in group}) == CONFIG.group_size
    trajectories = [t for g in groups for t in g]
    results = sum(len(t) - t.prompt_length - t.sampled.sum() for t in trajectories)
    assert results > 0 and engine.stats.preemptions == 0
    assert engine.stats.prefill_tokens == (sum(t.prompt_length - 1 for t in trajectories)
                                           - shared + results)


def test_partial_rollouts_with_a_large_budget_are_the_unbounded_rollouts(model, unbounded):
    config = dataclasses.replace(CONFIG, token_budget=MAX_LENGTH)
    groups, buffer = rollout(make_engine(model), PROMPTS, config, ECHO)
    assert len(buffer) == 0
    same_trajectories(groups, unbounded[0], logprob_atol=0)


def saved_and_restored(buffer: RolloutBuffer, path) -> RolloutBuffer:
    """`buffer` written by an orbax checkpointer and read back without a target (a run that
    resumes does not know the buffer's shapes)."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, buffer)
    with ocp.StandardCheckpointer() as checkpointer:
        return RolloutBuffer(**checkpointer.restore(path))


def test_partial_rollouts_over_iterations_give_the_unbounded_tokens(model, unbounded, tmp_path):
    """A budget of 5 tokens per trajectory and iteration under an unchanged policy: the
    trajectories are cut, checkpointed (the buffer through orbax) and continued by re-prefilling
    their tokens, and end with the unbounded rollouts' tokens, each tagged with the iteration
    that sampled it."""
    budget = 5
    config = dataclasses.replace(CONFIG, token_budget=budget, max_staleness=100)
    done, buffer, cut = [], None, 0
    for version in range(20):
        groups, buffer = rollout(make_engine(model), PROMPTS if version == 0 else [], config,
                                 ECHO, version=version, buffer=buffer)
        done += groups
        cut = max(cut, len(buffer))
        if len(buffer) == 0:
            break
        buffer = saved_and_restored(buffer, tmp_path / str(version))
    assert len(buffer) == 0 and cut == len(PROMPTS) * CONFIG.group_size
    assert version >= 3
    # Re-prefilled and cached logits differ by float32 rounding.
    same_trajectories(done, unbounded[0], logprob_atol=1e-5)
    for t in (t for g in done for t in g):
        versions = t.versions[t.sampled]
        assert np.all(np.diff(versions) >= 0) and np.bincount(versions).max() <= budget


def test_stale_groups_finish_with_each_token_s_own_behaviour_logprob(model, token_logp):
    """Version 0 samples 4 tokens of each trajectory, version 1 (other parameters) continues
    them with max_staleness 1: every group finishes then (with max_staleness 2 none does), and
    each token's behaviour log-prob is that of the version that sampled it, which the learner's
    ratio compares with the current policy (the importance correction)."""
    newer, rng = nnx.clone(model), np.random.default_rng(1)
    nnx.update(newer, jax.tree.map(  # in numpy: no small programs to compile
        lambda p: (p := np.asarray(p)) + 0.3 * p.std() * rng.standard_normal(p.shape, p.dtype),
        nnx.state(newer, nnx.Param)))
    config = dataclasses.replace(CONFIG, token_budget=4, max_staleness=1)
    groups, buffer = rollout(make_engine(model), PROMPTS, config, ECHO, version=0)
    assert groups == [] and len(buffer) == len(PROMPTS) * CONFIG.group_size
    lenient = dataclasses.replace(config, max_staleness=2)
    assert rollout(make_engine(newer), [], lenient, ECHO, version=1, buffer=buffer)[0] == []
    groups, buffer = rollout(make_engine(newer), [], config, ECHO, version=1, buffer=buffer)
    assert len(groups) == len(PROMPTS) and len(buffer) == 0
    batch = make_batch(groups, length_reward, MAX_LENGTH - 1)
    old, new = batch["versions"] == 0, batch["versions"] == 1
    # Version 0 sampled 4 tokens of each trajectory, or all of one that ended sooner.
    np.testing.assert_array_equal(old.sum(1), np.minimum(4, batch["loss_mask"].sum(1)))
    assert new.sum() > old.sum()
    logp_old, logp_new = token_logp(model, batch), token_logp(newer, batch)
    np.testing.assert_allclose(batch["logp_behaviour"][old], logp_old[old], rtol=0, atol=1e-4)
    np.testing.assert_allclose(batch["logp_behaviour"][new], logp_new[new], rtol=0, atol=1e-4)
    assert np.abs(logp_new[old] - logp_old[old]).max() > 0.05  # the versions differ
    _, metrics = policy_loss(RLLossConfig("grpo"), jnp.asarray(logp_new), batch)
    ratios = np.exp(logp_new - batch["logp_behaviour"])[old | new]
    np.testing.assert_allclose(metrics["ratio_mean"], ratios.mean(), rtol=1e-5)
    assert rollout_metrics(groups, version=1)["staleness_max"] == 1


def test_the_tool_environment_answers_the_call_that_ends_a_turn():
    """A turn paused at a closing tag gets the result of the call it closes as `<r>...</r>`
    tokens (text cut to max_result_bytes); a bad call gets an "ERR ..." result."""
    environment = ToolEnvironment({"c": calculate}, max_result_bytes=8)
    assert [encode(f"</{tag}>", bos=False).tolist() for tag in ("c", "py", "n")] == [
        list(pause) for pause in environment.pause_sequences]

    def answer(turn):
        forced, result = environment.respond(turn)
        assert forced.tolist() == encode(result.encode(8), bos=False).tolist()
        return forced, result

    forced, result = answer(encode("so <c>37*12</c>", bos=False))
    assert result.ok and forced.tolist() == encode("<r>444</r>", bos=False).tolist()
    forced, result = answer(encode("<c>10**9</c>", bos=False))
    assert forced.tolist() == encode("<r>10000000</r>", bos=False).tolist()  # 8 bytes kept
    for turn, error in [("oops</c>", "malformed"), ("<py>print(1)</py>", "unavailable"),
                        ("<c>1//0</c>", "calculator")]:
        assert answer(encode(turn, bos=False))[1].error == error
    special = np.concatenate([encode("<c>1+", bos=False), [BOS_ID], encode("</c>", bos=False)])
    assert "UTF-8" in answer(special)[1].text


def trajectory(tokens, sampled, group, member, finish="stop") -> Trajectory:
    tokens, sampled = np.asarray(tokens, np.int32), np.asarray(sampled, bool)
    return Trajectory(group, member, 0, int(np.argmax(sampled)), tokens, sampled,
                      np.where(sampled, -0.5 - np.arange(tokens.size), 0).astype(np.float32),
                      np.where(sampled, 3, -1).astype(np.int32), tokens.size, finish=finish)


def test_the_batch_aligns_each_row_with_its_targets_and_pads_whole_groups():
    groups = [[trajectory([1, 2, 3, 4], [0, 1, 0, 1], 5, 0),
               trajectory([1, 2, 9], [0, 1, 1], 5, 1, "length")],
              [trajectory([7, 8], [0, 1], 6, 0), trajectory([7, 8, 8], [0, 0, 1], 6, 1)]]
    batch = make_batch(groups, lambda t: 10.0 * t.group + t.member, length=4, num_groups=3)
    P = PAD_ID
    np.testing.assert_array_equal(batch["tokens"][:4], [[1, 2, 3, P], [1, 2, P, P],
                                                        [7, P, P, P], [7, 8, P, P]])
    np.testing.assert_array_equal(batch["targets"][:4], [[2, 3, 4, P], [2, 9, P, P],
                                                         [8, P, P, P], [8, 8, P, P]])
    np.testing.assert_array_equal(batch["segment_ids"][:4], [[1, 1, 1, 0], [1, 1, 0, 0],
                                                             [1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask"][:4], [[1, 0, 1, 0], [1, 1, 0, 0],
                                                           [1, 0, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_array_equal(batch["logp_behaviour"][0], [-1.5, 0, -3.5, 0])
    np.testing.assert_array_equal(batch["versions"][1], [3, 3, -1, -1])
    np.testing.assert_array_equal(batch["rewards"], [[50, 51], [60, 61], [0, 0]])
    np.testing.assert_array_equal(batch["group_ids"], [5, 5, 6, 6, -1, -1])
    np.testing.assert_array_equal(batch["truncated"], [0, 1, 0, 0, 0, 0])
    padding = slice(4, 6)
    assert (batch["tokens"][padding] == PAD_ID).all() and batch["loss_mask"][padding].sum() == 0
    assert batch["segment_ids"][padding].sum() == 0
    refusals = [(lambda: make_batch(groups, length_reward, length=2), "length >= 3"),
                (lambda: make_batch(groups, length_reward, 4, num_groups=1), "num_groups"),
                (lambda: make_batch([groups[0][:1], groups[1]], length_reward, 4), "group 1"),
                (lambda: make_batch([[dataclasses.replace(groups[0][0], finish=None)]],
                                    length_reward, 4), "unfinished")]
    for refuse, match in refusals:
        with pytest.raises(ValueError, match=match):
            refuse()


def test_bad_configs_and_engines_are_refused_naming_the_argument(model):
    for field, value in [("group_size", 0), ("max_length", 1.5), ("max_turns", 0),
                         ("max_turn_tokens", 0), ("token_budget", 0), ("max_staleness", -1),
                         ("seed", -2), ("sampling", 1.0)]:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(CONFIG, **{field: value})
    short = Engine(model, slots=1, num_pages=8, page_size=PAGE, max_seq_len=MAX_LENGTH - 1,
                   prefill_chunk_tokens=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        rollout(short, PROMPTS, CONFIG, ECHO)
    with pytest.raises(ValueError, match="prompt"):
        rollout(make_engine(model), [np.zeros(MAX_LENGTH, np.int32)], CONFIG, ECHO)
