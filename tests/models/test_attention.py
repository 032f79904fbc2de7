"""Gated MLA: formula, causality, packed documents, decode == prefill through the paged cache;
the packed cuDNN path's document description, its fallback and its checks (emulated on CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused

from models import attention
from models.attention import (
    GatedMLA,
    MLAConfig,
    causal_document_attention,
    count_mla_params,
    document_segments,
)
from models.lm import dots_and_kernels_saveable
from models.paged_cache import NULL_PAGE, PageAllocator, PagedLatentCache, init_pages


D_MODEL = 32
CFG = MLAConfig(
    num_heads=4,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)


def make_layer(cfg: MLAConfig = CFG, seed: int = 0) -> GatedMLA:
    return GatedMLA(D_MODEL, cfg, rngs=nnx.Rngs(seed))


@jax.jit
def forward(layer: GatedMLA, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    return layer(x, segment_ids=segment_ids)


@jax.jit
def cached_forward(layer: GatedMLA, x: jax.Array, cache: PagedLatentCache):
    return layer(x, cache=cache)


def reference_mla(layer: GatedMLA, x: np.ndarray) -> np.ndarray:
    """The layer's formula written out per head in float64 numpy. x: [B, T, d]."""
    cfg = layer.cfg
    w = {name: np.asarray(p, np.float64) for name, p in {
        "qb": layer.q_up.kernel[...], "kva": layer.kv_down.kernel[...],
        "kvn": layer.kv_norm.scale[...], "kvb": layer.kv_up.kernel[...], "o": layer.out.kernel[...],
    }.items()}

    def rms(v, gain):
        return v / np.sqrt(np.mean(v**2, -1, keepdims=True) + cfg.norm_eps) * gain

    x = np.asarray(x, np.float64)
    c_q = x
    if cfg.q_lora_rank is not None:
        c_q = rms(x @ np.asarray(layer.q_down.kernel[...], np.float64),
                  np.asarray(layer.q_norm.scale[...], np.float64))
    q = np.einsum("btc,chk->bthk", c_q, w["qb"])
    kv_a = x @ w["kva"]
    c_kv, k_shared = rms(kv_a[..., : cfg.kv_lora_rank], w["kvn"]), kv_a[..., cfg.kv_lora_rank :]
    kv = np.einsum("bsc,chk->bshk", c_kv, w["kvb"])
    k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim :]
    batch, seq = x.shape[:2]
    out = np.zeros((batch, seq, cfg.num_heads, cfg.v_head_dim))
    for h in range(cfg.num_heads):
        k_h = np.concatenate([k_nope[:, :, h], k_shared], -1)  # shared part: no rotation
        scores = np.einsum("btk,bsk->bts", q[:, :, h], k_h) / np.sqrt(cfg.qk_head_dim)
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, :, h] = probs @ v[:, :, h]
    if cfg.output_gate:
        gate_kernel = np.asarray(layer.gate.kernel[...], np.float64)
        out = out / (1 + np.exp(-np.einsum("btd,dhv->bthv", x, gate_kernel)))
    return np.einsum("bthv,hvd->btd", out, w["o"])


VARIANTS = [
    CFG,
    # Kimi Linear's MLA: queries straight from x, no output gate.
    dataclasses.replace(CFG, q_lora_rank=None, output_gate=False),
    # Values wider than queries/keys (padding goes to q and k instead of v).
    MLAConfig(2, 8, 6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=10),
]


