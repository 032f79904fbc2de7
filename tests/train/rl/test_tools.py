"""train.rl.tools: the call syntax through the byte tokenizer, the parser (first complete call,
malformed calls), results that never raise and never read as calls, the calculator's arithmetic
and its bounds, the notes search, and seeded tool failures."""

import numpy as np
import pytest

from train.corpus import build_corpus
from train.rl.tools import (MAX_ARGUMENT_BYTES, FlakyTool, NotesTool, ToolCall, ToolResult,
                            calculate, find_call, run_call)
from train.tokenizer import decode, encode


@pytest.mark.parametrize("generated, tag, argument", [
    (b"Q:1+2=<c>1+2</c>", "c", b"1+2"),
    (b"<py>print(1 < 2)</py> and on", "py", b"print(1 < 2)"),
    (b"<c>1+<c>2*3</c>", "c", b"2*3"),  # an unclosed tag before the call is text
    (b"<n>kda gate</n><c>1</c>", "n", b"kda gate"),  # the call that closes first
    (b"<py>x = '<c>'</py>", "py", b"x = '<c>'"),
])
def test_find_call_returns_the_first_complete_call(generated, tag, argument):
    call = find_call(generated)
    assert (call.tag, call.argument, call.error) == (tag, argument, None)
    assert generated[call.start:call.end] == b"<%s>%s</%s>" % (tag.encode(), argument,
                                                                tag.encode())


@pytest.mark.parametrize("generated", [b"", b"A:1261", b"<c>37*", b"<x>1</x>", b"<c>1</py"])
def test_find_call_waits_while_no_call_is_complete(generated):
    assert find_call(generated) is None


@pytest.mark.parametrize("generated, reason", [
    (b"37*12</c>", "</c> without an opening <c>"),
    (b"<c></c>", "empty <c> call"),
    (b"<py> \n</py>", "empty <py> call"),
    (b"<c>\xff\xfe</c>", "<c> argument is not UTF-8"),
    (b"<py>" + b"x" * (MAX_ARGUMENT_BYTES + 1) + b"</py>",
     f"<py> argument over {MAX_ARGUMENT_BYTES} bytes"),
])
def test_malformed_calls_get_an_error_result(generated, reason):
    call = find_call(generated)
    assert call.error == reason
    result = run_call(call, {"c": calculate, "py": calculate})
    assert (result.text, result.error) == ("ERR " + reason, "malformed")


def test_run_call_never_raises():
    def broken(argument):
        raise RuntimeError("tool bug")

    call = find_call(b"<n>query</n>")
    assert run_call(call, {"n": broken}) == ToolResult("ERR tool failed: RuntimeError: tool bug",
                                                       "crash")
    assert run_call(call, {"c": calculate}) == ToolResult("ERR no <n> tool here", "unavailable")
    good = run_call(find_call(b"<c>37*12</c>"), {"c": calculate})
    assert good == ToolResult("444") and good.ok and not calculate("1//0").ok


def test_a_trajectory_round_trips_through_the_byte_tokenizer():
    """The syntax is ASCII: one token per byte, and the tokens decode to the same text, whose
    first call the parser finds in the tokens' bytes."""
    text = "Q:((37*12)+905)-88=<c>37*12</c>" + ToolResult("444").encode().decode() + "A:1261"
    tokens = encode(text, bos=False)
    assert decode(tokens) == text and len(tokens) == len(text)
    assert find_call(bytes(tokens.astype(np.uint8))).argument == b"37*12"


def test_results_are_cut_and_never_read_as_calls():
    result = ToolResult("x <c>1</c> <r>y</r> é")
    encoded = result.encode()
    assert encoded == "<r>x <\\c>1<\\/c> <\\r>y<\\/r> é</r>".encode()
    assert find_call(b"<c>2</c>" + encoded) == ToolCall("c", b"2", 0, 8)
    assert find_call(encoded) is None
    assert ToolResult("abcé").encode(max_bytes=4) == b"<r>abc</r>"  # the cut character dropped


