"""Chunked prefill: a long prompt fed through `HybridLM.extend` a fixed number of tokens at a time.

    allocator = PageAllocator.holding(batch, prompt_length + new_tokens, page_size=256)
    logits, state = prefill(model, prompts, chunk_tokens=4096, allocator=allocator)
    logits, state = prefill(model, prompts, chunk_tokens=4096, allocator=allocator,
                            images=pack_images(...))   # a prompt with image placeholders
    logits   # [B, V] float32 at the last prompt position ([B, T, V] with all_logits=True)
    state    # the DecodeState after the prompt: decoding continues from it (`models.generate`)

Each chunk continues from the state the previous one left: KDA layers carry their convolution
tail and float32 recurrent state, MLA layers append the chunk's latents to the paged pool and
attend to every latent cached before them. Before a chunk runs, the host allocator reserves the
pages it writes.

Shapes: every full chunk is [B, chunk_tokens] and the state's shapes are set by the allocator
(pool size, block-table width), so all full chunks run one compiled program, and a shorter last
chunk one more, however long the prompt. The state is donated to each step, so the page pool is
updated in place rather than copied per chunk.

Memory: a chunk's activations are those of a `chunk_tokens`-long forward, and they do not grow
with the prompt or the cache's capacity. Each MLA layer attends over the pages its rows hold a
block at a time with an online softmax (`models.attention.paged_latent_attention`): scores
[B, H, chunk_tokens, cache_pages_per_block * page_size] float32 (`MLAConfig`) and a float32
latent-space accumulator [B, chunk_tokens, H, kv_lora_rank]. Without all_logits the LM head runs
on the last position only, so no [B, chunk_tokens, V] logits are built. `chunk_tokens` is bounded
by those per-chunk terms and the layers' activations; what grows with the prompt is only the page
pool (`latent_dim` numbers per token per MLA layer), and a chunk's work, which reads every page
cached before it.

Numerics: the full forward's logits up to float32 rounding. Chunk boundaries regroup KDA's
recurrence, and MLA attends in the latent space (keys and values absorbed into the queries).
"""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from models.jit_split import ModelStructure, split_for_jit
from models.lm import DecodeState, HybridLM
from models.paged_cache import PageAllocator
from models.vision import VisionBatch, VisionConfig, merged_valid


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def _extend_chunk(structure: ModelStructure, all_logits: bool, variables, tokens,
                  state: DecodeState, embedded=None):
    """One chunk [B, C] appended to `state`: logits [B, C, V] (all_logits) or [B, V], new state.
    Without all_logits the LM head runs on the chunk's last position only. embedded: the chunk's
    decoder input [B, C, D] for a prompt with images (None: its token embeddings).

    Compiled once per model structure, chunk shape and state shape (and with or without images).
    """
    return structure.merge(variables).extend(tokens, state, all_logits=all_logits,
                                             embedded=embedded)


@functools.partial(jax.jit, static_argnums=0)
def _embed_inputs(structure: ModelStructure, variables, tokens, images: VisionBatch):
    """The prompt's decoder input [B, T, D] with its images merged in (`HybridLM.embed_inputs`)."""
    return structure.merge(variables).embed_inputs(tokens, images)


def check_images(prompts: np.ndarray, images: VisionBatch, vision: VisionConfig) -> None:
    """Raises a ValueError unless the prompts [B, T] hold one image placeholder per merged image
    token of `images` (whose images follow the placeholder runs' order)."""
    placeholders = int(np.count_nonzero(prompts == vision.image_token_id))
    merged = int(np.count_nonzero(merged_valid(np.asarray(images.segment_ids))))
    if placeholders != merged:
        raise ValueError(
            f"the prompts hold {placeholders} image placeholders (token "
            f"{vision.image_token_id}) but images has {merged} merged image tokens: give each "
            "image a run of (h / 2)(w / 2) placeholders for its h x w patches, in image order "
            "(train.multimodal.interleaved_example builds them)")


