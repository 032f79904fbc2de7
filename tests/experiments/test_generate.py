"""`python -m experiments.generate` on a checkpoint: --prompt streams the tokens as they come,
--interactive reads prompts from stdin, --requests writes one JSONL result a request (greedy ==
argmax of the full forward); bad input is one `error:` line naming the argument, exit status 2."""

import dataclasses
import io
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import generate
from models.config import preset
from models.lm import HybridLM
from train.checkpoint import Checkpointer
from train.cli import config_dict
from train.inference import load_model
from train.loop import CHECKPOINT_DIR
from train.tokenizer import decode, encode

# A small engine, float32 parameters (exact comparisons). Every prompt of the tests is BOS and two
# bytes: one prefill chunk of 2 tokens, then decode steps (two compiled programs).
GREEDY_TOKENS = 8
ENGINE = ["--slots", "2", "--max-seq-len", "32", "--page-size", "4", "--prefill-chunk", "8",
          "--dtype", "float32"]


class _DataIterator:
    """What the checkpointer saves of a data pipeline: its position."""

    def get_state(self) -> dict:
        return {"position": 0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A run folder with checkpoint 1 of an untrained two-layer model (KDA, then Gated MLA with
    MoE), written by the trainer's Checkpointer with the config beside it, as training writes
    it (tests/train/test_inference.py loads checkpoints of real training runs)."""
    config = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,))
    config = dataclasses.replace(config, kda=dataclasses.replace(config.kda, impl="reference"))
    model_state = jax.jit(lambda: nnx.state(HybridLM(config, rngs=nnx.Rngs(0))))()
    folder = str(tmp_path_factory.mktemp("generate") / "run")
    checkpointer = Checkpointer(os.path.join(folder, CHECKPOINT_DIR))
    checkpointer.save(1, nnx.State({"model": model_state}), _DataIterator(),
                      metadata={"config": {"model": config_dict(config)}})
    checkpointer.wait()
    checkpointer.close()
    return folder


def run(argv, capsys, stdin: str = "") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the CLI."""
    old_stdin, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        generate.main(argv)
        status = 0
    except SystemExit as exit_:
        status = exit_.code
    finally:
        sys.stdin = old_stdin
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture(scope="module")
def results(run_dir, tmp_path_factory) -> list[dict]:
    """--requests of three requests: greedy text, sampled with a stop byte, token ids."""
    folder = tmp_path_factory.mktemp("requests")
    # The first request runs longest: the others finish before it, their results come after it.
    lines = [{"id": "greedy", "prompt": "ab", "temperature": 0, "max_tokens": GREEDY_TOKENS},
             {"prompt": "hi", "seed": 3, "stop": ["e", "a"]},
             {"id": 7, "prompt_tokens": [257, 104, 105], "temperature": 1.0, "top_k": 5}]
    (folder / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    generate.main(["--checkpoint", run_dir, "--requests", str(folder / "in.jsonl"), "--out",
                   str(folder / "out.jsonl"), "--max-tokens", "5", *ENGINE])
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def test_requests_give_one_result_a_request_in_order(run_dir, results):
    assert [r["id"] for r in results] == ["greedy", 2, 7]
    greedy, sampled, tokens = results
    for result in results:
        assert result["text"] == decode(result["tokens"])
        assert len(result["logprobs"]) == len(result["tokens"])
        assert all(p <= 0 for p in result["logprobs"])
    assert len(greedy["tokens"]) == GREEDY_TOKENS and greedy["finish_reason"] == "length"
    assert tokens["prompt"] is None and len(tokens["tokens"]) == 5  # the flag's max_tokens
    stops = {ord("e"), ord("a")}
    ended = sampled["tokens"][-1] in stops
    assert sampled["finish_reason"] == ("stop" if ended else "length")
    assert not stops & set(sampled["tokens"][:-1])
    # Greedy is the argmax of the checkpoint's model over the whole sequence.
    model, _ = load_model(run_dir, dtype=None)
    sequence = np.concatenate([encode("ab"), greedy["tokens"]])
    logits = jax.jit(lambda model, tokens: model(tokens))(model, jnp.asarray(sequence)[None])
    argmax = np.asarray(jnp.argmax(logits[0], axis=-1))
    np.testing.assert_array_equal(greedy["tokens"], argmax[len(encode("ab")) - 1 : -1])


class _Writes(io.StringIO):
    """stdout that remembers each write."""

    def __init__(self):
        super().__init__()
        self.pieces = []

    def write(self, text):
        self.pieces.append(text)
        return super().write(text)


def test_prompt_streams_tokens_as_they_come(run_dir, results, monkeypatch):
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    generate.main(["--checkpoint", run_dir, "--prompt", "ab", "--temperature", "0",
                   "--max-tokens", str(GREEDY_TOKENS), *ENGINE])
    assert out.getvalue() == "ab" + results[0]["text"] + "\n"
    assert len([piece for piece in out.pieces if piece]) >= 1 + GREEDY_TOKENS  # prompt, tokens


def test_interactive_reads_prompts_from_stdin(run_dir, results, capsys):
    status, out, _ = run(["--checkpoint", run_dir, "--interactive", "--temperature", "0",
                          "--max-tokens", str(GREEDY_TOKENS), *ENGINE], capsys,
                         stdin="ab\nab\n")
    assert status == 0
    assert out.splitlines() == ["ab" + results[0]["text"]] * 2


@pytest.mark.parametrize("flags, named", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "0"], "--top-k"),
    (["--stop", "ab"], "--stop"),
    (["--seed", "-2"], "--seed"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--prefill-chunk", "12"], "--prefill-chunk"),
])
def test_bad_flags_are_one_error_line(run_dir, capsys, flags, named):
    status, _, err = run(["--checkpoint", run_dir, "--prompt", "ab", *ENGINE, *flags], capsys)
    assert status == 2
    assert err.startswith(f"error: {named}") and len(err.strip().splitlines()) == 1


def test_a_missing_checkpoint_or_a_long_prompt_is_one_error_line(run_dir, tmp_path, capsys):
    status, _, err = run(["--checkpoint", str(tmp_path), "--prompt", "ab"], capsys)
    assert status == 2 and err.startswith(f"error: --checkpoint {tmp_path}: ")
    status, _, err = run(["--checkpoint", run_dir, "--prompt", "x" * 40, *ENGINE], capsys)
    assert status == 2 and err.startswith("error: --prompt: ") and "max_seq_len of 32" in err


def test_bad_request_lines_are_one_error_line(run_dir, tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    for lines, expected in [
        (['{"prompt": "a"}', "not json"], "line 2: not JSON"),
        (['{"prompt": "a", "temperature": -1}'], "line 1: temperature"),
        (['{"prompt": "a", "colour": 1}'], "line 1: unknown field(s) ['colour']"),
        (['{"prompt_tokens": [1, 999]}'], "line 1: prompt"),
    ]:
        path.write_text("\n".join(lines) + "\n")
        status, _, err = run(["--checkpoint", run_dir, "--requests", str(path), *ENGINE], capsys)
        assert status == 2 and err.startswith(f"error: --requests {path} {expected}"), err
    status, _, err = run(["--checkpoint", run_dir, "--requests", str(tmp_path / "none.jsonl")],
                         capsys)
    assert status == 2 and err.startswith("error: --requests ")
