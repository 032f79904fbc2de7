"""train.rl.arithmetic: problems deterministic per (seed, index) and evaluating with the real
calculator, train and held-out splits disjoint, warm-start traces that the real tools replay
byte for byte (calls, lookups, injected failures), loss masks exactly 0 on prompt and tool bytes
(in the traces and in the packed batches), the difficulty knob equal to the calls needed, and the
verifier on right, wrong, malformed and garbage completions."""

import dataclasses
import re

import numpy as np
import pytest

from train.data import EVAL_TASK_SEED
from train.rl.arithmetic import (STOP_TOKEN, ArithmeticTask, Curriculum, NotesBook, Problem,
                                 TraceConfig, grade, is_heldout_problem, make_trace, reward,
                                 split_of, step_calculator, trace_batches, trace_dataset)
from train.rl.tools import TOOL_TAGS, FlakyTool, ToolResult, calculate, find_call, run_call
from train.tokenizer import BOS_ID

BOOK = NotesBook(seed=3, names_per_value=2, passage_bytes=256)
CHAINS = ArithmeticTask(min_steps=1, max_steps=16)
NAMED = ArithmeticTask(min_steps=1, max_steps=6, named_share=0.5, book=BOOK)
MIXED = TraceConfig(guess_share=0.3, busy_probability=0.3)
PAUSES = tuple(f"</{tag}>".encode() for tag in TOOL_TAGS)
PROBLEM = Problem(37, (("*", 12), ("+", 905), ("-", 88)), ("", "", "", ""))


def trace_bytes(trace) -> bytes:
    assert trace.tokens[0] == BOS_ID
    return trace.tokens[1:].astype(np.uint8).tobytes()


def test_problems_and_traces_are_pure_functions_of_seed_and_index():
    forward = [CHAINS.problem(5, i) for i in range(40)]
    backward = [CHAINS.problem(5, i) for i in reversed(range(40))][::-1]
    assert forward == backward
    assert forward != [CHAINS.problem(6, i) for i in range(40)]
    assert len({p.expression() for p in forward}) == 40
    dataset = trace_dataset(NAMED, MIXED, seed=5, seq_len=4096, num_examples=30)
    for i in (17, 3, 17):  # random access, any order
        example = make_trace(NAMED, MIXED, 5, i).example()
        np.testing.assert_array_equal(dataset[i]["tokens"], example["tokens"])
        np.testing.assert_array_equal(dataset[i]["target_mask"], example["target_mask"])


def test_the_expression_is_the_chain_under_the_real_calculator():
    assert PROBLEM.prompt == b"Q:((37*12)+905)-88=" and PROBLEM.values == (444, 1349, 1261)
    steps = set()
    for i in range(200):
        problem = CHAINS.problem(0, i)
        steps.add(problem.steps)
        assert calculate(problem.expression(named=False)) == ToolResult(str(problem.answer))
        assert all(1 <= c <= 999 for c in problem.constants)
        assert all(0 < v < 10**7 for v in problem.values)
    assert steps == set(range(1, 17))  # the knob's whole range is drawn


def test_train_and_heldout_splits_never_overlap():
    assert (split_of(0), split_of(EVAL_TASK_SEED - 1), split_of(EVAL_TASK_SEED)) == (
        "train", "train", "heldout")
    train = [CHAINS.problem(seed, i) for seed in (0, 1, EVAL_TASK_SEED - 1) for i in range(300)]
    heldout = [CHAINS.problem(EVAL_TASK_SEED + seed, i) for seed in (0, 1) for i in range(200)]
    assert not any(map(is_heldout_problem, train)) and all(map(is_heldout_problem, heldout))
    first_steps = [{(p.first, p.operations[0]) for p in split} for split in (train, heldout)]
    assert not first_steps[0] & first_steps[1]
    with pytest.raises(ValueError, match="held-out seed"):
        trace_dataset(CHAINS, MIXED, seed=EVAL_TASK_SEED, seq_len=1024)
    with pytest.raises(ValueError, match="seed"):
        CHAINS.problem(-1, 0)


def replay(trace, tools, max_result_bytes):
    """Runs the trace's model turns against `tools` as the rollouts' environment does (a turn
    ends at its first closing tag; its first complete call runs; the result's bytes follow) and
    checks every byte after the prompt. Returns the calls [(tag, argument, result text)]."""
    data, position = trace_bytes(trace), len(trace.problem.prompt)
    busy = {tag: FlakyTool(tool, 1.0, seed=0) for tag, tool in tools.items()}
    calls = []
    while True:
        ends = [data.find(p, position) for p in PAUSES]
        ends = [end + len(p) for end, p in zip(ends, PAUSES) if end >= 0]
        if not ends:
            break
        turn = data[position:min(ends)]
        call = find_call(turn)
        result = run_call(call, tools)
        if data.startswith(b"<r>ERR busy</r>", min(ends)):
            result = run_call(call, busy)
        forced = result.encode(max_result_bytes)
        assert data[min(ends):min(ends) + len(forced)] == forced
        calls.append((call.tag, call.argument.decode(), result.text))
        position = min(ends) + len(forced)
    final = data[position:]
    assert final.startswith(b"A:") and final.endswith(bytes([STOP_TOKEN]))
    assert final.count(bytes([STOP_TOKEN])) == 1
    return calls