def check_positive_int(name: str, value, meaning: str) -> None:
    """Raises a ValueError naming `name` (and what it counts) unless `value` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {value!r}")


def check_prompts(prompts, vocab_size: int) -> np.ndarray:
    """Prompts [B, T] as int32 token ids on the host. Raises a ValueError unless they are
    integers of shape [B, T] (T >= 1) in [0, vocab_size)."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [B, T] token ids with T >= 1, got {prompts.shape}")
    if not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(
            f"prompts must be integer token ids, got dtype {prompts.dtype}; pass the tokenizer's "
            "int32 ids"
        )
    outside = np.argwhere((prompts < 0) | (prompts >= vocab_size))
    if outside.size:
        row, column = outside[0]
        raise ValueError(
            f"prompts must be token ids in [0, {vocab_size}) (the model's vocab_size), got "
            f"prompts[{row}, {column}] = {prompts[row, column]} ({len(outside)} ids outside); "
            "encode the prompts with the model's tokenizer"
        )
    return prompts.astype(np.int32)


def check_room(allocator: PageAllocator, batch: int, num_tokens: int) -> None:
    """Raises unless `allocator` can hold `batch` sequences of `num_tokens` tokens each."""
    if allocator.block_tables.shape[0] != batch:
        raise ValueError(
            f"the allocator has {allocator.block_tables.shape[0]} sequences, the prompts {batch}; "
            "build the PageAllocator with num_sequences equal to the batch size"
        )
    if math.ceil(num_tokens / allocator.page_size) > allocator.max_pages_per_seq:
        raise ValueError(
            f"{num_tokens} tokens need {math.ceil(num_tokens / allocator.page_size)} pages of "
            f"{allocator.page_size} per sequence, the block table holds "
            f"{allocator.max_pages_per_seq}; build the PageAllocator with a larger "
            "max_pages_per_seq (PageAllocator.holding sizes it for a length)"
        )
    missing = allocator.missing_pages(num_tokens)
    if missing > allocator.num_free:
        raise ValueError(
            f"too few pages: {batch} sequences of {num_tokens} tokens need {missing} more pages, "
            f"{allocator.num_free} are free; build the PageAllocator with a larger num_pages "
            "(PageAllocator.holding sizes it for a length)"
        )


def prefill(
    model: HybridLM,
    prompts,
    *,
    chunk_tokens: int,
    allocator: PageAllocator,
    all_logits: bool = False,
    images: VisionBatch | None = None,
) -> tuple[jax.Array, DecodeState]:
    """Feeds prompts [B, T] (equal lengths, ids in [0, vocab_size)) through the model
    `chunk_tokens` tokens at a time.

    images: the packed vision buffer of the prompts' image placeholders (`models.vision`,
      `pack_images`), or None. The tower runs once, on the whole prompt's images; the chunks
      prefill slices of the merged embeddings (`HybridLM.embed_inputs`).

    allocator: the host page allocator of the MLA latents, one sequence per prompt row; it must
      have room for T tokens per row (checked before any chunk runs), and decoding goes on with it.
    all_logits: return every position's logits [B, T, V] (short prompts: that is T x V floats per
      row) instead of the last position's [B, V].
    Returns (logits float32, the DecodeState after the prompt).
    """
    check_positive_int("chunk_tokens", chunk_tokens, "prompt tokens per prefill step")
    # On the host: chunks are sliced without compiles.
    prompts = check_prompts(prompts, model.cfg.vocab_size)
    batch, length = prompts.shape
    check_room(allocator, batch, length)
    state = model.init_decode_state(
        batch, num_pages=allocator.num_pages, page_size=allocator.page_size,
        max_pages_per_seq=allocator.max_pages_per_seq,
    )
    structure, variables = split_for_jit(model)
    embedded = None
    if images is not None:
        # A model without a tower refuses the images here (`HybridLM.embed_inputs`).
        embedded = _embed_inputs(structure, variables, jnp.asarray(prompts), images)
        check_images(prompts, images, model.cfg.vision)
    pieces = []
    for start in range(0, length, chunk_tokens):
        stop = min(start + chunk_tokens, length)
        for row in range(batch):
            allocator.reserve(row, stop)
        state = DecodeState(state.caches, jnp.asarray(allocator.block_tables), state.lengths)
        logits, state = _extend_chunk(
            structure, all_logits, variables, jnp.asarray(prompts[:, start:stop]), state,
            None if embedded is None else embedded[:, start:stop],
        )
        if all_logits:
            pieces.append(logits)
    return (jnp.concatenate(pieces, axis=1) if all_logits else logits), state
