"""Generation with images in the prompt: the prompt's images go through the tower once, the merged
embeddings are prefilled (in chunks that may cut an image's run), and decoding goes on as for
text: the prefill's logits equal the full forward's with the images, and greedy decoding equals
its argmax at every step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import preset
from models.generate import generate
from models.lm import HybridLM
from models.paged_cache import PageAllocator
from models.prefill import prefill
from models.vision import VisionConfig, pack_images
from train.tokenizer import BOS_ID, IMAGE_END_ID, IMAGE_PAD_ID, IMAGE_START_ID

PATCH = 4
TOWER = VisionConfig(patch_size=PATCH, width=16, num_layers=1, num_heads=2, head_dim=8,
                     mlp_hidden=32, pos_table=(8, 8), image_token_id=IMAGE_PAD_ID)


def image_run(merged_tokens: int) -> list[int]:
    return [IMAGE_START_ID, *[IMAGE_PAD_ID] * merged_tokens, IMAGE_END_ID]


# Row 0: a 16 x 8 image (4 x 2 patches: 2 merged tokens); row 1: an 8 x 8 image (1) and an
# 8 x 16 one (2), text between and after. Packed into two vision rows of 12 slots: the first
# holds the first two images, so the rows of the buffer are not those of the prompts.
SIZES = ((16, 8), (8, 8), (8, 16))
PROMPTS = np.array([[BOS_ID, *image_run(2), *b"Which? "],
                    [BOS_ID, *image_run(1), ord("+"), *image_run(2), *b"So?"]], np.int32)
PIXELS = [np.random.default_rng(index).uniform(-1, 1, (h, w, 3)).astype(np.float32)
          for index, (h, w) in enumerate(SIZES)]
IMAGES = pack_images(PIXELS, patch_size=PATCH, num_rows=2, max_patches=12)


@pytest.fixture(scope="module")
def model():
    """KDA (its recurrent oracle: a quick compile) then Gated MLA reading two pages a block, dense
    FFNs, and a one-block tower."""
    cfg = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,), first_k_dense=2,
                 vision=TOWER)
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"),
                              mla=dataclasses.replace(cfg.mla, cache_pages_per_block=2))
    return HybridLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def decoded(model):
    """Greedy generation of 5 tokens after the prompts with their images, and the full forward's
    logits [B, T + 5, V] over prompt and generated tokens with those images and with the images
    zeroed (one compiled forward)."""
    result = generate(model, PROMPTS, max_new_tokens=5, page_size=4, images=IMAGES)
    sequence = jnp.concatenate([PROMPTS, jnp.asarray(result.tokens)], axis=1)
    forward = jax.jit(lambda model, tokens, images: model(tokens, images=images))
    zeroed = dataclasses.replace(IMAGES, pixels=np.zeros_like(IMAGES.pixels))
    return (result, np.asarray(forward(model, sequence, IMAGES)),
            np.asarray(forward(model, sequence, zeroed)))


def test_the_prompts_and_the_buffer_agree():
    assert PROMPTS.shape == (2, 12)
    assert list(IMAGES.segment_ids[0]) == [1] * 8 + [2] * 4
    assert list(IMAGES.segment_ids[1]) == [1] * 8 + [0] * 4


@pytest.mark.slow
def test_greedy_decode_with_images_is_argmax_of_full_forward(decoded):
    result, full, _ = decoded
    assert result.tokens.shape == (2, 5) and list(result.lengths) == [5, 5]
    # A generated token is text: the full forward would read a generated placeholder as an image.
    assert not (result.tokens == IMAGE_PAD_ID).any()
    # Token i was generated after prompt + tokens[:i]: the logits at position T - 1 + i.
    np.testing.assert_array_equal(result.tokens,
                                  full.argmax(axis=-1)[:, PROMPTS.shape[1] - 1 : -1])


@pytest.mark.slow
def test_chunked_prefill_with_images_equals_the_full_forward(model, decoded):
    _, full, without = decoded
    # The images matter, from each row's first placeholder on (position 2) and not before.
    np.testing.assert_array_equal(without[:, :2], full[:, :2])
    assert np.abs(without[:, 2:] - full[:, 2:]).min(axis=-1).max() > 1e-4
    # Chunks of 3 tokens, the first ending between row 0's two placeholders (generate's prefill
    # above is one chunk).
    allocator = PageAllocator.holding(2, PROMPTS.shape[1], page_size=4)
    logits, _ = prefill(model, PROMPTS, chunk_tokens=3, allocator=allocator, all_logits=True,
                        images=IMAGES)
    np.testing.assert_allclose(logits, full[:, : PROMPTS.shape[1]], rtol=2e-5, atol=2e-5)


def test_placeholders_must_match_the_images(model):
    short = PROMPTS.copy()
    short[1, 6] = ord("x")  # row 1's second run loses a placeholder
    with pytest.raises(ValueError, match="hold 4 image placeholders .* but images has 5 merged"):
        generate(model, short, max_new_tokens=1, images=IMAGES)