@pytest.mark.parametrize("task", [CHAINS, NAMED], ids=["chains", "named"])
def test_traces_are_what_the_real_tools_answer(task):
    tools = task.tools()
    assert set(tools) == ({"c", "n"} if task.named_share else {"c"})
    kinds = set()
    for i in range(60):
        trace = make_trace(task, MIXED, 1, i)
        calls = replay(trace, tools, MIXED.max_result_bytes)
        answers = [text for tag, _, text in calls if tag == "c" and text != "ERR busy"]
        if trace.guessed:
            assert calls == []
        else:
            assert answers == [str(v) for v in trace.problem.values]
        for tag, argument, text in calls:
            if tag == "n" and text != "ERR busy":
                # The passage holds the constant's line: the model can read the value there.
                value = trace.problem.constants[trace.problem.names.index(argument)]
                assert f"{argument}={value}\n" in text
        kinds |= {trace.guessed, ("busy", trace.busy > 0)}
    assert kinds == {True, False, ("busy", True), ("busy", False)}


def expected_target_mask(tokens: np.ndarray) -> np.ndarray:
    """1 on the model's bytes, read from the bytes alone: 0 on BOS, the prompt (up to the first
    "=") and every `<r>...</r>`."""
    data = tokens[1:].astype(np.uint8).tobytes()
    mask = np.ones(tokens.size, np.float32)
    mask[: data.index(b"=") + 2] = 0.0
    for match in re.finditer(rb"<r>.*?</r>", data, flags=re.DOTALL):
        mask[match.start() + 1:match.end() + 1] = 0.0
    return mask


def test_loss_mask_is_zero_exactly_on_prompt_and_tool_bytes():
    for task in (CHAINS, NAMED):
        for i in range(40):
            trace = make_trace(task, MIXED, 2, i)
            np.testing.assert_array_equal(trace.target_mask, expected_target_mask(trace.tokens))


def test_trace_batches_are_trainer_batches_with_the_traces_mask():
    seq_len, batch_size = 1024, 4
    iterator = iter(trace_batches(CHAINS, MIXED, seq_len=seq_len, batch_size=batch_size,
                                  seed=4, packing_bins=4))
    first = next(iterator)
    state = iterator.get_state()
    second = next(iterator)
    assert set(first) == {"tokens", "targets", "loss_mask", "segment_ids", "positions"}
    assert all(v.shape == (batch_size, seq_len) for v in first.values())
    for batch in (first, second):
        for row in range(batch_size):
            for segment in set(batch["segment_ids"][row].tolist()) - {0}:
                where = np.flatnonzero(batch["segment_ids"][row] == segment)
                tokens = batch["tokens"][row, where]
                np.testing.assert_array_equal(batch["loss_mask"][row, where[:-1]],
                                              expected_target_mask(tokens)[1:])
                assert batch["loss_mask"][row, where[-1]] == 0
    iterator.set_state(state)
    np.testing.assert_array_equal(next(iterator)["tokens"], second["tokens"])
    too_short = iter(trace_batches(ArithmeticTask(16, 16), MIXED, seq_len=64, batch_size=1,
                                   seed=0))
    with pytest.raises(ValueError, match="seq_len=64"):
        next(too_short)


def test_difficulty_is_the_number_of_tool_calls_needed():
    solve = TraceConfig(guess_share=0.0)
    for steps in range(1, 17):
        for task in (ArithmeticTask(steps, steps), ArithmeticTask(steps, steps, 0.5, BOOK)):
            problem = task.problem(0, steps)
            assert problem.steps == steps
            trace = make_trace(task, solve, 0, steps)
            calls = replay(trace, task.tools(), solve.max_result_bytes)
            lookups = sum(map(bool, problem.names))
            assert len(calls) == problem.calls_needed == steps + lookups
            assert sum(tag == "c" for tag, _, _ in calls) == steps
            if steps > 1:  # the whole question in one call is refused: one step per call
                refused = step_calculator(problem.expression(named=False))
                assert refused.text == "ERR one operation per call, like 37*12"
    assert step_calculator(" 1349 - 88") == ToolResult("1261")


def test_trace_mix_guesses_and_recovers_from_busy_tools():
    traces = [make_trace(NAMED, MIXED, 7, i) for i in range(300)]
    guessed = [t for t in traces if t.guessed]
    assert abs(len(guessed) / len(traces) - MIXED.guess_share) < 0.08
    assert sum(grade(t.problem, t.tokens).correct for t in guessed) < 0.2 * len(guessed)
    assert all(len(str(grade(t.problem, t.tokens).answer)) == len(str(t.problem.answer))
               for t in guessed)
    busy = 0
    for t in traces:
        if not t.guessed:
            verdict = grade(t.problem, t.tokens)
            assert verdict.correct and verdict.invalid_calls == 0
            assert verdict.busy == verdict.retried == t.busy
            assert verdict.calls == t.problem.calls_needed + t.busy
            busy += t.busy
    assert busy > 0


