"""Gated MLA: formula, causality, packed documents, decode == prefill through the paged cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from models.attention import GatedMLA, MLAConfig, count_mla_params
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
    layer = make_layer()
    x = jax.random.normal(jax.random.key(2), (1, 10, D_MODEL))
    changed = x.at[:, 6:].set(jax.random.normal(jax.random.key(3), (1, 4, D_MODEL)))
    y, y_changed = forward(layer, x), forward(layer, changed)
    np.testing.assert_array_equal(y[:, :6], y_changed[:, :6])
    assert not np.allclose(y[:, 6:], y_changed[:, 6:])


def test_packed_documents_equal_separate_runs():
    layer = make_layer()
    x = jax.random.normal(jax.random.key(4), (1, 10, D_MODEL))
    segment_ids = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3]])
    packed = forward(layer, x, segment_ids)
    for start, stop in [(0, 4), (4, 7), (7, 10)]:
        alone = forward(layer, x[:, start:stop])
        np.testing.assert_allclose(packed[:, start:stop], alone, atol=1e-5)


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
    seq = 8
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
    x = jax.random.normal(jax.random.key(7), (2, 6, D_MODEL))
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
    full = forward(layer, x[:1])
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
    "field, value", [("num_heads", 0), ("kv_lora_rank", -1), ("v_head_dim", 2.5)]
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
def test_cudnn_training_path_matches_xla_in_bfloat16(packed):
    # K3's head shapes: query/key heads of 192 (padded v), value heads of 128.
    cfg = MLAConfig(16, 512, 512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    layers = {
        impl: GatedMLA(1024, dataclasses.replace(cfg, implementation=impl), dtype=jnp.bfloat16,
                       rngs=nnx.Rngs(0))
        for impl in ("cudnn", "xla")
    }
    assert GatedMLA(1024, cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))._implementation() == "cudnn"
    x = jax.random.normal(jax.random.key(1), (2, 256, 1024), jnp.bfloat16)
    segment_ids = None
    if packed:
        segment_ids = jnp.concatenate([jnp.ones((2, 100), jnp.int32),
                                       2 * jnp.ones((2, 156), jnp.int32)], axis=1)

    def loss(layer):
        return jnp.mean(jnp.square(layer(x, segment_ids=segment_ids).astype(jnp.float32)))

    outputs = {impl: forward(layer, x, segment_ids) for impl, layer in layers.items()}
    grads = {impl: jax.jit(nnx.grad(loss))(layer) for impl, layer in layers.items()}
    assert relative_l2(outputs["cudnn"], outputs["xla"]) < 1e-2
    for got, want in zip(jax.tree.leaves(grads["cudnn"]), jax.tree.leaves(grads["xla"])):
        assert relative_l2(got, want) < 2e-2
