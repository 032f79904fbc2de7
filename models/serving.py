"""Serving: continuous batching of requests over fixed sequence slots and one shared page pool.

    engine = Engine(model, slots=8, num_pages=1024, page_size=16, max_seq_len=4096,
                    prefill_chunk_tokens=256)
    request_id = engine.submit(Request(prompt_ids, sampling=Sampling(temperature=0.8, top_p=0.95),
                                       seed=1, max_tokens=64, stop_tokens=(EOS,)))
    for event in engine.stream():     # TokenEvent(request_id, token, logprob, finish_reason)
        ...                           # tokens as they are produced, all requests interleaved
    completions = engine.run(requests)  # [Completion] in request order (tokens, logprobs, reason)

Slots: the engine holds the decode state of `slots` sequences: per KDA layer each slot's conv
tail and float32 recurrent state (constant size), per MLA layer one paged latent pool that every
slot reaches through its row of the block table (`models.paged_cache`; attention reads only the
pages a row holds, `models.attention.paged_latent_attention`). A request takes a free slot,
prefills, decodes, and leaves at its end; its slot and pages go to the next one (continuous
batching). Each `step()` runs, in order:

    admit     waiting requests take free slots, oldest first, if the pool has the pages for
              their prompt (else they wait)
    prefill   one chunk of one slot's prompt: the slot's KDA state is read out of the batch,
              continued by the chunk, and written back; its latents go to pages reserved for it
    decode    one token of every slot whose prompt is in: [slots, 1] in one program, sampled per
              request; idle and prefilling slots keep their KDA state and write their (ignored)
              latents to the null page

A prompt's last token goes in through a decode step, which samples the first generated token, so
every token is sampled by the same program. Pages are reserved just before the step that writes
them. When the pool runs out, cached prefixes are evicted first, then the newest running request
is preempted: its pages are freed and it waits at the front of the queue, to be prefilled again
from its prompt and the tokens it has generated (the same tokens come out, up to float32 rounding
of the recomputation, and the same sampling keys).

Compiled programs: decode is always [slots, 1]; prefill chunks are [1, C] for C in a few buckets
(`chunk_buckets`: page_size * 2^j up to prefill_chunk_tokens, and the powers of two below a page
for a prompt's tail), and a prompt is cut into pieces of exactly those lengths, so no padding ever
enters the KDA recurrence. A server thus compiles len(buckets) + 1 programs (+ 2 small copies with
prefix sharing) whatever its traffic: `compiled_programs()` counts them, `warmup()` compiles them
all up front. The decode and prefill programs donate the cache buffers (updated in place).

Sampling (`sample_rows`): per request greedy (temperature 0) or temperature / top_k / top_p, from a
key derived from the request's seed and the token's index, never from the batch: a request gives
the same tokens alone or among others. Log-probabilities are those of the sampled token under the
distribution it was drawn from (see `sample_rows`).

Pausing (tool calls): a request with `pause_sequences` pauses after generating any of them (a
tool call's closing tag): its Completion comes out with finish_reason "pause", and it keeps its
slot, its KDA state and its pages. `resume(request_id, forced, max_tokens)` appends `forced` tokens
(a tool's result) and continues it: only the new tokens are prefilled, from the state the slot
holds, never the whole conversation. `release(request_id)` ends a request wherever it is. A
paused request holds its slot until then; when pages run out, paused requests give theirs up
first (they are recomputed from their tokens when resumed), before running ones are preempted.

Prefix sharing (`prefix_sharing=True`): at each page boundary where a prefill chunk ends, the
engine keeps the sequence's full pages (reference counted, never written again) and a copy of its
slot's KDA state. A request whose tokens start with a kept prefix starts from it: it holds the
same pages and prefills only the rest. Kept prefixes are evicted least recently used first, when
pages run out or more than `max_prefixes` are kept. A prefix is keyed on its tokens and on the
contents of the images whose placeholders begin in it, so equal placeholders of other pixels
never share pages.

Images (a model with a vision tower): `Request(prompt, images=(pixels, ...))`, one image
[H, W, C] per placeholder run of the prompt, in order. At the request's first prefill chunk that
holds a placeholder, the tower, merger and projector run once on its images (packed in rows of
`max_image_patches` patches, the row count padded to a power of two), and every chunk replaces
its placeholders' embeddings by their merged image tokens, whichever chunk a run falls in: the
request gets the tokens `generate(..., images=pack_images(images, ...))` gives it. Tokens after
the prompt (generated, forced) are text. This adds a prefill program per chunk bucket that holds
placeholders, one tower program per power of two of vision rows, and a small gather per pair.
"""

import bisect
import collections
import dataclasses
import functools
import hashlib
import heapq
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.generate import Sampling, filter_logits
from models.jit_split import split_for_jit
from models.lm import DecodeState, HybridLM
from models.paged_cache import NULL_PAGE, PageAllocator
from models.prefill import check_positive_int, check_prompts
from models.vision import VisionBatch, merged_valid, num_image_tokens, pack_images