@pytest.mark.parametrize("cfg", VARIANTS)
def test_count_mla_params_matches_module(cfg):
    layer = nnx.eval_shape(lambda: make_layer(cfg))
    actual = sum(p.size for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    assert count_mla_params(D_MODEL, cfg) == actual


def test_k3_mla_sizes():
    k3 = MLAConfig(96, 1536, 512, 128, 64, 128)
    assert k3.latent_dim == 576
    assert k3.softmax_scale == pytest.approx(192**-0.5)
    assert count_mla_params(7168, k3) == 232_196_096  # moe_arch.md §0: ~0.232B per layer


@pytest.mark.parametrize("cfg", VARIANTS)
def test_training_path_matches_formula(cfg):
    layer = make_layer(cfg)
    x = jax.random.normal(jax.random.key(1), (2, 9, D_MODEL))
    np.testing.assert_allclose(forward(layer, x), reference_mla(layer, x), rtol=2e-5, atol=2e-5)


def test_causal_future_tokens_never_change_earlier_outputs():
    layer = make_layer()  # the formula test's first layer and shapes: its compiled forward
    x = jax.random.normal(jax.random.key(2), (2, 9, D_MODEL))
    changed = x.at[:, 6:].set(jax.random.normal(jax.random.key(3), (2, 3, D_MODEL)))
    y, y_changed = forward(layer, x), forward(layer, changed)
    np.testing.assert_array_equal(y[:, :6], y_changed[:, :6])
    assert not np.allclose(y[:, 6:], y_changed[:, 6:])


def test_packed_documents_equal_separate_runs():
    layer = make_layer()
    x = jax.random.normal(jax.random.key(4), (1, 10, D_MODEL))
    segment_ids = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3]])
    packed = forward(layer, x, segment_ids)
    for start, stop in [(0, 4), (4, 7), (7, 10)]:
        # Each document alone, padded at the end to 4 tokens (one compiled shape; a causal
        # layer never looks ahead).
        alone = forward(layer, jnp.pad(x[:, start:stop], ((0, 0), (0, 4 - (stop - start)),
                                                         (0, 0))))
        np.testing.assert_allclose(packed[:, start:stop], alone[:, : stop - start], atol=1e-5)