RIGHT = b"<c>37*12</c><r>444</r><c>444+905</c><r>1349</r><c>1349-88</c><r>1261</r>A:1261\n"


def test_the_curriculum_raises_max_steps_stage_by_stage():
    """Problem i is the task's problem (seed, i) under the max_steps of stage i // stage_problems
    (the last stage's from then on): pure in the index, each stage reaching its max_steps; its
    prompt and reward are that problem's."""
    curriculum = Curriculum(CHAINS, max_steps=(1, 3, 8), stage_problems=20, seed=4)
    reached = {}
    for index in reversed(range(80)):
        stage_max = (1, 3, 8, 8)[index // 20]
        problem = curriculum.problem(index)
        assert problem == dataclasses.replace(CHAINS, max_steps=stage_max).problem(4, index)
        assert problem.steps <= stage_max
        reached[stage_max] = max(reached.get(stage_max, 0), problem.steps)
        np.testing.assert_array_equal(curriculum.prompt(index), problem.prompt_tokens())
    assert reached == {1: 1, 3: 3, 8: 8}
    solved = make_trace(dataclasses.replace(CHAINS, max_steps=3), TraceConfig(guess_share=0.0),
                        4, 25)
    completion = solved.tokens[len(solved.problem.prompt_tokens()):]
    assert curriculum.reward(25, completion) == 1.0
    assert curriculum.reward(26, completion) == 0.0
    for bad in ({"max_steps": (2, 1)}, {"max_steps": ()}, {"stage_problems": 0},
                {"seed": EVAL_TASK_SEED}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Curriculum(CHAINS, **bad)


@pytest.mark.parametrize("completion, answer", [
    (RIGHT, 1261),
    (b"A:1261\n", 1261),                              # right without the tool
    (b"so A:99 no, A:1261\n", 1261),                  # the last "A:" counts
    (b"A:1262\n", 1262),
    (b"A:1261", None),                                # cut before the end byte
    (b"A:1261\nA:5", None),
    (b"A:01261\n", None), (b"A:+1261\n", None), (b"A: 1261\n", None), (b"A:1261 \n", None),
    (b"A:1261\n<c>1+1</c><r>2</r>", None),            # an answer before a call is not final
    (b"<c>1+1</c><r>A:1261\n</r>", None),             # nor one inside a result
    (b"A:1261\n<c>1+1</c>", None),                    # a call left unanswered
    (b"", None), (b"A:\n", None), (b"A:-\n", None),
    (b"A:" + b"9" * 41 + b"\n", None),
])
def test_the_verifier_reads_only_a_final_canonical_answer(completion, answer):
    verdict = grade(PROBLEM, completion)
    assert verdict.answer == answer
    assert verdict.correct == (answer == 1261)
    assert reward(PROBLEM, completion) == float(answer == 1261)
    ids = np.frombuffer(completion, np.uint8).astype(np.int32)
    assert grade(PROBLEM, ids) == verdict  # token ids read as their bytes
    assert grade(PROBLEM, np.concatenate([PROBLEM.prompt_tokens(), ids])) == verdict


def test_the_verifier_counts_calls_and_never_raises_on_garbage():
    completion = (b"<c>37*12</c><r>ERR busy</r><c>37*12</c><r>444</r><c>(444+905)</c>"
                  b"<r>ERR one operation per call, like 37*12</r><c>444+905</c><r>ERR busy</r>"
                  b"<c>905+444</c><r>1349</r>A:1349\n")
    verdict = grade(PROBLEM, completion)
    assert (verdict.calls, verdict.invalid_calls, verdict.busy, verdict.retried) == (5, 1, 2, 1)
    assert reward(PROBLEM, completion, invalid_call_penalty=0.1) == pytest.approx(-0.1)
    # A result is `<r>...</r>` right after its call: text in between leaves the call unanswered.
    assert grade(PROBLEM, b"<c>37*12</c>x<r>444</r>A:1261\n") == grade(PROBLEM, b"A:1261\n")
    assert reward(PROBLEM, b"A:12", no_answer_penalty=0.5) == -0.5
    assert reward(PROBLEM, b"A:1261\n", invalid_call_penalty=0.1, no_answer_penalty=0.5) == 1.0
    rng = np.random.default_rng(0)
    pieces = [b"<c>", b"</c>", b"<r>", b"</r>", b"<n>", b"</n>", b"A:", b"\n", b"1261", b"\xff"]
    for _ in range(300):
        ids = rng.integers(-5, 300, rng.integers(0, 64))
        grade(PROBLEM, ids)
        grade(PROBLEM, b"".join(pieces[k] for k in rng.integers(0, len(pieces), 12)))
    special = np.concatenate([[BOS_ID], np.frombuffer(b"A:1261", np.uint8), [STOP_TOKEN]])
    assert grade(PROBLEM, special).correct
    assert grade(PROBLEM, np.array([*b"A:12", BOS_ID, *b"61\n"])).answer is None
