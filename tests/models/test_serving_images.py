"""The serving engine with images in the prompts: each request gets the tokens `generate` gives it
with its images, when prefill chunks cut through an image's placeholder run and mixed with
text-only requests; kept prefixes are shared only between requests whose images agree; other
images and placements compile nothing new; bad images are refused naming the field."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models.config import preset
from models.generate import Sampling, generate
from models.lm import HybridLM
from models.serving import Engine, Request, compiled_programs
from models.vision import VisionConfig, pack_images
from train.tokenizer import BOS_ID, IMAGE_END_ID, IMAGE_PAD_ID, IMAGE_START_ID

PATCH = 4
TOWER = VisionConfig(patch_size=PATCH, width=16, num_layers=1, num_heads=2, head_dim=8,
                     mlp_hidden=32, pos_table=(8, 8), image_token_id=IMAGE_PAD_ID)
NEW_TOKENS = 4


def image_run(merged_tokens: int) -> list[int]:
    return [IMAGE_START_ID, *[IMAGE_PAD_ID] * merged_tokens, IMAGE_END_ID]


def pixels(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (height, width, 3)).astype(np.float32)


# 15 tokens: a 16 x 16 image (4 merged tokens, positions 6-9) and an 8 x 8 one (position 12).
# Prefill runs 14 tokens in chunks of 4, 4, 4 and 2: the cut at 8 goes through the first image's
# run, and kept prefixes end at 4 (before any image), 8 and 12 (the second image's run starts at
# 12).
PROMPT = (BOS_ID, *b"abcd", *image_run(4), *image_run(1), ord("?"))
TEXT = (BOS_ID, *b"Tell me a tale")
X1, X2, Y1, Y2 = pixels(0, 16, 16), pixels(1, 8, 8), pixels(2, 16, 16), pixels(5, 8, 8)
# A, B (first image differs), text, D (= A), E (second image differs).
REQUESTS = [Request(PROMPT, max_tokens=NEW_TOKENS, images=(X1, X2)),
            Request(PROMPT, max_tokens=NEW_TOKENS, images=(Y1, X2)),
            Request(TEXT, max_tokens=NEW_TOKENS),
            Request(PROMPT, max_tokens=NEW_TOKENS, images=(X1, X2)),
            Request(PROMPT, max_tokens=NEW_TOKENS, images=(X1, Y2))]


@pytest.fixture(scope="module")
def model():
    """KDA (its recurrent oracle) then Gated MLA, dense FFNs, and a one-block tower."""
    cfg = preset("tiny", num_layers=2, kda_layers=(1,), full_attn_layers=(2,), first_k_dense=2,
                 vision=TOWER)
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"),
                              mla=dataclasses.replace(cfg.mla, cache_pages_per_block=2))
    return HybridLM(cfg, rngs=nnx.Rngs(0))


def make_engine(model) -> Engine:
    """3 slots, pages of 4 tokens, prefill chunks of up to 4, images of up to 16 patches."""
    return Engine(model, slots=3, num_pages=40, page_size=4, max_seq_len=24,
                  prefill_chunk_tokens=4, prefix_sharing=True, max_image_patches=16)


@pytest.fixture(scope="module")
def served(model):
    """(programs before, engine, completions of REQUESTS, programs after)."""
    jax.clear_caches()  # count this engine's programs alone, whatever ran before in the process
    before = compiled_programs()
    engine = make_engine(model)
    completions = engine.run(REQUESTS)
    return before, engine, completions, compiled_programs()


@pytest.fixture(scope="module")
def expected(model):
    """Greedy tokens of `generate` for A, B, the text prompt and E, with their images."""
    requests = [REQUESTS[i] for i in (0, 1, 2, 4)]
    images = pack_images([image for r in requests for image in r.images], patch_size=PATCH,
                         num_rows=6, max_patches=16)
    result = generate(model, np.array([r.prompt for r in requests]),
                      max_new_tokens=NEW_TOKENS, images=images)
    return [tuple(int(t) for t in row) for row in result.tokens]


@pytest.mark.slow
def test_requests_with_images_get_the_tokens_generate_gives_them(served, expected):
    _, _, completions, _ = served
    a, b, text, d, e = (done.tokens for done in completions)
    assert [a, b, text, e] == expected and d == a
    # The images matter: other pixels under the same placeholders give other tokens.
    assert len({a, b, e}) == 3


@pytest.mark.slow
def test_prefixes_are_shared_only_between_requests_with_the_same_images(served):
    _, engine, _, _ = served
    # D and E start from A's prefix of 12 tokens (keyed on X1, whose run begins in it; E's
    # second image begins at 12); B, whose first image differs, from A's 4 tokens before it.
    assert engine.stats.shared_tokens == 4 + 2 * 12
    assert engine.stats.prefill_tokens == 3 * (len(PROMPT) - 1) - 4 + 2 * 2


@pytest.mark.slow
def test_other_images_and_placements_compile_nothing_new(model, served):
    before, _, _, after = served
    # Text prefill of 2 buckets (4 and 2), image prefill and feature gathers of 2, one tower
    # program (two vision rows), decode, and the two prefix copies.
    assert after - before <= 2 + 2 + 2 + 1 + 1 + 2
    # A 8 x 16 image (2 merged tokens) at 2-3 and a 16 x 16 one at 8-11: chunks of 4 (image),
    # 4 (text), 4 (image), 2 (text); two vision rows again. Sampled, not greedy; and a shorter
    # text.
    prompt = (BOS_ID, *image_run(2), *b"ab", *image_run(4), *b"cd")
    engine = make_engine(model)
    engine.run([Request(prompt, Sampling(temperature=1.0), seed=3, max_tokens=3,
                        images=(pixels(6, 8, 16), pixels(7, 16, 16))),
                Request(TEXT[:7], max_tokens=2)])
    assert compiled_programs() == after


def test_bad_images_are_refused_naming_the_field(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=r"images\[1\]: image height=12 is invalid"):
        engine.submit(Request(PROMPT, images=(X1, pixels(0, 12, 8))))
    with pytest.raises(ValueError, match="holds 5 image placeholders .* give 4 merged"):
        engine.submit(Request(PROMPT, images=(X1,)))
    with pytest.raises(ValueError, match="holds 0 image placeholders .* give 1 merged"):
        engine.submit(Request(TEXT, images=(X2,)))
    with pytest.raises(ValueError, match=r"images\[0\] has 4 channels"):
        engine.submit(Request(PROMPT, images=(np.zeros((16, 16, 4)), X2)))
    with pytest.raises(ValueError, match=r"images\[0\] \(16 x 32\) has 32 patches"):
        engine.submit(Request(PROMPT[:11], images=(pixels(0, 16, 32),)))
    with pytest.raises(ValueError, match="ends with an image placeholder"):
        engine.submit(Request(PROMPT[:13], images=(X1, X2)))
    with pytest.raises(ValueError, match=r"images\[0\] must be \[H, W, C\]"):
        Request(PROMPT, images=(np.zeros((16, 16)),))
    assert not engine.has_work