FinishReason = Literal["stop", "length", "pause"]
SEED_LIMIT = 2**32


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    prompt: token ids (at least one), each in [0, vocab_size).
    sampling: greedy (the default), or temperature with optional top_k / top_p (`Sampling`).
    seed: an int in [0, 2^32); token i is drawn with the key fold_in(key(seed), i).
    max_tokens: tokens to generate at most (until it pauses; `Engine.resume` sets the next
      segment's).
    stop_tokens: the request ends after generating any of these (the stop token is returned).
    pause_sequences: token sequences (non-empty) after which the request pauses (`Engine.resume`),
      checked against the end of everything it holds, prompt included, once per generated token.
    key_offset: token i generated after the prompt is drawn with the key index key_offset + i: a
      sequence continued from its tokens passes how many it had past its first prompt, to draw
      the keys an uninterrupted run would have drawn.
    images: the prompt's images [H, W, C], one per placeholder run, in the runs' order (for a
      model with a vision tower): the k-th placeholder token takes the k-th merged image token,
      as in `models.generate.generate(..., images=pack_images(images, ...))`. Requests compare
      equal when their images' contents do (`image_digests`).
    """

    prompt: tuple[int, ...]
    sampling: Sampling = Sampling()
    seed: int = 0
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()
    pause_sequences: tuple[tuple[int, ...], ...] = ()
    key_offset: int = 0
    images: tuple[np.ndarray, ...] = dataclasses.field(default=(), compare=False)
    image_digests: tuple[bytes, ...] = dataclasses.field(default=(), init=False)

    def __post_init__(self):
        ids = np.asarray(self.prompt)
        if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt must be a non-empty sequence of int token ids, got "
                             f"{_short(self.prompt)}")
        object.__setattr__(self, "prompt", tuple(int(t) for t in ids))
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a models.generate.Sampling, got {self.sampling!r}")
        if (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2^32), got {self.seed!r}")
        check_positive_int("max_tokens", self.max_tokens, "tokens generated at most")
        stops = tuple(self.stop_tokens)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stops):
            raise ValueError(f"stop_tokens must be int token ids, got {self.stop_tokens!r}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stops))
        pauses = tuple(tuple(sequence) for sequence in self.pause_sequences)
        if not all(pause and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                 for t in pause) for pause in pauses):
            raise ValueError(f"pause_sequences must be non-empty sequences of int token ids, got "
                             f"{_short(self.pause_sequences)}")
        object.__setattr__(self, "pause_sequences",
                           tuple(tuple(int(t) for t in pause) for pause in pauses))
        if (isinstance(self.key_offset, bool) or not isinstance(self.key_offset, numbers.Integral)
                or not 0 <= self.key_offset < 2**31):
            raise ValueError(f"key_offset must be an int in [0, 2^31), got {self.key_offset!r}")
        images = tuple(np.array(image, np.float32) for image in self.images)
        for index, image in enumerate(images):
            if image.ndim != 3:
                raise ValueError(f"images[{index}] must be [H, W, C] pixels, got shape "
                                 f"{image.shape}")
            image.flags.writeable = False
        object.__setattr__(self, "images", images)
        object.__setattr__(self, "image_digests", tuple(image_digest(i) for i in images))


def image_digest(image: np.ndarray) -> bytes:
    """A digest of an image's shape and float32 pixels: kept prefixes are keyed on it."""
    return hashlib.blake2b(repr(image.shape).encode() + image.tobytes(), digest_size=16).digest()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


class TokenEvent(NamedTuple):
    """One generated token of a request; finish_reason is set on its last token."""

    request_id: int
    token: int
    logprob: float
    finish_reason: FinishReason | None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request, or a paused one's segment: its generated tokens (since it started or
    was last resumed), their log-probabilities (`sample_rows`), and why it ended ("stop": a stop
    token, the last of `tokens`; "length": max_tokens, or the engine's max_seq_len reached;
    "pause": a pause sequence, the end of `tokens`, and the request waits for `Engine.resume`).
    prompt: the request's prompt (without the tokens of earlier segments)."""

    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    preemptions: int


@dataclasses.dataclass
class EngineStats:
    """Counters of an engine's work since it was built."""

    steps: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through prefill chunks
    shared_tokens: int = 0  # tokens not prefilled because a kept prefix covered them
    pages_allocated: int = 0  # pages taken from the free list
    peak_pages: int = 0  # most pages held at once (by sequences and kept prefixes)


