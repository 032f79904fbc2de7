"""Bad inputs are refused up front, naming the argument and the fix: generation's prompts and
options, the memory planner's command line, an unknown KDA implementation in the config."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from models.config import preset
from models.generate import Sampling, generate
from models.lm import HybridLM
from models.memory import main as memory_main
from models.prefill import prefill

VOCAB = 264  # the tiny preset's byte vocabulary
PROMPTS = jnp.ones((2, 3), jnp.int32)


@pytest.fixture(scope="module")
def model():
    """The tiny hybrid's shapes, no weights: each refusal comes before any computation."""
    return nnx.eval_shape(lambda: HybridLM(preset("tiny"), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("bad_id", [5000, -7, VOCAB])
def test_generate_refuses_token_ids_outside_the_vocabulary(model, bad_id):
    prompts = PROMPTS.at[1, 2].set(bad_id)
    message = rf"token ids in \[0, {VOCAB}\).*prompts\[1, 2\] = {bad_id}.*tokenizer"
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match=message):  # prefill is public too
        prefill(model, prompts, chunk_tokens=3, allocator=None)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(model, PROMPTS.astype(jnp.float32), max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"end_token must be None or a token id in \[0, {VOCAB}"):
        generate(model, PROMPTS, max_new_tokens=2, end_token=bad_id)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(top_k=1.5), r"top_k must be a positive int \(tokens kept; None keeps all\)"),
        (dict(top_k=True), "top_k must be a positive int"),
    ],
)
def test_sampling_refuses_non_finite_temperature_and_non_integer_top_k(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


@pytest.mark.parametrize("page_size", [0, -1, 2.5])
def test_generate_refuses_a_page_size_that_is_not_a_positive_int(model, page_size):
    with pytest.raises(ValueError, match=r"page_size must be a positive int .*try 16"):
        generate(model, PROMPTS, max_new_tokens=2, page_size=page_size)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "-4"], "argument --batch: must be a positive int, got '-4'"),
        (["--seq", "0"], "argument --seq: must be a positive int, got '0'"),
        (["--mesh", "fsdp=2,fsdp=4"], "--mesh names axis 'fsdp' twice"),
        (["--mesh", "fsdp=0"], "sizes >= 1, got 'fsdp=0'"),
        (["--mesh", "pipeline=2"], "axis=size pairs over"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    ],
)
def test_memory_cli_refuses_bad_arguments_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory_main(["--preset", "tiny", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_unknown_kda_impl_is_refused_at_config_time_naming_the_field():
    kda = preset("tiny").kda
    with pytest.raises(ValueError, match=r"KDAConfig.impl must be one of \['auto', 'reference'"):
        dataclasses.replace(kda, impl="foo")
    assert dataclasses.replace(kda, impl="chunked").impl == "chunked"
