"""Autoregressive generation: prefill the prompt in chunks, then decode one token at a time.

The model continues each sequence from a `DecodeState`: KDA layers carry their convolution tail and
float32 recurrent state, MLA layers their latents in a paged pool (`models.prefill` builds it from
the prompt). The host keeps the page allocator: before each step it reserves the page the step
writes, and a sequence that emits the end token has its pages returned to the free list at once
(its row keeps computing, writing only to the null page, so the batch keeps one shape).

    result = generate(model, prompts, max_new_tokens=32, sampling=Sampling(temperature=0.8,
                      top_p=0.95), seed=0, end_token=EOS, prefill_chunk_tokens=4096)
    result.tokens   # [B, max_new_tokens] int32, `pad_token` after each sequence's end
    result.lengths  # [B] tokens generated, the end token included
    result = generate(model, prompts, max_new_tokens=8, images=pack_images(...))  # with images
"""

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from models.jit_split import ModelStructure, split_for_jit
from models.lm import DecodeState, HybridLM
from models.paged_cache import PageAllocator
from models.prefill import check_positive_int, check_prompts, prefill
from models.vision import VisionBatch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits.

    temperature: 0 picks the argmax (greedy); otherwise logits are divided by it (finite, >= 0).
    top_k: keep only the k most likely tokens, an int >= 1 (None: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, numbers.Real) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if self.top_k is not None:
            check_positive_int("top_k", self.top_k, "tokens kept; None keeps all")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p}")


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
    """Sets the logits outside the top-k, then top-p (nucleus), set to -inf. logits: [B, V] float32.

    top_k: None (all), an int >= 1, or per row [B] int32 (values >= V keep all).
    top_p: None (all), a float in (0, 1], or per row [B] float32 (1 keeps all). The nucleus is
      the smallest set of most likely tokens, after top_k, whose probability reaches top_p.
    Tokens tied with the last one kept are kept too.
    """
    if top_k is None and top_p is None:
        return logits
    vocab, rows = logits.shape[-1], logits.shape[:-1]
    top_k = jnp.broadcast_to(jnp.asarray(vocab if top_k is None else top_k, jnp.int32), rows)
    top_p = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), rows)
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    in_top_k = jnp.arange(vocab) < top_k[..., None]
    sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # A token stays if the tokens ranked above it hold less than top_p: the first always does.
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = (mass_above < top_p[..., None]) | (top_p[..., None] >= 1)
    kept = jnp.where(in_top_k & in_nucleus, sorted_logits, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V]."""
    logits = logits.astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


_sample_tokens = jax.jit(sample_tokens, static_argnums=2)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _extend_and_sample(structure: ModelStructure, sampling: Sampling, variables, tokens,
                       state: DecodeState, key):
    """One decode step: the next token [B] of every sequence and the new state (the old one is
    donated: the page pool is updated in place).

    Compiled once per model structure, sampling rule and token shape, across `generate` calls.
    """
    logits, state = structure.merge(variables).extend(tokens, state, all_logits=False)
    return sample_tokens(logits, key, sampling), state


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] int32
    lengths: np.ndarray  # [B] int32, generated tokens per sequence (end token included)


def generate(
    model: HybridLM,
    prompts: jax.Array,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    end_token: int | None = None,
    pad_token: int = 0,
    page_size: int = 16,
    prefill_chunk_tokens: int | None = None,
    images: VisionBatch | None = None,
) -> GenerationResult:
    """Continues each prompt [B, T] (equal lengths) by up to `max_new_tokens` tokens.

    images: the packed vision buffer (`models.vision.pack_images`) of the prompts' image
    placeholder runs, in order, for a model with a vision tower; the tower runs once, in the
    prefill, and decoding continues from the prompt's state as for text.

    A sequence stops after `end_token` (when given) or at the length limit; the loop stops when
    every sequence has. Sampling is reproducible for a given `seed`. The prompt is prefilled
    `prefill_chunk_tokens` tokens at a time (None: all at once). Prompt ids and `end_token` must
    lie in [0, vocab_size); MLA latents are cached in pages of `page_size` tokens.
    """
    vocab_size = model.cfg.vocab_size
    prompts = check_prompts(prompts, vocab_size)
    check_positive_int("max_new_tokens", max_new_tokens, "tokens generated per sequence at most")
    check_positive_int("page_size", page_size, "tokens per page of the MLA latent cache; try 16")
    if end_token is not None and not (
        isinstance(end_token, numbers.Integral) and 0 <= end_token < vocab_size
    ):
        raise ValueError(
            f"end_token must be None or a token id in [0, {vocab_size}) (the model's "
            f"vocab_size), got {end_token!r}"
        )
    batch, prompt_length = prompts.shape
    allocator = PageAllocator.holding(batch, prompt_length + max_new_tokens, page_size)
    last_logits, state = prefill(
        model, prompts, allocator=allocator,
        chunk_tokens=prompt_length if prefill_chunk_tokens is None else prefill_chunk_tokens,
        images=images,
    )
    structure, variables = split_for_jit(model)

    def step(variables, tokens, state, key):
        return _extend_and_sample(structure, sampling, variables, tokens, state, key)

    def with_tables(state: DecodeState) -> DecodeState:
        return dataclasses.replace(state, block_tables=jnp.asarray(allocator.block_tables))

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    next_tokens = _sample_tokens(last_logits, keys[0], sampling)
    generated = np.full((batch, max_new_tokens), pad_token, np.int32)
    lengths = np.zeros((batch,), np.int32)
    active = np.ones((batch,), bool)
    for position in range(max_new_tokens):
        tokens = np.asarray(next_tokens)
        generated[active, position] = tokens[active]
        lengths[active] += 1
        if end_token is not None:
            for row in np.flatnonzero(active & (tokens == end_token)):
                active[row] = False
                allocator.release(row)
        if not active.any() or position + 1 == max_new_tokens:
            break
        for row in np.flatnonzero(active):
            allocator.reserve(row, prompt_length + position + 1)
        next_tokens, state = step(
            variables, jnp.asarray(tokens)[:, None], with_tables(state), keys[position + 1]
        )
    return GenerationResult(generated, lengths)