@pytest.mark.parametrize("expression, value", [
    ("37*12", 37 * 12),
    ("((37*12)+905)-88", ((37 * 12) + 905) - 88),
    (" -5 // 2 ", -5 // 2),
    ("-7 % 3", -7 % 3),
    ("2**64", 2**64),
    ("-(3-10)*2**3", -(3 - 10) * 2**3),
    ("0**0", 0**0),
    ("(-1)**63", (-1)**63),
])
def test_the_calculator_computes_integer_arithmetic(expression, value):
    assert calculate(expression) == ToolResult(str(value))


@pytest.mark.parametrize("expression, message", [
    ("1//0", "division by zero"),
    ("5%(3-3)", "division by zero"),
    ("1/2", "only integers, + - * // % ** and parentheses"),
    ("+1", "only integers, + - * // % ** and parentheses"),
    ("__import__('os')", "only integers, + - * // % ** and parentheses"),
    ("1.5*2", "only integers, + - * // % ** and parentheses"),
    ("0x10", "only integers, + - * // % ** and parentheses"),  # Python ints, not decimal
    ("1_000", "only integers, + - * // % ** and parentheses"),
    ("1<<5", "only integers, + - * // % ** and parentheses"),
    ("", "only integers, + - * // % ** and parentheses"),
    ("(1+2", "syntax error"),
    ("2**-1", "exponent outside [0, 64]"),
    ("2**65", "exponent outside [0, 64]"),
    ("9**9**9", "exponent outside [0, 64]"),  # 9**387420489 is never computed
    ("(9**40)**64", "number over 40 digits"),  # 9**40 is refused first
    ("10**40", "number over 40 digits"),  # 41 digits
    ("9" * 41, "number over 40 digits"),
    ("99999999999999999999*99999999999999999999*9", "number over 40 digits"),
    ("1+" * 100 + "1", "expression longer than 200 characters"),
])
def test_the_calculator_answers_bad_expressions_with_a_message(expression, message):
    assert calculate(expression) == ToolResult("ERR " + message, "calculator")


@pytest.fixture(scope="module")
def notes():
    corpus = build_corpus("notes", [
        ("a.txt", b"The KDA gate decays each channel. " + b"filler text. " * 8),
        ("b.txt", b"Quantile Balancing sets router biases; the kda" + b" gate"),
        ("c.txt", b"gate gate gate gate"),
    ])
    return NotesTool(corpus, passage_bytes=32)


def test_notes_returns_the_passage_with_the_most_query_words(notes):
    result = notes("KDA gate?")
    assert result.text == "The KDA gate decays each channel"
    assert result.metadata == dict(document="a.txt", offset=0)
    assert notes("quantile").text == "Quantile Balancing sets router b"
    assert notes("gate").metadata["document"] == "c.txt"  # most occurrences
    # A word cut at a passage boundary counts where it starts; words match as substrings.
    assert notes("biases").metadata == dict(document="b.txt", offset=0)
    assert notes("iases kda").metadata == dict(document="b.txt", offset=32)


@pytest.mark.parametrize("query, message", [("zebra", "no passage matches"),
                                            ("? a !", "query has no word of 2 or more letters")])
def test_notes_without_a_match_is_an_error_result(notes, query, message):
    assert notes(query) == ToolResult("ERR " + message, "notes")


def test_flaky_tool_fails_at_its_rate_reproducibly_and_resumes():
    calls = []

    def echo(argument):
        calls.append(argument)
        return ToolResult(argument)

    flaky = FlakyTool(echo, 0.2, seed=7)
    busy = [flaky(str(i)).text == "ERR busy" for i in range(2000)]
    assert abs(sum(busy) - 400) < 4 * np.sqrt(2000 * 0.2 * 0.8)  # binomial, 4 sigma
    assert len(calls) == 2000 - sum(busy)  # a failed call never reaches the tool
    again = FlakyTool(echo, 0.2, seed=7)
    assert [again(str(i)).error == "busy" for i in range(100)] == busy[:100]
    resumed = FlakyTool(echo, 0.2, seed=7, calls=1000)
    assert [resumed("x").error == "busy" for _ in range(100)] == busy[1000:1100]
    other = FlakyTool(echo, 0.2, seed=8)
    assert [other("x").error == "busy" for _ in range(100)] != busy[:100]
    assert not any(FlakyTool(echo, 0.0, 1)("x").error for _ in range(50))
    assert all(FlakyTool(echo, 1.0, 1)("x").error == "busy" for _ in range(50))
    with pytest.raises(ValueError, match="probability must be in"):
        FlakyTool(echo, 1.5, 1)
