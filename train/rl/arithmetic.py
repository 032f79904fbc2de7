"""The verifiable task of agentic RL: multi-step arithmetic chains solved with the calculator tool,
their verifier, and supervised warm-start traces in the exact byte format of the rollouts.

A problem is a chain of `steps` dependent operations (+ - *) on integers up to 999, written as
one nested expression; each step is one calculator call whose result the next step needs, so a
problem of k steps takes exactly k calls (the task's calculator, `step_calculator`, does one
operation per call). A trajectory, in `train.rl.tools`' syntax, with its loss mask:

    <bos>Q:((37*12)+905)-88=<c>37*12</c><r>444</r><c>444+905</c><r>1349</r>
    0    000000000000000000011111111111100000000001111111111111100000000000
    <c>1349-88</c><r>1261</r>A:1261\\n
    11111111111111000000000001111111

One mask digit per byte (<bos> is one token, "\\n" one byte). The prompt (BOS, "Q:", the
expression, "="): mask 0; the model's turns (each a call, and the final `A:<answer>` with the
end byte "\\n", STOP_TOKEN, the rollouts' stop token): mask 1; the tools' results `<r>...</r>`,
forced by the environment: mask 0. These are `Trajectory.sampled` of `train.rl.rollout` for the
same bytes, and `target_mask` of `train.packing` (loss_mask[t] = target_mask[t + 1]). The
verifier reads the integer between the last "A:" after the last tool result and the end byte;
reward 1 when it is the answer exactly (canonical decimal), else 0.

Splits: problem (seed, index) is a pure function of both (numpy's generator seeded with them):
random access, resumable, the same on every machine. Training seeds lie in [0, 2**32), held-out
seeds from `train.data.EVAL_TASK_SEED` = 2**32 up; and the two splits draw from disjoint parts
of the problem space too: a hash of the first step ("37*12") puts 1 in HELDOUT_BUCKETS first
steps in the held-out part, and a first step of the other split is drawn again, so no held-out
problem shares even its first step with a training problem, whatever the seeds.

Notes variant (`named_share` > 0): constants of the expression are given by name,
`Q:((KQXVB*12)+905)-88=`; a `NotesBook` of seeded `NAME=value` lines, one 512-byte document per
passage, is the corpus of the notes tool (`train.rl.tools.NotesTool`), and each named constant
costs one lookup, `<n>KQXVB</n>`, answered with its whole passage: long trajectories (16 steps
with every constant named: about 9.6K bytes with 512-byte passages, 36K with 2048-byte ones).

Warm-start traces (`make_trace`, `trace_batches`): the solution as the model should write it,
with a share of "guess" traces (the answer without any call, mostly wrong) and optionally
injected "ERR busy" results followed by the same call again, so that RL has both to improve on.
"""

import dataclasses
import functools
import operator
import re
import string
import sys
import zlib
from collections.abc import Sequence

import grain
import numpy as np

from train.corpus import Corpus, build_corpus
from train.data import EVAL_TASK_SEED
from train.packing import finalize_batch, pack_rows
from train.rl.tools import (RESULT_TAG, FlakyTool, NotesTool, Tool, ToolCall, ToolResult,
                            calculate, find_call)
from train.tokenizer import BOS_ID, NUM_BYTES

QUESTION_PREFIX = "Q:"
ANSWER_PREFIX = "A:"
STOP = "\n"
STOP_TOKEN = ord(STOP)  # ends the model's answer: the rollouts' stop token
HELDOUT_BUCKETS = 16
MAX_CONSTANT = 999  # every constant of a problem lies in [1, MAX_CONSTANT]
_MAX_MULTIPLICAND = 99_999  # "*" only on values up to this: answers stay below 10**7
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_BUSY = ToolResult.failure("busy", "busy")  # what `FlakyTool` answers
_RESULT_OPEN, _RESULT_CLOSE = f"<{RESULT_TAG}>".encode(), f"</{RESULT_TAG}>".encode()
_ANSWER = re.compile(rb"A:(-?(?:0|[1-9][0-9]{0,39}))\n\Z")
_ONE_OPERATION = re.compile(r"\s*-?\d+\s*(?:\*\*|//|[-+*%])\s*-?\d+\s*")
# The streams of problems and of the traces' own draws (guesses, failures) stay apart.
_PROBLEM_STREAM, _TRACE_STREAM = zlib.crc32(b"arithmetic"), zlib.crc32(b"arithmetic-trace")


