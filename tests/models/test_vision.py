"""The vision tower (models.vision) and images in the hybrid: patch order and merger, 2D RoPE,
interpolated positions, packing, the merge into the embeddings, the K3 counts, sharding.

Compiles are the cost on a CPU: one tiny tower and one tiny two-layer hybrid, each jitted once at
module level for one buffer shape, that every packed-versus-alone comparison reuses.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.sharding import batch_sharding, make_mesh, shard_module
from models.config import ModelConfig, count_params, preset, released_k3_json
from models.lm import HybridLM
from models.vision import (DEFAULT_QKV_WIDTH, VisionBatch, VisionConfig, VisionEncoder,
                           interpolated_positions, merge_image_features, merge_patches,
                           num_image_tokens, pack_images, patch_positions, patchify, rope_2d,
                           rope_2d_angles)

PATCH = 2
TINY = VisionConfig(patch_size=PATCH, width=16, num_layers=2, num_heads=2, head_dim=8,
                    mlp_hidden=32, pos_table=(8, 8), image_token_id=260)  # a byte-level unused id
D_MODEL = 24
# Patch grids (h, w) from 2 x 2 to 2 x 64 and 64 x 2; all of them fit two rows of 160 patches.
GRIDS = [(2, 2), (2, 64), (6, 4), (64, 2)]
ROWS, SLOTS = 2, 160


@jax.jit
def encode(encoder, batch):
    return encoder(batch)


@jax.jit
def lm_forward(model, tokens, segment_ids, images):
    return model(tokens, segment_ids, images)


def image(seed, grid, channels=3):
    h, w = grid
    return np.random.default_rng(seed).normal(size=(h * PATCH, w * PATCH, channels)).astype(
        np.float32)


def pack(images, rows=ROWS, slots=SLOTS):
    return pack_images(images, patch_size=PATCH, num_rows=rows, max_patches=slots)


@pytest.fixture(scope="module")
def encoder():
    return VisionEncoder(TINY, D_MODEL, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def images():
    return [image(seed, grid) for seed, grid in enumerate(GRIDS)]


def test_patchify_order_and_merger_equal_an_explicit_pixel_shuffle():
    h, w = 6, 4
    picture = image(0, (h, w))
    patches, positions = patchify(picture, PATCH)
    # Every patch once, its pixels at its (row, col), in (y, x, channel) order.
    assert sorted(map(tuple, positions)) == [(r, c) for r in range(h) for c in range(w)]
    for patch, (r, c) in zip(patches, positions):
        block = picture[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
        np.testing.assert_array_equal(patch, block.reshape(-1))
    # Features of the raster grid, written in the patches' order, then merged: each merged token
    # is its 2 x 2 block's features side by side, blocks in raster order.
    features = np.random.default_rng(1).normal(size=(h, w, 5)).astype(np.float32)
    merged = np.asarray(merge_patches(jnp.asarray(features[tuple(patch_positions(h, w).T)])[None]))
    shuffled = [np.concatenate([features[2 * i, 2 * j], features[2 * i, 2 * j + 1],
                                features[2 * i + 1, 2 * j], features[2 * i + 1, 2 * j + 1]])
                for i in range(h // 2) for j in range(w // 2)]
    np.testing.assert_array_equal(merged[0], np.stack(shuffled))


@pytest.mark.slow
def test_packed_images_equal_each_image_alone(encoder, images):
    """Four images of grids 2x2 .. 2x64 and 64x2 in one buffer: each image's merged tokens are
    (h/2)(w/2) and equal those of the image alone in a buffer of the same shape."""
    packed = pack(images)
    assert len(set(packed.segment_ids[:, 0])) == 1 and packed.segment_ids[0].max() == 3
    features, valid = encode(encoder, packed)
    counts = [num_image_tokens(h * PATCH, w * PATCH, PATCH) for h, w in GRIDS]
    assert counts == [(h // 2) * (w // 2) for h, w in GRIDS]
    assert features.shape == (ROWS, SLOTS // 4, D_MODEL) and int(valid.sum()) == sum(counts)
    per_image = np.split(np.asarray(features)[np.asarray(valid)], np.cumsum(counts)[:-1])
    for picture, count, got in zip(images, counts, per_image):
        alone, alone_valid = encode(encoder, pack([picture]))
        assert int(alone_valid.sum()) == count
        np.testing.assert_allclose(got, np.asarray(alone)[np.asarray(alone_valid)], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.slow
def test_no_gradient_flows_between_images(encoder, images):
    packed = pack(images)
    image_ids = packed.segment_ids + 10 * np.arange(ROWS)[:, None]  # unique across rows
    weights = jax.random.normal(jax.random.key(0), (ROWS, SLOTS // 4, D_MODEL))

    @jax.jit
    def pixel_gradient(encoder, pixels, target):
        def one_image_output(pixels):
            features, _ = encoder(dataclasses.replace(packed, pixels=pixels))
            return jnp.sum(jnp.where(image_ids[:, ::4, None] == target, features * weights, 0))
        return jax.grad(one_image_output)(pixels)

    for target in np.unique(image_ids[packed.segment_ids > 0]):
        grad = np.abs(np.asarray(pixel_gradient(encoder, packed.pixels, target))).sum(-1)
        inside = image_ids == target
        assert grad[inside].min() > 0
        assert not grad[~inside].any(), f"image {target} reads other patches"


def test_invalid_sizes_raise_naming_the_field():
    with pytest.raises(ValueError, match="image height=30"):
        patchify(np.zeros((30, 28, 3)), 14)  # 30 pixels: not whole 2 x 2 blocks of 14
    with pytest.raises(ValueError, match="image width=14"):
        num_image_tokens(28, 14, 14)
    with pytest.raises(ValueError, match="max_patches=10"):
        pack([image(0, (2, 2))], slots=10)
    with pytest.raises(ValueError, match=r"images\[0\] has 16 patches"):
        pack([image(0, (4, 4))], slots=12)
    with pytest.raises(ValueError, match="num_rows=1"):
        pack([image(0, (2, 2))] * 3, rows=1, slots=8)
    with pytest.raises(ValueError, match=r"images\[1\] must be \[H, W, channels=3\]"):
        pack([image(0, (2, 2)), image(1, (2, 2), channels=1)])
    assert not pack([]).segment_ids.any()  # a text-only batch: all padding, same shapes
    bad = pack([image(0, (2, 2))], slots=8)
    with pytest.raises(ValueError, match="VisionBatch.pixels"):
        VisionEncoder(TINY, D_MODEL, rngs=nnx.Rngs(0))(
            VisionBatch(bad.pixels[:, :6], bad.segment_ids[:, :6], bad.positions[:, :6]))
    for field, value in (("head_dim", 6), ("patch_size", 0), ("pos_table", (64,)),
                         ("num_heads", 1.5)):
        with pytest.raises(ValueError, match=f"VisionConfig.{field}"):
            dataclasses.replace(TINY, **{field: value})
    for token in (None, 264):
        with pytest.raises(ValueError, match="ModelConfig.vision.image_token_id"):
            preset("tiny", vision=dataclasses.replace(TINY, image_token_id=token))


def numpy_rope(x, positions, theta):
    """The complex-number form: pair j of x is x[2j] + i x[2j+1], turned by col * f_(j//2) for
    even j and row * f_(j//2) for odd j."""
    k = x.shape[-1]
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2]
    j = np.arange(k // 2)
    freqs = theta ** (-4.0 * (j // 2) / k)
    coordinate = np.where(j % 2 == 0, positions[..., 1:2], positions[..., 0:1])  # [..., T, K/2]
    turned = z * np.exp(1j * coordinate * freqs)[..., None, :]
    return np.stack([turned.real, turned.imag], -1).reshape(x.shape)


def test_rope_2d():
    k, theta = 16, 10000.0
    x = np.random.default_rng(0).normal(size=(2, 7, 3, k)).astype(np.float32)  # [B, T, H, K]
    positions = np.random.default_rng(1).integers(0, 64, size=(2, 7, 2))

    def rotate(x, positions):
        return np.asarray(rope_2d(jnp.asarray(x), rope_2d_angles(positions, k, theta)))

    np.testing.assert_array_equal(rotate(x, np.zeros_like(positions)), x)  # identity at (0, 0)
    np.testing.assert_allclose(rotate(x, positions), numpy_rope(x, positions, theta), rtol=0,
                               atol=2e-6)
    # Attention logits q . k depend on coordinate differences only.
    q, key = x, np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
    shifted = positions + np.array([5, 9])

    def logits(p):
        return np.einsum("bthk,bshk->bhts", rotate(q, p), rotate(key, p))

    np.testing.assert_allclose(logits(shifted), logits(positions), rtol=0, atol=2e-5)


def numpy_bilinear(table, h, w):
    """The table [Ht, Wt, D] resized to [h, w, D]: half-pixel centres, edges clamped, no
    antialiasing (PyTorch's `interpolate(mode="bilinear", align_corners=False)`), separably."""
    def weights(out, size):
        m = np.zeros((out, size))
        for i in range(out):
            source = max((i + 0.5) * size / out - 0.5, 0.0)
            low = min(int(np.floor(source)), size - 1)
            m[i, low] += 1 - (source - low)
            m[i, min(low + 1, size - 1)] += source - low
        return m
    return np.einsum("ij,jkd,lk->ild", weights(h, table.shape[0]), table.astype(np.float64),
                     weights(w, table.shape[1]))


@pytest.mark.parametrize("grid", [(8, 8), (2, 64), (64, 2), (5, 11), (13, 3)])
def test_interpolated_positions_equal_numpy_bilinear(grid):
    table = np.random.default_rng(0).normal(size=(8, 8, 4)).astype(np.float32)
    h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    positions = np.stack([rows, cols], -1)
    got = interpolated_positions(jnp.asarray(table), positions, np.broadcast_to(grid, (h, w, 2)))
    np.testing.assert_allclose(got, numpy_bilinear(table, h, w), rtol=0, atol=1e-6)
    if grid == (8, 8):
        np.testing.assert_array_equal(got, table)


def test_merge_image_features_fills_the_kth_run_with_the_kth_image():
    """Images of 2, 3 and 1 merged tokens in two buffer rows of 4 (the second image starts the
    second row); their runs in two token rows, and one placeholder too many at the end."""
    d = 3
    features = np.arange(2 * 4 * d, dtype=np.float32).reshape(2, 4, d) + 1
    valid = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    is_image = np.zeros((2, 10), bool)
    is_image[0, 1:3] = is_image[0, 6:9] = is_image[1, 4] = is_image[1, 9] = True
    embedded = -np.ones((2, 10, d), np.float32)
    got = np.asarray(merge_image_features(embedded, is_image, features, valid))
    want = embedded.copy()
    want[0, 1:3] = features[0, :2]
    want[0, 6:9] = features[1, :3]
    want[1, 4] = features[1, 3]
    want[1, 9] = 0  # beyond the buffer's six image tokens
    np.testing.assert_array_equal(got, want)


def test_k3_counts_and_released_config():
    cfg = preset("k3")
    counts = count_params(cfg)
    assert counts["vision_tower"] == 401_214_464
    assert counts["vision_projector"] == 46_144_512
    assert counts["vision"] == 401_214_464 + 46_144_512
    assert count_params(preset("tiny"))["vision"] == 0
    abstract = nnx.eval_shape(lambda: VisionEncoder(cfg.vision, cfg.d_model, scan_layers=True,
                                                    rngs=nnx.Rngs(0)))

    def size(module):
        return sum(p.size for p in jax.tree.leaves(nnx.state(module, nnx.Param)))

    assert size(abstract.tower) == 401_214_464 and size(abstract.projector) == 46_144_512
    # The released vision_config, which has no q/k/v width: 12 heads of 1536 / 12 = 128.
    released = released_k3_json()
    assert "qkv_hidden_size" not in released["vision_config"]
    vision = ModelConfig.from_hf_config(released["text_config"], released["vision_config"]).vision
    assert vision == cfg.vision and vision.qkv_width == DEFAULT_QKV_WIDTH
    for key, value in (("qkv_hidden_size", 1000), ("merge_kernel_size", [3, 3]),
                       ("text_hidden_size", 4096)):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_hf_config(released["text_config"],
                                       dict(released["vision_config"], **{key: value}))


# ----------------------------------------------------------------------------------------------
# Images in the hybrid.

IMAGE_ID = TINY.image_token_id


def hybrid_config(**overrides):
    cfg = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,), **overrides)
    return dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"))


@pytest.fixture(scope="module")
def hybrid():
    return HybridLM(hybrid_config(vision=TINY), rngs=nnx.Rngs(0))


def document(seed, grid, before=3, after=4):
    """Text, an image's placeholder run, text: tokens [n] and the image."""
    text = np.random.default_rng(seed).integers(0, 256, size=before + after)
    run = np.full(num_image_tokens(grid[0] * PATCH, grid[1] * PATCH, PATCH), IMAGE_ID)
    return np.concatenate([text[:before], run, text[before:]]).astype(np.int32), image(seed, grid)


@pytest.fixture(scope="module")
def two_documents(hybrid):
    """Documents A (a 2x4 image) and B (a 4x4 image) packed in token row 0 and vision row 0, and
    the same documents run separately: A in row 0, B in row 1 of tokens and images. Returns the
    inputs and logits of both layouts."""
    (a, image_a), (b, image_b) = document(1, (2, 4)), document(2, (4, 4))
    length, slots = 24, 24
    packed_tokens = np.zeros((2, length), np.int32)
    packed_tokens[0, :len(a) + len(b)] = np.concatenate([a, b])
    packed_segments = np.zeros((2, length), np.int32)
    packed_segments[0, :len(a)], packed_segments[0, len(a):len(a) + len(b)] = 1, 2
    packed_segments[1] = 1
    separate_tokens = np.zeros((2, length), np.int32)
    separate_tokens[0, :len(a)], separate_tokens[1, :len(b)] = a, b
    separate_segments = np.ones((2, length), np.int32)
    packed_images = pack([image_a, image_b], slots=slots)
    assert packed_images.segment_ids[1].max() == 0  # both images in vision row 0
    separate_images = pack([image_a, image_b], slots=16)  # one row each
    separate_images = VisionBatch(*(np.pad(x, [(0, 0), (0, 8)] + [(0, 0)] * (x.ndim - 2))
                                    for x in dataclasses.astuple(separate_images)))
    packed = (packed_tokens, packed_segments, packed_images)
    separate = (separate_tokens, separate_segments, separate_images)
    return dict(lengths=(len(a), len(b)), packed=packed, separate=separate,
                packed_logits=lm_forward(hybrid, *packed),
                separate_logits=lm_forward(hybrid, *separate))


@pytest.mark.slow
def test_packed_documents_with_images_equal_separate_runs(hybrid, two_documents):
    length_a, length_b = two_documents["lengths"]
    packed, separate = two_documents["packed_logits"], two_documents["separate_logits"]
    np.testing.assert_allclose(packed[0, :length_a], separate[0, :length_a], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, length_a:length_a + length_b], separate[1, :length_b],
                               rtol=1e-5, atol=1e-5)
    # The images are seen: other pixels change the logits from the first placeholder on only.
    tokens, segments, images = two_documents["separate"]
    other = lm_forward(hybrid, tokens, segments,
                       dataclasses.replace(images, pixels=images.pixels[::-1] * 0.5))
    np.testing.assert_array_equal(other[:, :3], separate[:, :3])
    assert np.abs(other[0, 3:length_a] - separate[0, 3:length_a]).max(axis=-1).all()


@pytest.mark.slow
def test_without_images_the_text_model_is_unchanged(hybrid):
    """A vision config adds the tower's parameters after the text model's, which stay those of
    the text-only config, and text-only logits stay bit for bit."""
    text_only = HybridLM(hybrid_config(), rngs=nnx.Rngs(0))
    text_state = nnx.to_pure_dict(nnx.state(text_only))
    state = nnx.to_pure_dict(nnx.state(hybrid))
    assert set(state) == set(text_state) | {"vision"}
    jax.tree.map(np.testing.assert_array_equal, {k: state[k] for k in text_state}, text_state)
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 24)).astype(np.int32)
    segments = np.ones_like(tokens)
    forward = jax.jit(lambda model, tokens, segments: model(tokens, segments))
    np.testing.assert_array_equal(forward(hybrid, tokens, segments),
                                  forward(text_only, tokens, segments))
    with pytest.raises(ValueError, match="without a vision tower"):
        text_only(tokens, segments, pack([image(0, (2, 2))], slots=8))


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs the eight virtual CPU devices")
def test_sharded_equals_unsharded(hybrid, two_documents):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_module(nnx.clone(hybrid), mesh)
    assert sharded.vision.projector.w_in.kernel.sharding.spec == P("fsdp", "tensor")
    tokens, segments, images = two_documents["packed"]
    put = lambda x: jax.device_put(x, batch_sharding(mesh, x.shape))  # noqa: E731
    with jax.set_mesh(mesh):
        logits = lm_forward(sharded, put(tokens), put(segments), jax.tree.map(put, images))
    np.testing.assert_allclose(logits, two_documents["packed_logits"], rtol=1e-5, atol=1e-5)