class RowSampling(NamedTuple):
    """Per-row sampling parameters, each [B]: temperature float32 (0: greedy), top_k int32
    (>= vocab: all), top_p float32 (1: all), seed uint32, index int32 (the generated token's
    position in its request: the key is fold_in(key(seed), index))."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    index: jax.Array


def sample_rows(logits: jax.Array, rows: RowSampling) -> tuple[jax.Array, jax.Array]:
    """Next tokens [B] int32 and their log-probabilities [B] float32 from logits [B, V], each row
    by its own parameters and key.

    Log-probabilities: for temperature > 0, under the distribution the token was drawn from:
    softmax of logits / temperature restricted to the top_k, then top_p set (`filter_logits`)
    and renormalised; for greedy rows (temperature 0), under the model's own distribution,
    softmax(logits).
    """
    logits = logits.astype(jnp.float32)
    greedy = rows.temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, rows.temperature)[:, None]
    filtering = jnp.any((rows.top_k < logits.shape[-1]) | (rows.top_p < 1))
    filtered = jax.lax.cond(filtering, lambda x: filter_logits(x, rows.top_k, rows.top_p),
                            lambda x: x, scaled)
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(
        rows.seed, rows.index)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    log_probs = jax.nn.log_softmax(jnp.where(greedy[:, None], logits, filtered), axis=-1)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def chunk_buckets(page_size: int, max_chunk: int) -> tuple[int, ...]:
    """The prefill chunk lengths, ascending: page_size * 2^j up to max_chunk (whole pages) and
    the powers of two up to page_size (a prompt's tail within its last page)."""
    whole = [page_size << j for j in range(int(math.log2(max_chunk // page_size)) + 1)]
    tail = [1 << i for i in range(int(math.log2(page_size)) + 1)]
    return tuple(sorted(set(whole) | set(tail)))


def next_chunk(fed: int, stop: int, page_size: int, max_chunk: int) -> int:
    """The next prefill chunk's length for a sequence with `fed` tokens in its cache and tokens up
    to `stop` to prefill (fed < stop).

    Whole pages first, in the largest bucket that fits (so every chunk up to the last page
    boundary ends on a page boundary, where a prefix can be kept), then the tail in descending
    powers of two: one of `chunk_buckets(page_size, max_chunk)`. A sequence resumed within a
    page (`Engine.resume`) first fills that page, in descending powers of two.
    """
    boundary = stop // page_size * page_size
    if fed < boundary and fed % page_size:
        return 1 << ((page_size - fed % page_size).bit_length() - 1)
    if fed < boundary:
        pages = min((boundary - fed) // page_size, max_chunk // page_size)
        return page_size << (pages.bit_length() - 1)
    return 1 << ((stop - fed).bit_length() - 1)


def slot_axes(model: HybridLM) -> tuple[int | None, ...]:
    """For each leaf of the decode state's caches (in `jax.tree.leaves` order): the axis that
    indexes sequences (KDA conv tails and states; 1 in a scanned group's stacked caches), or
    None for the MLA page pools that every sequence shares."""
    def caches(batch):
        return jax.eval_shape(lambda: model.init_decode_state(
            batch, num_pages=2, page_size=1, max_pages_per_seq=1).caches)

    axes = []
    for one, two in zip(jax.tree.leaves(caches(1)), jax.tree.leaves(caches(2))):
        differ = [axis for axis, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b]
        axes.append(differ[0] if differ else None)
    return tuple(axes)


def _fresh_or_kept(leaf: jax.Array, axis: int, start: jax.Array) -> jax.Array:
    """The slot state leaf, zeroed where a row starts a sequence (start [B] == 0): a new request
    never continues the state its slot's previous occupant left."""
    shape = [1] * leaf.ndim
    shape[axis] = start.shape[0]
    return jnp.where(start.reshape(shape) > 0, leaf, jnp.zeros_like(leaf))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _prefill_program(structure, axes, variables, caches, slot, tokens, block_row, start,
                     image_rows):
    """One prompt chunk tokens [1, C] of the sequence in `slot` (int32 scalar), whose block table
    row is block_row [1, P] and whose cache holds start [1] tokens. Returns the caches with the
    slot's KDA state continued and the chunk's latents in its pages (the rest unchanged).
    image_rows: for a chunk that holds image placeholders, (features [1, C, D], is_image bool
    [1, C]) from `_chunk_features`: the placeholders' decoder inputs (None: text only)."""
    leaves, treedef = jax.tree.flatten(caches)
    mine = [leaf if axis is None else _fresh_or_kept(
        jax.lax.dynamic_index_in_dim(leaf, slot, axis, keepdims=True), axis, start)
        for leaf, axis in zip(leaves, axes)]
    state = DecodeState(jax.tree.unflatten(treedef, mine), block_row, start)
    model = structure.merge(variables)
    embedded = None
    if image_rows is not None:
        features, is_image = image_rows
        embedded = model.embed_inputs(tokens)
        embedded = jnp.where(is_image[..., None], features.astype(embedded.dtype), embedded)
    _, state = model.extend(tokens, state, all_logits=False, embedded=embedded)
    updated = [new if axis is None else jax.lax.dynamic_update_index_in_dim(leaf, new, slot, axis)
               for leaf, new, axis in zip(leaves, jax.tree.leaves(state.caches), axes)]
    return jax.tree.unflatten(treedef, updated)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_program(structure, axes, variables, caches, tokens, block_tables, lengths, active,
                    rows: RowSampling):
    """The engine's decode step (benchmarks call it on caches they fill) of the model
    `split_for_jit` gave as (structure, variables), with the caches' slot axes `slot_axes`: one
    token tokens [S, 1] for every slot, with block_tables [S, P], lengths [S] (tokens already
    cached; 0 starts a fresh KDA state) and per-row sampling `rows`. Returns the caches, the next
    tokens [S] and their log-probabilities [S] (`sample_rows`). Rows not `active` [S] keep their
    KDA state; their block table rows must point at the null page (their latents land there).
    The caches are donated."""
    leaves, treedef = jax.tree.flatten(caches)
    fresh = [leaf if axis is None else _fresh_or_kept(leaf, axis, lengths)
             for leaf, axis in zip(leaves, axes)]
    state = DecodeState(jax.tree.unflatten(treedef, fresh), block_tables, lengths)
    logits, state = structure.merge(variables).extend(tokens, state, all_logits=False)
    kept = []
    for old, new, axis in zip(leaves, jax.tree.leaves(state.caches), axes):
        if axis is None:
            kept.append(new)
            continue
        shape = [1] * old.ndim
        shape[axis] = active.shape[0]
        kept.append(jnp.where(active.reshape(shape), new, old))
    next_tokens, logprobs = sample_rows(logits, rows)
    return jax.tree.unflatten(treedef, kept), next_tokens, logprobs


@functools.partial(jax.jit, static_argnums=(0,))
def _read_slot(axes, caches, slot):
    """A copy of one slot's KDA state: the per-slot leaves, [1, ...] along their slot axis."""
    return tuple(jax.lax.dynamic_index_in_dim(leaf, slot, axis, keepdims=True)
                 for leaf, axis in zip(jax.tree.leaves(caches), axes) if axis is not None)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _write_slot(axes, caches, slot, saved):
    """The caches with one slot's KDA state replaced by `saved` (from `_read_slot`)."""
    leaves, treedef = jax.tree.flatten(caches)
    saved = iter(saved)
    return jax.tree.unflatten(treedef, [
        leaf if axis is None else jax.lax.dynamic_update_index_in_dim(leaf, next(saved), slot, axis)
        for leaf, axis in zip(leaves, axes)])


@functools.partial(jax.jit, static_argnums=(0,))
def _vision_program(structure, variables, images: VisionBatch):
    """The merged image tokens of a request's vision buffer [R, P, p p C]: features
    [R P / 4, D] (row-major; the valid ones in the images' order) from the tower, merger and
    projector. Compiled once per row count R (a power of two: `_vision_buffer`)."""
    features, _ = structure.merge(variables).vision(images)
    return features.reshape(-1, features.shape[-1])


@jax.jit
def _chunk_features(features, index):
    """The decoder inputs of a chunk's image placeholders: features [F, D] of the request's
    vision buffer, index int32 [1, C] (a position's row in features, -1 for a text token) ->
    (features [1, C, D], is_image bool [1, C]) for `_prefill_program`."""
    return jnp.take(features, jnp.maximum(index, 0), axis=0), index >= 0


_PROGRAMS = (_prefill_program, decode_program, _read_slot, _write_slot, _vision_program,
             _chunk_features)


def compiled_programs() -> int:
    """Programs the serving functions have compiled in this process (all engines together)."""
    return sum(program._cache_size() for program in _PROGRAMS)


def _placed_like_outputs(variables, caches):
    """Fresh caches placed as the programs return them: replicated over the mesh of the model's
    parameters (when they lie on one), so that the first prefill and decode calls run the
    programs every later call runs, instead of compiling each twice (once for caches on one
    device, once for caches on the mesh)."""
    sharding = getattr(jax.tree.leaves(variables)[0], "sharding", None)  # None: numpy
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return caches
    return jax.device_put(caches, jax.sharding.NamedSharding(sharding.mesh,
                                                             jax.sharding.PartitionSpec()))


@dataclasses.dataclass
class _Sequence:
    """A request in flight: its tokens so far and where its state lives."""

    id: int
    request: Request
    generated: list = dataclasses.field(default_factory=list)  # past the prompt, forced included
    logprobs: list = dataclasses.field(default_factory=list)  # of the segment's tokens
    slot: int | None = None
    fed: int = 0  # tokens in the slot's cache
    admitted: int = -1  # admission order: the highest is the newest (preempted first)
    preemptions: int = 0
    segment_start: int = 0  # generated tokens before the segment (since the last resume)
    max_tokens: int = 0  # the segment's tokens at most
    paused: bool = False
    images: "_Images | None" = None  # the prompt's images, for a request with images

    def __post_init__(self):
        self.max_tokens = self.request.max_tokens

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.request.prompt + tuple(self.generated)

    @property
    def length(self) -> int:
        """Tokens so far, prompt and generated."""
        return len(self.request.prompt) + len(self.generated)

    def token(self, position: int) -> int:
        """The token at `position` (without building the whole sequence)."""
        prompt = self.request.prompt
        if position < len(prompt):
            return prompt[position]
        return self.generated[position - len(prompt)]

    def ends_with(self, tokens: tuple[int, ...]) -> bool:
        start = self.length - len(tokens)
        return start >= 0 and all(self.token(start + i) == t for i, t in enumerate(tokens))


@dataclasses.dataclass
class _Images:
    """A request's images: their vision buffer, where their merged tokens go, their features.

    buffer: the images packed in rows of the engine's max_image_patches (`_vision_buffer`).
    rows: int32 [T] for each prompt position, the row of its feature in the tower's output
      (`_vision_program`), -1 for a text token.
    starts: each image's first placeholder position, ascending (for prefix keys).
    features: [F, D] the tower's output, computed when the first chunk with a placeholder runs.
    """

    buffer: VisionBatch
    rows: np.ndarray
    starts: tuple[int, ...]
    features: jax.Array | None = None


def _vision_buffer(images: Sequence[np.ndarray], patch_size: int,
                   max_patches: int) -> tuple[VisionBatch, np.ndarray]:
    """The images packed in rows of max_patches patch slots (`pack_images`), the row count padded
    to a power of two (so a server compiles the tower once per power of two), and the flat index
    of each merged image token in the tower's output, in the images' order: (buffer, int32 [N])."""
    packed = pack_images(images, patch_size=patch_size, num_rows=len(images),
                         max_patches=max_patches, channels=images[0].shape[-1])
    used = int(np.flatnonzero(packed.segment_ids.any(axis=1))[-1]) + 1
    rows = 1 << (used - 1).bit_length()
    pad = ((0, max(rows - len(images), 0)),)
    buffer = VisionBatch(*(np.pad(array[:rows], pad + ((0, 0),) * (array.ndim - 1))
                           for array in (packed.pixels, packed.segment_ids, packed.positions)))
    return buffer, np.flatnonzero(merged_valid(buffer.segment_ids).reshape(-1)).astype(np.int32)


@dataclasses.dataclass
class _Prefix:
    """A kept prefix: its full pages and a copy of the KDA state after its last token."""

    pages: tuple[int, ...]
    kda_state: tuple


class Engine:
    """Continuous batching over `slots` sequence slots (see the module docstring).

    model: the HybridLM (its parameters as they are: bf16 for `train.inference.load_model`).
    slots: sequences decoded together (the decode batch).
    num_pages: the shared page pool (page 0 is the null page); it bounds the MLA cache's memory,
      and may be far below slots * max_seq_len / page_size.
    page_size: tokens per page.
    max_seq_len: tokens a sequence may hold, prompt and generated together.
    prefill_chunk_tokens: the longest prefill chunk, page_size times a power of two.
    prefix_sharing: keep prefixes at page boundaries for later requests to start from.
    max_prefixes: kept prefixes at most (each holds one slot's KDA state on the device).
    max_image_patches: patches an image may have at most (a multiple of 4): a request's images
      are packed in vision rows of that many patches (`Request.images`).
    """

    def __init__(self, model: HybridLM, *, slots: int, num_pages: int, page_size: int = 16,
                 max_seq_len: int, prefill_chunk_tokens: int = 256,
                 prefix_sharing: bool = False, max_prefixes: int = 64,
                 max_image_patches: int = 1024):
        check_positive_int("slots", slots, "sequences decoded together")
        check_positive_int("page_size", page_size, "tokens per page of the MLA latent cache")
        check_positive_int("max_seq_len", max_seq_len, "tokens a sequence holds at most")
        check_positive_int("prefill_chunk_tokens", prefill_chunk_tokens,
                           "the longest prompt chunk of a prefill step")
        check_positive_int("max_prefixes", max_prefixes, "kept prefixes at most")
        check_positive_int("max_image_patches", max_image_patches, "patches of an image at most")
        if max_image_patches % 4:
            raise ValueError(f"max_image_patches must be a multiple of 4 (whole 2 x 2 blocks), "
                             f"got {max_image_patches}")
        whole_pages = prefill_chunk_tokens // page_size
        if prefill_chunk_tokens % page_size or whole_pages & (whole_pages - 1):
            raise ValueError(f"prefill_chunk_tokens must be page_size ({page_size}) times a power "
                             f"of two, got {prefill_chunk_tokens}")
        if not isinstance(num_pages, numbers.Integral) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), got "
                             f"{num_pages!r}")
        self.model = model
        self.slots = slots
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_image_patches = max_image_patches
        self.buckets = chunk_buckets(page_size, prefill_chunk_tokens)
        self.stats = EngineStats()
        self._structure, self._variables = split_for_jit(model)
        self._axes = slot_axes(model)
        self._allocator = PageAllocator(num_pages, page_size, slots,
                                        math.ceil(max_seq_len / page_size))
        self._caches = _placed_like_outputs(self._variables, model.init_decode_state(
            slots, num_pages=num_pages, page_size=page_size,
            max_pages_per_seq=self._allocator.max_pages_per_seq).caches)
        self._running: list[_Sequence | None] = [None] * slots
        self._waiting: list[tuple[int, _Sequence]] = []  # heap by request id: oldest first
        self._next_id = 0
        self._admissions = 0
        # Kept prefixes by key (`_prefix_key`: tokens and image digests).
        self._prefixes: collections.OrderedDict[tuple, _Prefix] | None = (
            collections.OrderedDict() if prefix_sharing else None)
        self._max_prefixes = max_prefixes
        self._completed: dict[int, Completion] = {}  # finished, not yet handed out
        self._paused: dict[int, _Sequence] = {}  # in their slots, or parked (slot None)

    # Requests in and out.

    def submit(self, request: Request) -> int:
        """Queues `request`; returns its id. Raises a ValueError naming what does not fit."""
        vocab = self.model.cfg.vocab_size
        check_prompts(np.asarray(request.prompt)[None], vocab)
        if any(not 0 <= t < vocab for t in request.stop_tokens):
            raise ValueError(f"stop_tokens must be token ids in [0, {vocab}), got "
                             f"{request.stop_tokens}")
        if any(not 0 <= t < vocab for pause in request.pause_sequences for t in pause):
            raise ValueError(f"pause_sequences must hold token ids in [0, {vocab}), got "
                             f"{_short(request.pause_sequences)}")
        if len(request.prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens leaves no room to generate within the "
                f"engine's max_seq_len of {self.max_seq_len} tokens; shorten the prompt or build "
                "the engine with a larger max_seq_len")
        self._check_pages(len(request.prompt) + request.max_tokens)
        sequence = _Sequence(self._next_id, request, images=self._images(request))
        self._next_id += 1
        heapq.heappush(self._waiting, (sequence.id, sequence))
        return sequence.id

    def _images(self, request: Request) -> _Images | None:
        """The request's images placed for prefill; None for a text request. Raises a ValueError
        naming what does not fit the model's tower or the prompt's placeholders."""
        vision = self.model.cfg.vision
        if vision is None:
            if request.images:
                raise ValueError("Request.images were given to an engine whose model has no "
                                 "vision tower: build it from a ModelConfig with "
                                 "vision=VisionConfig(...), or send text only")
            return None
        prompt = np.asarray(request.prompt)
        placeholders = np.flatnonzero(prompt == vision.image_token_id)
        if not request.images and not placeholders.size:
            return None
        counts = []
        for index, image in enumerate(request.images):
            height, width, channels = image.shape
            if channels != vision.in_channels:
                raise ValueError(f"Request.images[{index}] has {channels} channels, the tower "
                                 f"takes in_channels={vision.in_channels}")
            try:
                counts.append(num_image_tokens(height, width, vision.patch_size))
            except ValueError as error:
                raise ValueError(f"Request.images[{index}]: {error}") from None
            if 4 * counts[-1] > self.max_image_patches:
                raise ValueError(
                    f"Request.images[{index}] ({height} x {width}) has {4 * counts[-1]} patches, "
                    f"more than the engine's max_image_patches={self.max_image_patches}; resize "
                    "it or build the engine with a larger max_image_patches")
        if placeholders.size != sum(counts):
            raise ValueError(
                f"the prompt holds {placeholders.size} image placeholders (token "
                f"{vision.image_token_id}) but Request.images give {sum(counts)} merged image "
                f"tokens ({len(counts)} images): give each image a run of (h / 2)(w / 2) "
                "placeholders for its h x w patches, in image order")
        if prompt[-1] == vision.image_token_id:
            raise ValueError("the prompt ends with an image placeholder: close the image's run "
                             "(an <image_end> token) so that the prompt ends with text")
        buffer, feature_rows = _vision_buffer(request.images, vision.patch_size,
                                              self.max_image_patches)
        rows = np.full(len(prompt), -1, np.int32)
        rows[placeholders] = feature_rows
        firsts = np.cumsum([0, *counts[:-1]])
        return _Images(buffer, rows, tuple(int(placeholders[k]) for k in firsts))

    def _check_pages(self, longest: int) -> None:
        """Raises unless the pool holds a sequence of `longest` tokens (or max_seq_len)."""
        longest = min(longest, self.max_seq_len)
        pages = math.ceil((longest - 1) / self.page_size)  # the last token is never fed
        if pages > self._allocator.num_pages - 1:
            raise ValueError(
                f"the request may need {pages} pages of {self.page_size} tokens, the pool holds "
                f"{self._allocator.num_pages - 1}; build the engine with num_pages >= {pages + 1} "
                "or lower max_tokens")

    def resume(self, request_id: int, forced: Sequence[int], max_tokens: int) -> None:
        """Continues the paused request `request_id`: appends `forced` token ids (a tool's
        result, never sampled; may be empty) and generates up to `max_tokens` more, with the same
        seed, sampling, stop tokens and pause sequences. In its slot, only the new tokens are
        prefilled; a request that gave its slot up is recomputed from all its tokens."""
        sequence = self._paused.get(request_id)
        if sequence is None:
            raise ValueError(f"request {request_id} is not paused; only a request whose last "
                             "Completion ended with finish_reason 'pause' can be resumed")
        forced = [int(t) for t in np.asarray(forced, np.int64).reshape(-1)]
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in forced):
            raise ValueError(f"forced must be token ids in [0, {vocab}), got {_short(forced)}")
        check_positive_int("max_tokens", max_tokens, "tokens generated at most after the forced")
        if sequence.length + len(forced) >= self.max_seq_len:
            raise ValueError(
                f"forced: {len(forced)} tokens after the request's {sequence.length} leave no room "
                f"to generate within the engine's max_seq_len of {self.max_seq_len} tokens; "
                "shorten them or release the request")
        self._check_pages(sequence.length + len(forced) + max_tokens)
        del self._paused[request_id]
        sequence.generated.extend(forced)
        sequence.segment_start, sequence.max_tokens = len(sequence.generated), max_tokens
        sequence.logprobs, sequence.paused = [], False
        if sequence.slot is None:
            heapq.heappush(self._waiting, (sequence.id, sequence))

    def release(self, request_id: int) -> None:
        """Ends request `request_id` where it is (waiting, running or paused), without a
        Completion: its slot and pages are freed and it generates nothing more."""
        sequence = self._paused.pop(request_id, None)
        if sequence is None:
            sequence = next((s for s in self._running if s is not None and s.id == request_id),
                            None)
        if sequence is None:
            waiting = [entry[0] for entry in self._waiting]
            if request_id not in waiting:
                raise ValueError(f"request {request_id} is not waiting, running or paused here")
            self._waiting.pop(waiting.index(request_id))
            heapq.heapify(self._waiting)
            return
        if sequence.slot is not None:
            self._allocator.release(sequence.slot)
            self._running[sequence.slot] = None
            sequence.slot = None

    @property
    def paused(self) -> tuple[int, ...]:
        """The ids of the paused requests (waiting for `resume` or `release`)."""
        return tuple(self._paused)

    def _active(self) -> list[_Sequence]:
        """The sequences in slots that are not paused."""
        return [s for s in self._running if s is not None and not s.paused]

    @property
    def has_work(self) -> bool:
        """Whether a step has something to do: requests waiting or running (not paused)."""
        return bool(self._waiting) or bool(self._active())

    @property
    def pages_in_use(self) -> int:
        return self._allocator.num_pages - 1 - self._allocator.num_free

    def stream(self) -> Iterator[TokenEvent]:
        """Steps until every submitted request has finished or paused, yielding tokens as they
        come."""
        while self.has_work:
            yield from self.step()

    def run(self, requests: Iterable[Request]) -> list[Completion]:
        """Submits `requests`, runs them to their ends; their Completions, in request order (a
        request that pauses stays paused, its Completion's finish_reason "pause")."""
        ids = [self.submit(request) for request in requests]
        done = {}
        for event in self.stream():
            if event.finish_reason is not None:
                done[event.request_id] = self._completed.pop(event.request_id)
        return [done[i] for i in ids]

    def warmup(self) -> None:
        """Compiles every program a server can need (each prefill bucket, the decode step, the
        prefix copies) on idle slots. Raises unless the engine is idle."""
        if self.has_work or self._paused:
            raise ValueError("warmup needs an idle engine: call it before submitting requests")
        null_row = np.full((1, self._allocator.max_pages_per_seq), NULL_PAGE, np.int32)
        for size in self.buckets:
            self._caches = _prefill_program(
                self._structure, self._axes, self._variables, self._caches, np.int32(0),
                np.zeros((1, size), np.int32), null_row, np.zeros((1,), np.int32), None)
        self._decode(warmup=True)
        if self._prefixes is not None:
            saved = _read_slot(self._axes, self._caches, np.int32(0))
            self._caches = _write_slot(self._axes, self._caches, np.int32(0), saved)

    # The step.

    def step(self) -> list[TokenEvent]:
        """Admits waiting requests, runs one prefill chunk and one decode step; the tokens made."""
        self.stats.steps += 1
        self._admit()
        if self._waiting and not self._active() and any(s is not None for s in self._running):
            raise RuntimeError(
                f"no request can be admitted while every running request is paused (requests "
                f"{sorted(self._paused)} hold the slots or the pages): resume or release them "
                "before stepping")
        if self._waiting and not self._active():
            # Nothing runs, so nothing will free pages: waiting would never end.
            raise RuntimeError(
                f"no request can be admitted: {self._allocator.num_free} pages are free and none "
                f"is held by a running request; the page accounting has lost "
                f"{self._allocator.num_pages - 1 - self._allocator.num_free} pages")
        self._prefill()
        return self._decode()

    def _admit(self) -> None:
        while self._waiting and None in self._running:
            _, sequence = self._waiting[0]
            prefix = self._longest_prefix(sequence) if self._prefixes else None
            shared = 0 if prefix is None else len(prefix[0])
            needed = math.ceil(sequence.length / self.page_size) - shared // self.page_size
            while needed > self._allocator.num_free and self._evict_prefix(keep=prefix):
                pass
            if needed > self._allocator.num_free:
                return  # waits for running requests to free pages
            heapq.heappop(self._waiting)
            slot = self._running.index(None)
            self._running[slot] = sequence
            sequence.slot, sequence.fed = slot, 0
            sequence.admitted, self._admissions = self._admissions, self._admissions + 1

    def _prefill(self) -> None:
        waiting = [s for s in self._active() if s.fed < s.length - 1]
        if not waiting:
            return
        sequence = min(waiting, key=lambda s: s.admitted)
        if sequence.fed == 0 and self._start_from_prefix(sequence):
            return  # the kept prefix holds all but the last token: the decode step takes it
        size = next_chunk(sequence.fed, sequence.length - 1, self.page_size,
                          self.prefill_chunk_tokens)
        if not self._reserve(sequence, sequence.fed + size):
            return
        slot, start = sequence.slot, sequence.fed
        tokens = np.asarray([sequence.token(i) for i in range(start, start + size)], np.int32)
        self._caches = _prefill_program(
            self._structure, self._axes, self._variables, self._caches, np.int32(slot),
            tokens[None], self._allocator.block_tables[slot : slot + 1],
            np.array([start], np.int32), self._image_rows(sequence.images, start, size))
        sequence.fed += size
        self.stats.prefill_chunks += 1
        self.stats.prefill_tokens += size
        if self._prefixes is not None and sequence.fed % self.page_size == 0:
            self._keep_prefix(sequence)

    def _image_rows(self, images: _Images | None, start: int, size: int):
        """The image inputs of the chunk [start, start + size) for `_prefill_program`: None when
        it holds no placeholder of the prompt; the request's tower runs at its first such chunk."""
        prompt_part = None if images is None else images.rows[start : start + size]
        if prompt_part is None or not (prompt_part >= 0).any():
            return None
        rows = np.full((1, size), -1, np.int32)
        rows[0, : len(prompt_part)] = prompt_part
        if images.features is None:
            images.features = _vision_program(self._structure, self._variables, images.buffer)
        return _chunk_features(images.features, rows)

    def _decode(self, warmup: bool = False) -> list[TokenEvent]:
        ready = sorted((s for s in self._active() if s.fed == s.length - 1),
                       key=lambda s: s.admitted)
        for sequence in ready:
            if sequence.slot is not None:
                self._reserve(sequence, sequence.fed + 1)
        ready = [s for s in ready if s.slot is not None]
        if not ready and not warmup:
            return []
        tokens = np.zeros((self.slots, 1), np.int32)
        lengths = np.zeros((self.slots,), np.int32)
        active = np.zeros((self.slots,), bool)
        tables = np.full_like(self._allocator.block_tables, NULL_PAGE)
        vocab = self.model.cfg.vocab_size
        rows = RowSampling(np.zeros(self.slots, np.float32), np.full(self.slots, vocab, np.int32),
                           np.ones(self.slots, np.float32), np.zeros(self.slots, np.uint32),
                           np.zeros(self.slots, np.int32))
        for sequence in ready:
            slot, sampling = sequence.slot, sequence.request.sampling
            tokens[slot, 0] = sequence.token(sequence.fed)
            lengths[slot] = sequence.fed
            active[slot] = True
            tables[slot] = self._allocator.block_tables[slot]
            rows.temperature[slot] = sampling.temperature
            rows.top_k[slot] = vocab if sampling.top_k is None else min(sampling.top_k, vocab)
            rows.top_p[slot] = 1.0 if sampling.top_p is None else sampling.top_p
            rows.seed[slot] = sequence.request.seed
            rows.index[slot] = sequence.request.key_offset + len(sequence.generated)
        self._caches, next_tokens, logprobs = decode_program(
            self._structure, self._axes, self._variables, self._caches, tokens, tables, lengths,
            active, rows)
        if not ready:
            return []
        self.stats.decode_steps += 1
        next_tokens, logprobs = np.asarray(next_tokens), np.asarray(logprobs)
        events = []
        for sequence in ready:
            token, logprob = int(next_tokens[sequence.slot]), float(logprobs[sequence.slot])
            sequence.fed += 1
            sequence.generated.append(token)
            sequence.logprobs.append(logprob)
            reason = self._finish_reason(sequence, token)
            if reason is not None:
                self._end_segment(sequence, reason)
            events.append(TokenEvent(sequence.id, token, logprob, reason))
        return events

    # Sequences' ends.

    def _finish_reason(self, sequence: _Sequence, token: int) -> FinishReason | None:
        """Why the segment ends after `token`: a stop token, a full sequence, a pause sequence,
        the segment's max_tokens, in that order; None if it goes on."""
        if token in sequence.request.stop_tokens:
            return "stop"
        if sequence.length == self.max_seq_len:
            return "length"
        if any(sequence.ends_with(pause) for pause in sequence.request.pause_sequences):
            return "pause"
        if len(sequence.generated) - sequence.segment_start == sequence.max_tokens:
            return "length"
        return None

    def _end_segment(self, sequence: _Sequence, reason: FinishReason) -> None:
        """Hands out the segment's Completion; a finished request frees its slot, a paused one
        keeps it."""
        segment = tuple(sequence.generated[sequence.segment_start:])
        self._completed[sequence.id] = Completion(
            sequence.id, sequence.request.prompt, segment, tuple(sequence.logprobs), reason,
            sequence.preemptions)
        if reason == "pause":
            sequence.paused = True
            self._paused[sequence.id] = sequence
            return
        self._allocator.release(sequence.slot)
        self._running[sequence.slot] = None
        sequence.slot = None

    def completion(self, request_id: int) -> Completion:
        """The Completion of a finished request (handed out once)."""
        return self._completed.pop(request_id)

    # Pages.

    def _reserve(self, sequence: _Sequence, num_tokens: int) -> bool:
        """Pages for `sequence` to hold `num_tokens` tokens, evicting kept prefixes, then taking
        the slots of paused requests, then preempting the newest running requests while the pool
        is short. False if `sequence` itself was preempted."""
        missing = (math.ceil(num_tokens / self.page_size)
                   - len(self._allocator.pages_of(sequence.slot)))
        while missing > self._allocator.num_free:
            if self._evict_prefix():
                continue
            paused_in_slots = [s for s in self._paused.values() if s.slot is not None]
            newest = max(paused_in_slots or self._active(), key=lambda s: s.admitted)
            self._preempt(newest)
            if newest is sequence:
                return False
        self._allocator.reserve(sequence.slot, num_tokens)
        self.stats.pages_allocated += max(missing, 0)
        self.stats.peak_pages = max(self.stats.peak_pages, self.pages_in_use)
        return True

    def _preempt(self, sequence: _Sequence) -> None:
        """Frees the slot and pages of `sequence`, which is recomputed from its tokens: when it
        is admitted again (it waits at the front of the queue), or when it is resumed (paused)."""
        self._allocator.release(sequence.slot)
        self._running[sequence.slot] = None
        sequence.slot, sequence.fed = None, 0
        sequence.preemptions += 1
        self.stats.preemptions += 1
        if not sequence.paused:
            heapq.heappush(self._waiting, (sequence.id, sequence))

    # Kept prefixes.

    @staticmethod
    def _prefix_key(sequence: _Sequence, length: int) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The key of the first `length` tokens of `sequence`: the tokens, and the digests of the
        images whose placeholders begin among them (equal placeholders, other pixels: another
        key)."""
        images = 0 if sequence.images is None else bisect.bisect_left(sequence.images.starts,
                                                                      length)
        return sequence.tokens[:length], sequence.request.image_digests[:images]

    def _longest_prefix(self, sequence: _Sequence) -> tuple | None:
        """The key of the longest kept prefix of `sequence` that leaves at least its last token
        to feed."""
        if not self._prefixes:
            return None
        lengths = sorted({len(tokens) for tokens, _ in self._prefixes
                          if len(tokens) < sequence.length}, reverse=True)
        for length in lengths:
            key = self._prefix_key(sequence, length)
            if key in self._prefixes:
                return key
        return None

    def _start_from_prefix(self, sequence: _Sequence) -> bool:
        """Starts `sequence` (no tokens in its cache yet) from its longest kept prefix, if any:
        its slot holds the prefix's pages and KDA state. Looked up when its prefill begins
        (prefills run one at a time, oldest first), so requests admitted together with a common
        prompt share what the first of them has prefilled. True if only its last token is left."""
        key = self._longest_prefix(sequence)
        if key is None:
            return False
        kept = self._prefixes[key]
        self._prefixes.move_to_end(key)
        self._allocator.share(sequence.slot, kept.pages)
        self._caches = _write_slot(self._axes, self._caches, np.int32(sequence.slot),
                                   kept.kda_state)
        sequence.fed = len(key[0])
        self.stats.shared_tokens += len(key[0])
        return sequence.fed == sequence.length - 1

    def _keep_prefix(self, sequence: _Sequence) -> None:
        key = self._prefix_key(sequence, sequence.fed)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return
        pages = self._allocator.pages_of(sequence.slot)[: sequence.fed // self.page_size]
        self._allocator.retain(pages)
        self._prefixes[key] = _Prefix(pages, _read_slot(self._axes, self._caches,
                                                        np.int32(sequence.slot)))
        if len(self._prefixes) > self._max_prefixes:
            self._evict_prefix()

    def _evict_prefix(self, keep: tuple | None = None) -> bool:
        """Forgets the least recently used kept prefix (not `keep`); False if there is none."""
        for key in self._prefixes or ():
            if key != keep:
                self._allocator.drop(self._prefixes.pop(key).pages)
                return True
        return False