def step_calculator(expression: str) -> ToolResult:
    """The task's calculator: `train.rl.tools.calculate` on one operation between two integers
    ("37*12", "1349-88"); anything longer is "ERR one operation per call", so a chain of k steps
    needs k calls (the whole expression in one call would make every problem one call long)."""
    if not _ONE_OPERATION.fullmatch(expression):
        return ToolResult.failure("calculator", "one operation per call, like 37*12")
    return calculate(expression)


# ---------------------------------------------------------------------------------- notes book


@functools.lru_cache(maxsize=8)
def _book_table(seed: int, names_per_value: int, passage_bytes: int
                ) -> tuple[np.ndarray, dict[str, int], tuple[str, ...]]:
    """`NotesBook`'s content: (names [MAX_CONSTANT, names_per_value], the name of value v in
    row v - 1; name -> index of its document; the documents' texts)."""
    rng = np.random.default_rng([seed, zlib.crc32(b"notes-book")])
    count = MAX_CONSTANT * names_per_value
    codes = rng.choice(26**5, count, replace=False)
    letters = np.array(list(string.ascii_uppercase))
    names = ["".join(letters[(code // 26 ** np.arange(4, -1, -1)) % 26]) for code in codes]
    values = np.repeat(np.arange(1, MAX_CONSTANT + 1), names_per_value)
    documents, document, where = [], "", {}
    for i in rng.permutation(count):
        line = f"{names[i]}={values[i]}\n"
        if len(document) + len(line) > passage_bytes:
            documents.append(document)
            document = ""
        document += line
        where[names[i]] = len(documents)
    documents.append(document)
    return np.array(names).reshape(MAX_CONSTANT, names_per_value), where, tuple(documents)


@dataclasses.dataclass(frozen=True)
class NotesBook:
    """Seeded constants to look up: names_per_value distinct five-letter names for each value
    in [1, MAX_CONSTANT], as lines `NAME=value`, shuffled and cut into documents of at most
    passage_bytes bytes, so that each document is one passage of the notes tool and a name's
    passage always holds its line (no line is cut)."""

    seed: int = 0
    names_per_value: int = 4
    passage_bytes: int = 512

    def __post_init__(self):
        if self.names_per_value < 1:
            raise ValueError(f"NotesBook.names_per_value must be at least 1, got "
                             f"{self.names_per_value}")
        if self.passage_bytes < len(f"AAAAA={MAX_CONSTANT}\n"):
            raise ValueError(f"NotesBook.passage_bytes must hold one line "
                             f"({len(f'AAAAA={MAX_CONSTANT}')} bytes), got {self.passage_bytes}")

    @property
    def _table(self) -> tuple[np.ndarray, dict[str, int], tuple[str, ...]]:
        return _book_table(self.seed, self.names_per_value, self.passage_bytes)

    def name_for(self, value: int, rng: np.random.Generator) -> str:
        """One of the names of `value` (in [1, MAX_CONSTANT]), drawn with `rng`."""
        return str(self._table[0][value - 1, rng.integers(self.names_per_value)])

    def passage(self, name: str) -> str:
        """The text of the document holding `name`'s line: the notes tool's answer to `name`."""
        _, where, documents = self._table
        return documents[where[name]]

    def corpus(self) -> Corpus:
        """The book as a corpus, documents "notes/00000", ... in book order."""
        documents = self._table[2]
        return build_corpus(f"notes-{self.seed}", [
            (f"notes/{i:05d}", text.encode()) for i, text in enumerate(documents)])

    def tool(self) -> NotesTool:
        """The notes tool over the book: the query "KQXVB" returns `passage("KQXVB")`."""
        return NotesTool(self.corpus(), passage_bytes=self.passage_bytes)


# ------------------------------------------------------------------------------------ problems


@dataclasses.dataclass(frozen=True)
class Problem:
    """One chain: first, then each (op, operand) of operations applied in turn.

    names: per constant (first, then each operand) its name in the question, "" where the number
        is written out (see `NotesBook`).
    """

    first: int
    operations: tuple[tuple[str, int], ...]
    names: tuple[str, ...]

    @property
    def steps(self) -> int:
        return len(self.operations)

    @property
    def constants(self) -> tuple[int, ...]:
        return (self.first, *(operand for _, operand in self.operations))

    @property
    def values(self) -> tuple[int, ...]:
        """The value after each step: [steps]; the last is the answer."""
        values, value = [], self.first
        for op, operand in self.operations:
            value = _APPLY[op](value, operand)
            values.append(value)
        return tuple(values)

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def calls_needed(self) -> int:
        """Tool calls of a solution: one per step, one lookup per named constant."""
        return self.steps + sum(map(bool, self.names))

    def expression(self, named: bool = True) -> str:
        """"((37*12)+905)-88": the chain nested left to right; with `named`, names stand for the
        named constants (the question), else every constant is a number."""
        shown = [name if named and name else str(value)
                 for name, value in zip(self.names, self.constants)]
        text = shown[0]
        for step, (op, _) in enumerate(self.operations):
            text = f"{text}{op}{shown[step + 1]}" if step == 0 else f"({text}){op}{shown[step + 1]}"
        return text

    @property
    def prompt(self) -> bytes:
        """b"Q:((37*12)+905)-88=" (without BOS)."""
        return f"{QUESTION_PREFIX}{self.expression()}=".encode()

    def prompt_tokens(self) -> np.ndarray:
        """int32 [n]: BOS_ID, then the prompt's bytes: a rollout's prompt."""
        return np.concatenate([[BOS_ID], np.frombuffer(self.prompt, np.uint8)]).astype(np.int32)


def split_of(seed: int) -> str:
    """"train" for seeds in [0, 2**32), "heldout" for seeds from EVAL_TASK_SEED (2**32) up."""
    if not (isinstance(seed, (int, np.integer)) and 0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}; training seeds "
                         f"lie below {EVAL_TASK_SEED}, held-out seeds from it up")
    return "train" if seed < EVAL_TASK_SEED else "heldout"


def _is_heldout_step(first: int, op: str, operand: int) -> bool:
    return zlib.crc32(f"{first}{op}{operand}".encode()) % HELDOUT_BUCKETS == 0


def is_heldout_problem(problem: Problem) -> bool:
    """Whether the problem lies in the held-out part of the problem space: a hash of its first
    step ("37*12"), so a held-out problem shares not even its first step with a training one
    (names do not count: the same arithmetic under other names is the same problem)."""
    return _is_heldout_step(problem.first, *problem.operations[0])


def _draw_operation(value: int, rng: np.random.Generator) -> tuple[str, int]:
    """A step on `value` (>= 1): "+" any constant, "-" one below value, "*" 2..99 on values up
    to _MAX_MULTIPLICAND, so every value stays positive and below 10**7."""
    allowed = "+" + "-" * (value >= 2) + "*" * (value <= _MAX_MULTIPLICAND)
    op = allowed[rng.integers(len(allowed))]
    low, high = {"+": (1, MAX_CONSTANT), "-": (1, min(MAX_CONSTANT, value - 1)),
                 "*": (2, 99)}[op]
    return op, int(rng.integers(low, high + 1))


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Which problems are drawn.

    min_steps, max_steps: the number of steps is drawn uniformly from [min_steps, max_steps]:
        the difficulty knob (a curriculum raises max_steps, 1 -> 16).
    named_share: probability that a constant is given by its name in `book` (0: no lookups).
    book: the constants' names and the notes tool's corpus.
    """

    min_steps: int = 1
    max_steps: int = 16
    named_share: float = 0.0
    book: NotesBook = dataclasses.field(default_factory=NotesBook)

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"ArithmeticTask needs 1 <= min_steps <= max_steps, got "
                             f"min_steps={self.min_steps}, max_steps={self.max_steps}")
        if not 0.0 <= self.named_share <= 1.0:
            raise ValueError(f"ArithmeticTask.named_share must lie in [0, 1], got "
                             f"{self.named_share}")

    def problem(self, seed: int, index: int) -> Problem:
        """Problem `index` of `seed`'s stream, of the seed's split (`split_of`)."""
        heldout = split_of(seed) == "heldout"
        if not (isinstance(index, (int, np.integer)) and index >= 0):
            raise ValueError(f"index must be an integer >= 0, got {index!r}")
        rng = np.random.default_rng([seed, _PROBLEM_STREAM, index])
        steps = int(rng.integers(self.min_steps, self.max_steps + 1))
        while True:  # the first step decides the split (`is_heldout_problem`)
            first = int(rng.integers(2, MAX_CONSTANT + 1))
            operations = [_draw_operation(first, rng)]
            if _is_heldout_step(first, *operations[0]) == heldout:
                break
        value = _APPLY[operations[0][0]](first, operations[0][1])
        for _ in range(steps - 1):
            operations.append(_draw_operation(value, rng))
            value = _APPLY[operations[-1][0]](value, operations[-1][1])
        named = rng.random(steps + 1) < self.named_share
        constants = (first, *(operand for _, operand in operations))
        names = tuple(self.book.name_for(c, rng) if n else "" for c, n in zip(constants, named))
        return Problem(first, tuple(operations), names)

    def tools(self, busy_probability: float = 0.0, seed: int = 0) -> dict[str, Tool]:
        """The environment's tools (tag -> tool) for `train.rl.rollout.ToolEnvironment`:
        `step_calculator` as "c", the book's notes tool as "n" when constants are named; with
        busy_probability > 0 each answers "ERR busy" at that rate (`FlakyTool`, seeds seed and
        seed + 1)."""
        tools = {"c": step_calculator}
        if self.named_share > 0:
            tools["n"] = self.book.tool()
        if busy_probability > 0:
            tools = {tag: FlakyTool(tool, busy_probability, seed + i)
                     for i, (tag, tool) in enumerate(tools.items())}
        return tools


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """The RL training stream: problem i of training seed `seed`, drawn by `task` with max_steps
    raised stage by stage, `stage_problems` problems a stage (the last stage's max_steps from
    then on). A pure function of the index, so a run resumes from the index alone and a prompt's
    difficulty is fixed when it is drawn, whichever iteration finishes it. It is the task of
    `train.rl.loop` (`prompt`, `reward`).

    max_steps: each stage's max_steps, non-decreasing (the full curriculum: 1 -> 16).
    stage_problems: problems of each stage (prompts per iteration times its iterations).
    invalid_call_penalty, no_answer_penalty: `reward`'s format penalties.
    """

    task: ArithmeticTask = dataclasses.field(default_factory=ArithmeticTask)
    max_steps: tuple[int, ...] = (1, 2, 4, 8, 16)
    stage_problems: int = 256
    seed: int = 0
    invalid_call_penalty: float = 0.0
    no_answer_penalty: float = 0.0

    def __post_init__(self):
        if (not self.max_steps or list(self.max_steps) != sorted(self.max_steps)
                or self.max_steps[0] < self.task.min_steps):
            raise ValueError(f"Curriculum.max_steps must be non-decreasing and start at "
                             f"task.min_steps={self.task.min_steps} or above, got "
                             f"{self.max_steps}")
        if self.stage_problems < 1:
            raise ValueError(f"Curriculum.stage_problems must be at least 1, got "
                             f"{self.stage_problems}")
        if split_of(self.seed) != "train":
            raise ValueError(f"Curriculum.seed={self.seed} is a held-out seed; train below "
                             f"{EVAL_TASK_SEED}")

    def steps_at(self, index: int) -> int:
        """max_steps of problem `index`'s stage."""
        return self.max_steps[min(index // self.stage_problems, len(self.max_steps) - 1)]

    def problem(self, index: int) -> Problem:
        task = dataclasses.replace(self.task, max_steps=self.steps_at(index))
        return task.problem(self.seed, index)

    def prompt(self, index: int) -> np.ndarray:
        """int32 [n]: problem `index`'s prompt tokens (BOS first)."""
        return self.problem(index).prompt_tokens()

    def reward(self, index: int, completion) -> float:
        """`reward` of a completion (token ids after the prompt) of problem `index`."""
        return reward(self.problem(index), completion,
                      invalid_call_penalty=self.invalid_call_penalty,
                      no_answer_penalty=self.no_answer_penalty)


# ---------------------------------------------------------------------------------- verifier


def completion_bytes(completion: bytes | Sequence[int] | np.ndarray) -> bytes:
    """Token ids (or bytes) as bytes; an id outside the 256 bytes (BOS, PAD, ...) becomes 0xFF,
    invalid UTF-8, as the rollouts' environment reads it."""
    if isinstance(completion, (bytes, bytearray)):
        return bytes(completion)
    ids = np.asarray(completion, np.int64).reshape(-1)
    return np.where((ids >= 0) & (ids < NUM_BYTES), ids, 0xFF).astype(np.uint8).tobytes()


def read_turns(completion) -> tuple[list[tuple[ToolCall, bytes]], bytes]:
    """The answered calls of a completion and its final text.

    Walks the bytes as the environment produced them: each turn ends at its first complete call
    (`find_call`), which the environment answered with `<r>...</r>` right after it (results hold
    no tag). Returns [(call, result text)] in order, and the bytes after the last result (the
    final turn; it holds an unanswered call when the trajectory ended at one). Never raises on
    what the model wrote.
    """
    data = completion_bytes(completion)
    answered, position = [], 0
    while (call := find_call(data[position:])) is not None:
        start = position + call.end
        close = data.find(_RESULT_CLOSE, start)
        if not data.startswith(_RESULT_OPEN, start) or close < 0:
            break
        answered.append((call, data[start + len(_RESULT_OPEN):close]))
        position = close + len(_RESULT_CLOSE)
    return answered, data[position:]


@dataclasses.dataclass(frozen=True)
class Grade:
    """What the verifier read from a completion.

    answer: the final answer, None when the final turn does not end in `A:<integer>` and the end
        byte (STOP) (truncated, no answer, not canonical: "A:0123", "A:+5", "A: 5").
    correct: answer == the problem's answer.
    calls: answered tool calls; invalid_calls: of them, answered with an error other than the
        injected "ERR busy" (malformed, refused, unknown name, ...); busy: answered "ERR busy";
    retried: busy results followed by the same call again (tag and argument).
    """

    answer: int | None
    correct: bool
    calls: int
    invalid_calls: int
    busy: int
    retried: int


def grade(problem: Problem, completion) -> Grade:
    """The verifier: `completion` is the trajectory's tokens after the prompt, int token ids or
    bytes (the whole trajectory reads the same: a prompt holds no call and no answer). Never
    raises on what the model wrote."""
    answered, final = read_turns(completion)
    match = _ANSWER.search(final)
    answer = None if match is None else int(match.group(1))
    busy_text = _BUSY.text.encode()
    busy = [result == busy_text for _, result in answered]
    invalid = sum(result.startswith(b"ERR ") and not is_busy
                  for (_, result), is_busy in zip(answered, busy))
    retried = sum(busy[i] and (call.tag, call.argument) == (answered[i + 1][0].tag,
                                                            answered[i + 1][0].argument)
                  for i, (call, _) in enumerate(answered[:-1]))
    return Grade(answer, answer == problem.answer, len(answered), int(invalid), sum(busy),
                 int(retried))


def reward(problem: Problem, completion, *, invalid_call_penalty: float = 0.0,
           no_answer_penalty: float = 0.0) -> float:
    """1.0 for the exact answer, else 0.0; minus invalid_call_penalty per invalid call and
    no_answer_penalty when no answer can be read (format penalties, both 0 by default; an
    injected "ERR busy" is never penalised). Never raises on what the model wrote."""
    verdict = grade(problem, completion)
    return (float(verdict.correct) - invalid_call_penalty * verdict.invalid_calls
            - no_answer_penalty * (verdict.answer is None))


# ------------------------------------------------------------------------------ warm-start traces


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """How warm-start traces are written.

    guess_share: share of traces that answer at once, without a call: the answer's leading half
        of digits and random others (right only by chance).
    busy_probability: chance that a call of a solving trace is answered "ERR busy" (as
        `FlakyTool` would), the call then repeated; at most max_busy_in_a_row in a row.
    max_result_bytes: the environment's cut of a result's text (ToolEnvironment's
        max_result_bytes; a passage longer than this is cut in the trace as it would be there).
    """

    guess_share: float = 0.25
    busy_probability: float = 0.0
    max_busy_in_a_row: int = 2
    max_result_bytes: int = 4096

    def __post_init__(self):
        if not 0.0 <= self.guess_share <= 1.0:
            raise ValueError(f"TraceConfig.guess_share must lie in [0, 1], got {self.guess_share}")
        if not 0.0 <= self.busy_probability < 1.0:
            raise ValueError(f"TraceConfig.busy_probability must lie in [0, 1), got "
                             f"{self.busy_probability}")
        if self.max_busy_in_a_row < 0 or self.max_result_bytes < 1:
            raise ValueError(f"TraceConfig needs max_busy_in_a_row >= 0 and max_result_bytes "
                             f">= 1, got {self.max_busy_in_a_row} and {self.max_result_bytes}")


@dataclasses.dataclass(frozen=True)
class Trace:
    """A complete trajectory: segments of bytes in order, each (bytes, written by the model);
    the first is the prompt. guessed: answered without a call; busy: "ERR busy" results in it."""

    problem: Problem
    segments: tuple[tuple[bytes, bool], ...]
    guessed: bool
    busy: int

    @property
    def tokens(self) -> np.ndarray:
        """int32 [L]: BOS_ID, then every segment's bytes."""
        data = b"".join(data for data, _ in self.segments)
        return np.concatenate([[BOS_ID], np.frombuffer(data, np.uint8)]).astype(np.int32)

    @property
    def target_mask(self) -> np.ndarray:
        """float32 [L]: 1 on the model's bytes, 0 on BOS, the prompt and the tools' results."""
        return np.concatenate([[0.0], *(np.full(len(data), float(model))
                                        for data, model in self.segments)]).astype(np.float32)

    def example(self) -> dict[str, np.ndarray]:
        """The trace as a `train.packing` example: tokens int32 [L], target_mask float32 [L]."""
        return {"tokens": self.tokens, "target_mask": self.target_mask}


def _solution(task: ArithmeticTask, problem: Problem) -> list[tuple[str, str, ToolResult]]:
    """The calls that solve `problem`, in order, each (tag, argument, the tool's result): the
    lookup of each named constant right before the step that needs it, then the step."""
    calls = []
    lefts = (problem.first, *problem.values[:-1])
    for step, ((op, operand), left, value) in enumerate(zip(problem.operations, lefts,
                                                            problem.values)):
        for name in (problem.names[:2] if step == 0 else problem.names[step + 1:step + 2]):
            if name:
                calls.append(("n", name, ToolResult(task.book.passage(name))))
        calls.append(("c", f"{left}{op}{operand}", ToolResult(str(value))))
    return calls


def _guess(answer: int, rng: np.random.Generator) -> int:
    """The answer's leading half of digits, the rest random."""
    digits = str(answer)
    kept = len(digits) // 2
    return int(digits[:kept] + "".join(rng.choice(list(string.digits), len(digits) - kept)))


def make_trace(task: ArithmeticTask, config: TraceConfig, seed: int, index: int) -> Trace:
    """The warm-start trace of problem (seed, index); its guess and failures are drawn from
    (seed, index) too."""
    problem = task.problem(seed, index)
    rng = np.random.default_rng([seed, _TRACE_STREAM, index])
    segments = [(problem.prompt, False)]
    guessed = bool(rng.random() < config.guess_share)
    busy = 0
    if guessed:
        answer = _guess(problem.answer, rng)
    else:
        answer = problem.answer
        for tag, argument, result in _solution(task, problem):
            call = f"<{tag}>{argument}</{tag}>".encode()
            failures = 0
            while failures < config.max_busy_in_a_row and rng.random() < config.busy_probability:
                segments += [(call, True), (_BUSY.encode(config.max_result_bytes), False)]
                failures += 1
            segments += [(call, True), (result.encode(config.max_result_bytes), False)]
            busy += failures
    segments.append((f"{ANSWER_PREFIX}{answer}{STOP}".encode(), True))
    return Trace(problem, tuple(segments), guessed, busy)


def _fitted_example(task: ArithmeticTask, config: TraceConfig, seed: int, seq_len: int,
                    index: int) -> dict[str, np.ndarray]:
    example = make_trace(task, config, seed, index).example()
    if example["tokens"].size > seq_len:
        raise ValueError(f"trace {index} of seed {seed} holds {example['tokens'].size} tokens, "
                         f"over seq_len={seq_len}; raise seq_len, or lower max_steps, "
                         "named_share or the book's passage_bytes")
    return example


def trace_dataset(task: ArithmeticTask, config: TraceConfig, *, seed: int, seq_len: int,
                  num_examples: int = sys.maxsize) -> grain.MapDataset:
    """Warm-start traces as `train.packing` examples ({tokens, target_mask}, at most seq_len
    tokens each, else a ValueError when read); example i is make_trace(task, config, seed, i):
    random access and resumable, like `train.synthetic.task_dataset`. Training seeds only."""
    if split_of(seed) != "train":
        raise ValueError(f"seed={seed} is a held-out seed; warm-start traces come from training "
                         f"seeds, below {EVAL_TASK_SEED}")
    return grain.MapDataset.range(num_examples).map(
        functools.partial(_fitted_example, task, config, seed, seq_len))


def trace_batches(task: ArithmeticTask, config: TraceConfig, *, seq_len: int, batch_size: int,
                  seed: int, packing_bins: int = 32) -> grain.IterDataset:
    """The endless supervised warm-start stream: traces packed into rows of seq_len tokens and
    batched as the trainer reads them (`train.packing.finalize_batch`: tokens, targets,
    loss_mask, segment_ids, positions, each [batch_size, seq_len]), so `Trainer.step` runs on
    it as on `train.data`'s batches; checkpoint its iterator with grain as theirs."""
    examples = trace_dataset(task, config, seed=seed, seq_len=seq_len)
    rows = pack_rows(examples.to_iter_dataset(grain.ReadOptions(
        num_threads=2, prefetch_buffer_size=2 * batch_size)),
        seq_len=seq_len, num_bins=packing_bins, seed=seed)
    return rows.batch(batch_size, drop_remainder=True).map(finalize_batch)