def decode_in_chunks(layer, x, chunks, page_size, interleave=True):
    """Runs x [B, T, d] through the cache path chunk by chunk; returns outputs and allocator."""
    batch, seq, _ = x.shape
    max_pages = -(-seq // page_size)
    allocator = PageAllocator(1 + batch * max_pages, page_size, batch, max_pages)
    cache = PagedLatentCache(
        init_pages(allocator.num_pages, page_size, layer.cfg.latent_dim, jnp.float32),
        jnp.asarray(allocator.block_tables),
        jnp.zeros((batch,), jnp.int32),
    )
    outputs, start = [], 0
    for size in chunks:
        rows = range(batch) if interleave else reversed(range(batch))
        for row in rows:
            allocator.reserve(row, start + size)
        cache = PagedLatentCache(cache.pages, jnp.asarray(allocator.block_tables), cache.lengths)
        y, cache = cached_forward(layer, x[:, start : start + size], cache)
        outputs.append(y)
        start += size
    return jnp.concatenate(outputs, axis=1), allocator, cache


@settings(deadline=None, max_examples=6)
@given(
    seed=st.integers(0, 2**16),
    prompt=st.sampled_from([1, 3, 5]),
    page_size=st.sampled_from([1, 2, 4]),
)
def test_decode_equals_prefill(seed, prompt, page_size):
    layer = make_layer(VARIANTS[seed % 2], seed=seed % 3)
    seq = 9  # the formula test's shapes: the full forward is compiled once per variant
    x = jax.random.normal(jax.random.key(seed), (2, seq, D_MODEL))
    chunks = [prompt] + [1] * (seq - prompt)
    decoded, allocator, cache = decode_in_chunks(layer, x, chunks, page_size)
    np.testing.assert_allclose(decoded, forward(layer, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [seq, seq])
    # The two sequences' pages interleave in the pool: the block tables, not contiguity, order them.
    assert NULL_PAGE not in allocator.block_tables


def test_cache_stores_latent_dim_numbers_per_token():
    layer = make_layer()
    x = jax.random.normal(jax.random.key(6), (1, 4, D_MODEL))
    _, _, cache = decode_in_chunks(layer, x, [4], page_size=4)
    assert cache.pages.shape[-1] == CFG.kv_lora_rank + CFG.qk_rope_head_dim


def test_finished_sequence_writes_only_the_null_page():
    layer = make_layer()
    x = jax.random.normal(jax.random.key(7), (2, 9, D_MODEL))  # the first 6 tokens are cached
    page_size = 2
    allocator = PageAllocator(8, page_size, 2, 3)
    pages = init_pages(8, page_size, CFG.latent_dim, jnp.float32)
    lengths = jnp.zeros((2,), jnp.int32)
    for row in range(2):
        allocator.reserve(row, 2)
    cache = PagedLatentCache(pages, jnp.asarray(allocator.block_tables), lengths)
    _, cache = cached_forward(layer, x[:, :2], cache)
    allocator.release(1)  # sequence 1 ends; its page returns to the free list
    allocator.reserve(0, 6)  # sequence 0 grows into pages, possibly the one just freed
    cache = PagedLatentCache(cache.pages, jnp.asarray(allocator.block_tables), cache.lengths)
    # Row 1 still computes, writing only to the null page.
    y, cache = cached_forward(layer, x[:, 2:6], cache)
    full = forward(layer, x)  # the formula test's compiled shapes (causal: the rest is unseen)
    np.testing.assert_allclose(y[0], full[0, 2:6], rtol=1e-5, atol=1e-5)


def test_allocator_free_list():
    allocator = PageAllocator(num_pages=5, page_size=4, num_sequences=2, max_pages_per_seq=3)
    assert allocator.num_free == 4  # page 0 is never handed out
    allocator.reserve(0, 5)  # 2 pages
    allocator.reserve(1, 4)  # 1 page
    assert allocator.num_free == 1
    assert NULL_PAGE not in allocator.block_tables[0, :2]
    with pytest.raises(ValueError, match="exhausted"):
        allocator.reserve(1, 12)
    allocator.release(0)
    assert allocator.num_free == 3
    np.testing.assert_array_equal(allocator.block_tables[0], [NULL_PAGE] * 3)
    allocator.reserve(1, 12)
    assert len(set(allocator.block_tables[1])) == 3
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        allocator.reserve(1, 13)


@pytest.mark.parametrize(
    "field, value",
    [("num_heads", 0), ("kv_lora_rank", -1), ("v_head_dim", 2.5), ("max_segments", 0),
     ("implementation", "flash")],
)
def test_bad_config_names_the_field(field, value):
    kwargs = dict(num_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                  qk_rope_head_dim=2, v_head_dim=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        MLAConfig(**kwargs)


def test_segment_ids_with_cache_are_rejected():
    layer = make_layer()
    x = jnp.zeros((1, 2, D_MODEL))
    cache = PagedLatentCache(
        init_pages(2, 2, CFG.latent_dim, jnp.float32), jnp.ones((1, 1), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x, segment_ids=jnp.ones((1, 2), jnp.int32), cache=cache)


def relative_l2(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("gpu_implementation", ["cudnn", "cudnn_segments"])
def test_cudnn_training_path_matches_xla_in_bfloat16(packed, gpu_implementation):
    # K3's head shapes: query/key heads of 192 (padded v), value heads of 128.
    cfg = MLAConfig(16, 512, 512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    layers = {
        impl: GatedMLA(1024, dataclasses.replace(cfg, implementation=impl), dtype=jnp.bfloat16,
                       rngs=nnx.Rngs(0))
        for impl in (gpu_implementation, "xla")
    }
    assert (GatedMLA(1024, cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))._implementation()
            == "cudnn_segments")  # the H200's default
    x = jax.random.normal(jax.random.key(1), (2, 256, 1024), jnp.bfloat16)
    segment_ids = None
    if packed:
        segment_ids = jnp.concatenate([jnp.ones((2, 100), jnp.int32),
                                       2 * jnp.ones((2, 156), jnp.int32)], axis=1)

    def loss(layer):
        return jnp.mean(jnp.square(layer(x, segment_ids=segment_ids).astype(jnp.float32)))

    outputs = {impl: forward(layer, x, segment_ids) for impl, layer in layers.items()}
    grads = {impl: jax.jit(nnx.grad(loss))(layer) for impl, layer in layers.items()}
    assert relative_l2(outputs[gpu_implementation], outputs["xla"]) < 1e-2
    for got, want in zip(jax.tree.leaves(grads[gpu_implementation]),
                         jax.tree.leaves(grads["xla"])):
        assert relative_l2(got, want) < 2e-2


# --- the packed cuDNN path ("cudnn_segments") --------------------------------------------------


def reference_segments(segment_ids: np.ndarray, max_segments: int):
    """(offsets [B, M + 1], lengths [B, M], fits [B]) by walking each row's runs of equal ids."""
    batch = segment_ids.shape[0]
    offsets = np.full((batch, max_segments + 1), -1)
    lengths = np.full((batch, max_segments), -1)
    fits = np.zeros(batch, bool)
    for b, row in enumerate(segment_ids):
        runs = []  # [start, length] of each document
        for t, value in enumerate(row):
            if t == 0 or value != row[t - 1]:
                runs.append([t, 0])
            runs[-1][1] += 1
        for m, (start, length) in enumerate(runs[:max_segments]):
            offsets[b, m], lengths[b, m] = start, length
        fits[b] = len(runs) <= max_segments
    return offsets, lengths, fits


def assert_segments_match_reference(segment_ids, max_segments):
    got = document_segments(jnp.asarray(segment_ids, jnp.int32), max_segments)
    want = reference_segments(np.asarray(segment_ids), max_segments)
    for name, array, expected in zip(("offsets", "lengths", "fits"), got, want):
        np.testing.assert_array_equal(array, expected, err_msg=name)
    assert got.offsets.dtype == got.lengths.dtype == jnp.int32


@settings(deadline=None, max_examples=15)
@given(
    shape=st.sampled_from([(1, 1), (2, 6), (3, 16)]),
    max_segments=st.sampled_from([1, 3, 8]),
    alphabet=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_document_segments_match_a_walk_over_the_runs(shape, max_segments, alphabet, seed):
    # A small alphabet of ids: long runs (few documents) or short ones (rows over M).
    segment_ids = np.random.default_rng(seed).integers(0, alphabet, shape)
    assert_segments_match_reference(segment_ids, max_segments)


@pytest.mark.parametrize(
    "rows, max_segments, offsets, lengths, fits",
    [
        ([[7] * 6], 1, [[0, -1]], [[6]], [True]),  # one document
        ([[1, 2, 2, 2, 2, 0]], 3, [[0, 1, 5, -1]], [[1, 4, 1]], [True]),  # documents of length 1
        ([[1, 1, 2, 3, 0, 0]], 4, [[0, 2, 3, 4, -1]], [[2, 1, 1, 2]], [True]),  # exactly M
        ([[1, 2, 3, 4, 5]], 2, [[0, 1, -1]], [[1, 1]], [False]),  # over M: the first M kept
        ([[1, 1, 2, 2, 1, 1]], 4, [[0, 2, 4, -1, -1]], [[2, 2, 2, -1]], [True]),  # runs, not ids
    ],
)
def test_document_segments_hand_cases(rows, max_segments, offsets, lengths, fits):
    got = document_segments(jnp.asarray(rows, jnp.int32), max_segments)
    np.testing.assert_array_equal(got.offsets, offsets)
    np.testing.assert_array_equal(got.lengths, lengths)
    np.testing.assert_array_equal(got.fits, fits)


@pytest.mark.parametrize("max_segments", [0, -2, 2.5, True, None])
def test_document_segments_refuse_a_bad_max_segments(max_segments):
    with pytest.raises(ValueError, match="max_segments must be a positive int"):
        document_segments(jnp.ones((1, 4), jnp.int32), max_segments)


@pytest.mark.parametrize("segment_ids", [jnp.ones((4,), jnp.int32), jnp.ones((1, 4))])
def test_document_segments_refuse_bad_segment_ids(segment_ids):
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[B, T\]"):
        document_segments(segment_ids, 2)


def packed_inputs(dtype=jnp.bfloat16, batch=2, length=8, heads=2, qk_dim=24, v_dim=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (batch, length, heads, qk_dim), dtype),
            jax.random.normal(keys[1], (batch, length, heads, qk_dim), dtype),
            jax.random.normal(keys[2], (batch, length, heads, v_dim), dtype))


@pytest.mark.parametrize(
    "dtype, qk_dim, max_segments, message",
    [
        (jnp.bfloat16, 24, 4, "compute capability 9.0"),  # this CPU
        (jnp.float32, 24, 4, "bfloat16 or float16"),
        (jnp.bfloat16, 264, 4, "at most 256 and a multiple of 8"),
        (jnp.bfloat16, 20, 4, "at most 256 and a multiple of 8"),  # padded to q's 20, not 8k
        (jnp.bfloat16, 24, None, "needs max_segments"),
    ],
)
def test_packed_path_is_refused_where_cudnn_cannot_run_it(dtype, qk_dim, max_segments, message):
    q, k, v = packed_inputs(dtype, qk_dim=qk_dim)
    with pytest.raises(ValueError, match=message):
        causal_document_attention(q, k, v, scale=0.1, segment_ids=jnp.ones((2, 8), jnp.int32),
                                  implementation="cudnn_segments", max_segments=max_segments)


@pytest.mark.parametrize(
    "capability, dtype, head_dim, expected",
    [
        ((9, 0), jnp.bfloat16, 192, "cudnn_segments"),
        ((9, 0), jnp.float32, 192, "xla"),  # cuDNN takes 16-bit inputs only
        ((9, 0), jnp.bfloat16, 264, "xla"),  # a head too wide for the packed layout
        ((8, 0), jnp.bfloat16, 192, "xla"),  # pre-Hopper: the dense mask (XLA on this CPU)
        (None, jnp.bfloat16, 192, "xla"),  # no CUDA device
    ],
)
def test_default_implementation_is_the_packed_path_where_it_can_run(
        monkeypatch, capability, dtype, head_dim, expected):
    monkeypatch.setattr(attention, "_cuda_compute_capability", lambda: capability)
    monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91000)
    assert attention.default_implementation(dtype, head_dim) == expected


def test_layer_default_sizes_the_packed_check_by_its_widest_head(monkeypatch):
    monkeypatch.setattr(attention, "_cuda_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91000)
    fits = dataclasses.replace(CFG, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    wide = dataclasses.replace(fits, v_head_dim=264)
    for cfg, expected in ((fits, "cudnn_segments"), (wide, "xla")):
        layer = GatedMLA(D_MODEL, cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        assert layer._implementation() == expected


def test_layer_with_the_packed_path_is_refused_on_cpu():
    layer = GatedMLA(D_MODEL, dataclasses.replace(CFG, implementation="cudnn_segments"),
                     dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cudnn_segments"):
        layer(jnp.zeros((1, 4, D_MODEL), jnp.bfloat16), segment_ids=jnp.ones((1, 4), jnp.int32))


def emulated_packed_cudnn(packed_calls: list, mask_type=cudnn_fused.MaskType.PADDING_CAUSAL):
    """A stand-in for jax's cuDNN wrapper that computes what cuDNN's packed layout receives: the
    wrapper's own conversion (`_fix_seqlen_offsets`: the rows' segments flattened, offsets in
    elements), then attention within each flat segment, causal under PADDING_CAUSAL (the
    decoder) and among all its tokens under PADDING (the vision tower); tokens in none get 0.
    Checks that the caller asks for `mask_type`; appends to `packed_calls` whenever it runs."""
    causal = mask_type == cudnn_fused.MaskType.PADDING_CAUSAL
    expected_mask_type = mask_type

    def dot_product_attention(query, key, value, bias=None, mask=None, q_seqlen=None,
                              kv_seqlen=None, q_offsets=None, kv_offsets=None, *, scale,
                              mask_type, qkv_layout):
        assert bias is None and mask is None and qkv_layout == "BTNH"
        assert mask_type == expected_mask_type
        assert query.shape == key.shape == value.shape  # one head size (see pad_head_dims)
        lengths, _, starts, _ = cudnn_fused._fix_seqlen_offsets(
            q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key)
        batch, length, heads, width = query.shape
        lengths = lengths.reshape(-1)  # [B * M], the segments first, then zeros
        starts = starts.reshape(-1)[: lengths.size] // (heads * width)  # in tokens of [B * T]
        tokens = jnp.arange(batch * length)
        inside = (tokens[:, None] >= starts) & (tokens[:, None] < starts + lengths)  # [BT, B*M]
        segment = jnp.where(inside.any(1), jnp.argmax(inside, 1), -1)
        allowed = (segment[:, None] == segment[None, :]) & (segment[:, None] >= 0)
        if causal:
            allowed &= tokens[None, :] <= tokens[:, None]
        flat = [t.reshape(1, batch * length, heads, width) for t in (query, key, value)]
        out = jax.nn.dot_product_attention(*flat, mask=allowed[None, None], scale=scale)
        out = jnp.where((segment >= 0)[None, :, None, None], out, 0)
        jax.debug.callback(lambda: packed_calls.append(1))
        return out.reshape(query.shape)

    return dot_product_attention


@pytest.fixture
def packed_calls(monkeypatch):
    """The packed path on this CPU: device checks off, cuDNN emulated (`emulated_packed_cudnn`);
    the list of the emulator's runs. The fallback (`models.blockwise_attention`) runs as is."""
    calls = []
    monkeypatch.setattr(attention, "_require_packed_cudnn", lambda q: None)
    monkeypatch.setattr(cudnn_fused, "dot_product_attention", emulated_packed_cudnn(calls))
    return calls


def attention_vjp(q, k, v, d_out, segment_ids, implementation, max_segments=None):
    """(output, (dq, dk, dv)) of `causal_document_attention`, the gradients of sum(out * d_out).
    Not jitted here: a cached trace would keep a test's monkeypatched cuDNN for the next test."""

    def run(q, k, v):
        return causal_document_attention(q, k, v, scale=q.shape[-1] ** -0.5,
                                         segment_ids=segment_ids, implementation=implementation,
                                         max_segments=max_segments)

    out, vjp = jax.vjp(run, q, k, v)
    return out, vjp(d_out.astype(out.dtype))


def attention_and_grads(segment_ids, implementation, max_segments=None):
    """`attention_vjp` on float32 inputs [2, 8, 2, *]."""
    q, k, v = packed_inputs(jnp.float32)
    d_out = jax.random.normal(jax.random.key(9), v.shape)
    return attention_vjp(q, k, v, d_out, segment_ids, implementation, max_segments)


@pytest.mark.parametrize(
    "rows, max_segments, packed_runs",
    [
        ([[1, 1, 1, 2, 2, 2, 2, 0], [3] * 8], 3, True),
        ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 2, 2, 3, 3, 4, 4]], 8, True),  # documents of one token
        ([[1, 1, 2, 2, 3, 3, 4, 4], [1] * 8], 3, False),  # row 0 holds 4 > M: the fallback
        (None, 4, False),  # no documents: plain causal cuDNN, no packing
    ],
)
def test_packed_path_equals_the_dense_mask(packed_calls, rows, max_segments, packed_runs):
    segment_ids = None if rows is None else jnp.asarray(rows, jnp.int32)
    got_out, got_grads = attention_and_grads(segment_ids, "cudnn_segments", max_segments)
    want_out, want_grads = attention_and_grads(segment_ids, "xla")
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # vjp runs the forward once; the packed branch ran in it only when every row fit.
    assert bool(packed_calls) == packed_runs


def test_packed_path_keeps_two_runs_of_one_id_apart(packed_calls):
    # Documents are runs, on both branches: the dense mask alone would join the two runs of 1.
    rows = jnp.asarray([[1, 1, 1, 2, 2, 1, 1, 1]] * 2, jnp.int32)
    runs = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3]] * 2, jnp.int32)
    want, _ = attention_and_grads(runs, "xla")
    for max_segments in (3, 2):  # packed, then the fallback
        got, _ = attention_and_grads(rows, "cudnn_segments", max_segments)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(packed_calls) == 1
    joined, _ = attention_and_grads(rows, "xla")
    assert not np.allclose(joined, want, atol=1e-3)


def rows_of_documents(document_lengths: list[list[int]]) -> jax.Array:
    """segment_ids [B, T]: 1, 2, ... for consecutive documents of these lengths in each row."""
    return jnp.asarray([np.repeat(np.arange(1, len(lengths) + 1), lengths)
                        for lengths in document_lengths], jnp.int32)


# bench_train's attention: [4, 4096, 16], q/k heads of 192, v heads of 128, at most 16 documents.
GPU_MAX_SEGMENTS = 16
GPU_LAYOUTS = {
    "four_a_row": [[1000, 1500, 596, 1000], [1024] * 4, [2048, 1024, 512, 512], [300, 900, 2000,
                                                                                 896]],
    "irregular": [[1, 7, 4000, 88], [4096], [256] * GPU_MAX_SEGMENTS, [1] * 15 + [4081]],
    "a_row_over_max": [[240] * GPU_MAX_SEGMENTS + [256], [4096], [1024] * 4, [2048] * 2],
    "no_documents": None,
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_packed_cudnn_matches_the_dense_paths_at_the_bench_train_shape(layout):
    q, k, v = packed_inputs(jnp.bfloat16, batch=4, length=4096, heads=16, qk_dim=192, v_dim=128)
    d_out = jax.random.normal(jax.random.key(9), v.shape, jnp.bfloat16)
    lengths = GPU_LAYOUTS[layout]
    segment_ids = None if lengths is None else rows_of_documents(lengths)
    vjp = jax.jit(attention_vjp, static_argnames=("implementation", "max_segments"))
    packed = vjp(q, k, v, d_out, segment_ids, "cudnn_segments", GPU_MAX_SEGMENTS)
    dense = vjp(q, k, v, d_out, segment_ids, "cudnn")
    # The same bf16 numbers, attended in float32 by XLA.
    exact = vjp(*(t.astype(jnp.float32) for t in (q, k, v, d_out)), segment_ids, "xla")
    for reference in (exact, dense):
        assert relative_l2(packed[0], reference[0]) < 1e-2
        for got, want in zip(packed[1], reference[1]):
            assert relative_l2(got, want) < 2e-2
    if segment_ids is not None:  # the documents change the answer: the comparison can fail
        causal_only = vjp(q, k, v, d_out, None, "cudnn")
        assert relative_l2(causal_only[0], exact[0]) > 0.1


@pytest.fixture
def cuda_trace(monkeypatch):
    """Traces and lowers the cuDNN paths for CUDA on this CPU: jax's trace-time device queries
    answer as a Hopper GPU with cuDNN 9.10 would, and the dense path is cuDNN's."""
    monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn_fused, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(attention, "_require_packed_cudnn", lambda q: None)
    monkeypatch.setattr(attention, "backend_implementation", lambda dtype: "cudnn")


def packed_training_loss(policy):
    """sum(attention) over [2, 256, 4] bf16, heads of 192 and 128, M = 16, remat `policy`."""
    segment_ids = jnp.repeat(jnp.arange(2)[None], 2, 0).repeat(128, 1)

    def attend(q, k, v):
        return causal_document_attention(q, k, v, scale=0.1, segment_ids=segment_ids,
                                         implementation="cudnn_segments", max_segments=16)

    def loss(q, k, v):
        return jnp.sum(jax.checkpoint(attend, policy=policy)(q, k, v).astype(jnp.float32))

    q = jnp.zeros((2, 256, 4, 192), jnp.bfloat16)
    return loss, (q, q, q[..., :128])


def test_packed_path_lowers_to_cudnn_packed_calls_for_cuda(cuda_trace):
    loss, args = packed_training_loss(None)
    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call @__cudnn$fmha" in line]
    packed = [line for line in calls if "max_seg_per_batch\\22: 16" in line]
    # One forward and one backward, both packed: the fallback is plain JAX, no cuDNN call.
    assert len(calls) == 2 and len(packed) == 2
    for line in packed:
        assert "PADDING_CAUSAL" in line
        assert "fmhaSoftmax" in line  # no bias: the documents are in the offsets


def test_dots_kernels_keeps_the_packed_attention_in_its_cond(cuda_trace):
    # models.lm's policy looks into the cond's branches: the backward does not rerun cuDNN.
    def forward_calls(policy):
        loss, args = packed_training_loss(policy)
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(*args))
        return jaxpr.count("dot_product_attention_fwd")

    assert forward_calls(dots_and_kernels_saveable) == 1  # the packed branch's forward, once
    assert forward_calls(jax.checkpoint_policies.nothing_saveable) == 2
