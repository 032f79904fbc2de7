"""The vision tower's attention: bidirectional within each image through the decoder's paths
(`models.attention.document_attention` with causal=False): the dense mask, or cuDNN's packed
layout on Hopper. On a CPU: the choice of path and its refusals, the packed path emulated (what
cuDNN's packed layout receives, attended without the causal part) against the dense mask, and the
lowering for CUDA; on a GPU: cuDNN's packed layout against the dense mask in bfloat16.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused

from models import attention
from models.attention import document_segments
from models.vision import VisionConfig, VisionTower, pack_images
from kda.common import document_index
from tests.models.test_attention import (  # noqa: F401 (cuda_trace: a fixture)
    cuda_trace, emulated_packed_cudnn, relative_l2)

PATCH = 2
# Heads of 8: a head size cuDNN takes (a multiple of 8), so the lowering test needs no padding.
TINY = VisionConfig(patch_size=PATCH, width=16, num_layers=1, num_heads=2, head_dim=8,
                    mlp_hidden=32, pos_table=(8, 8))
# Patch grids of a buffer of 2 rows of 48 slots: row 0 holds three images and padding (4 runs),
# row 1 one image and padding (2 runs).
GRIDS = [(4, 4), (2, 6), (4, 2), (6, 6)]
ROWS, SLOTS = 2, 48


def packed_buffer(grids=GRIDS, rows=ROWS, slots=SLOTS, seed=0):
    rng = np.random.default_rng(seed)
    images = [rng.normal(size=(h * PATCH, w * PATCH, 3)).astype(np.float32) for h, w in grids]
    return pack_images(images, patch_size=PATCH, num_rows=rows, max_patches=slots)


def tower(dtype=jnp.float32, **fields) -> VisionTower:
    return VisionTower(dataclasses.replace(TINY, **fields), dtype=dtype, rngs=nnx.Rngs(0))


@pytest.fixture
def packed_calls(monkeypatch):
    """The packed path on this CPU: device checks off, cuDNN emulated
    (`emulated_packed_cudnn` with the padding mask); the list of the emulator's runs."""
    calls = []
    monkeypatch.setattr(attention, "_require_packed_cudnn", lambda q: None)
    monkeypatch.setattr(cudnn_fused, "dot_product_attention",
                        emulated_packed_cudnn(calls, cudnn_fused.MaskType.PADDING))
    return calls


def features_and_grads(model: VisionTower, batch):
    """(features [R, P, D], gradients of sum(features * fixed random) over the parameters), the
    features zeroed on padding. Not jitted: a cached trace would keep a monkeypatched cuDNN."""
    weights = jax.random.normal(jax.random.key(3), (*batch.segment_ids.shape, model.cfg.width))
    on_images = (batch.segment_ids != 0)[..., None]

    def loss(model):
        features = jnp.where(on_images, model(batch), 0).astype(jnp.float32)
        return jnp.sum(features * weights), features

    grads, features = nnx.grad(loss, has_aux=True)(model)
    return features, jax.tree.leaves(nnx.state(grads))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(implementation="flash"), "VisionConfig.implementation='flash'"),
        (dict(max_segments=0), "VisionConfig.max_segments=0"),
        (dict(max_segments=True), "VisionConfig.max_segments=True"),
    ],
)
def test_config_refuses_an_unknown_implementation_or_max_segments(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **fields)


@pytest.mark.parametrize(
    "capability, dtype, implementation, expected",
    [
        ((9, 0), jnp.bfloat16, None, "cudnn_segments"),  # Hopper, 16-bit: the packed layout
        # "dense": the backend's dense-mask path (`attention.backend_implementation`: cuDNN on a
        # GPU, XLA on a CPU).
        ((9, 0), jnp.float32, None, "dense"),  # cuDNN's packed layout takes 16-bit inputs only
        ((8, 0), jnp.bfloat16, None, "dense"),  # pre-Hopper
        (None, jnp.bfloat16, None, "dense"),  # no CUDA device
        ((9, 0), jnp.bfloat16, "xla", "xla"),  # a configured path wins
    ],
)
def test_default_is_the_packed_layout_where_it_can_run(monkeypatch, capability, dtype,
                                                       implementation, expected):
    monkeypatch.setattr(attention, "_cuda_compute_capability", lambda: capability)
    monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91000)
    model = tower(dtype, implementation=implementation)
    if expected == "dense":
        expected = attention.backend_implementation(dtype)
    assert [block.implementation for block in model.blocks] == [expected] * TINY.num_layers


def test_the_default_sizes_the_packed_check_by_the_head(monkeypatch):
    monkeypatch.setattr(attention, "_cuda_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cudnn_fused, "check_cudnn_version", lambda: 91000)
    dense = attention.backend_implementation(jnp.bfloat16)
    for head_dim, expected in ((8, "cudnn_segments"), (12, dense), (264, dense)):
        model = tower(jnp.bfloat16, head_dim=head_dim)
        assert model.blocks[0].implementation == expected, head_dim


@pytest.mark.parametrize(
    "dtype, message",
    [
        pytest.param(jnp.bfloat16, "an NVIDIA GPU of compute capability 9.0",
                     marks=pytest.mark.skipif(jax.default_backend() == "gpu",
                                              reason="a CPU's refusal")),
        (jnp.float32, "bfloat16 or float16"),
    ],
)
def test_packed_layout_is_refused_where_cudnn_cannot_run_it(dtype, message):
    model = tower(dtype, implementation="cudnn_segments")
    with pytest.raises(ValueError, match=f"implementation='cudnn_segments' needs {message}"):
        model(packed_buffer())


@pytest.mark.slow
@pytest.mark.parametrize("max_segments, packed_runs", [(4, True), (3, False)])
def test_emulated_packed_layout_equals_the_dense_mask(packed_calls, max_segments, packed_runs):
    # Row 0 holds 4 runs (3 images and padding): M = 4 fits, M = 3 takes the fallback.
    batch = packed_buffer()
    dense = features_and_grads(tower(), batch)
    packed = features_and_grads(tower(implementation="cudnn_segments",
                                      max_segments=max_segments), batch)
    np.testing.assert_allclose(packed[0], dense[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(packed[1], dense[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # nnx.grad runs the forward once; the packed branch ran in it only when every row fit.
    assert bool(packed_calls) == packed_runs
    # The images change the answer: attention across the whole row differs.
    one_image = dataclasses.replace(batch, segment_ids=jnp.where(batch.segment_ids != 0, 1, 0))
    joined = features_and_grads(tower(), one_image)[0]
    assert not np.allclose(joined, dense[0], atol=1e-3)


def test_packed_layout_lowers_to_padding_mask_cudnn_calls_for_cuda(cuda_trace):  # noqa: F811
    model = tower(jnp.bfloat16, implementation="cudnn_segments", max_segments=4)
    batch = packed_buffer()

    def loss(model):
        return jnp.sum(model(batch).astype(jnp.float32))

    hlo = jax.jit(nnx.grad(loss)).trace(model).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call @__cudnn$fmha" in line]
    packed = [line for line in calls if "max_seg_per_batch\\22: 4" in line]
    # One forward and one backward, both packed: the fallback is plain JAX, no cuDNN call.
    assert len(calls) == 2 and len(packed) == 2
    for line in packed:
        assert "PADDING" in line and "CAUSAL" not in line  # bidirectional within each image
        assert "fmhaSoftmax" in line  # no bias: the images are in the offsets


# The K3 tower's heads (12 of 128, width 1024) over a buffer of 2 rows of 4096 patch slots:
# row 0 holds a 448 x 448 (32 x 32 patches) and an 896 x 672 (64 x 48) image, full; row 1 a
# 224 x 224 (16 x 16) and a 1344 x 448 (96 x 32) image and 768 slots of padding.
GPU_TOWER = VisionConfig(num_layers=2, max_segments=8)
GPU_GRIDS = [(32, 32), (64, 48), (16, 16), (96, 32)]


def coloured_image(seed: int, h: int, w: int) -> np.ndarray:
    """[14 h, 14 w, 3]: a random colour of [-1, 1]^3 and a little noise. Images of one colour
    each, so that attention across images changes the features: i.i.d. noise images look alike
    to a random tower (joined into one run, two-block K3-width towers' features moved by about
    4% on a small buffer of noise images, by about 40% on one of these)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(-1, 1, 3) + 0.25 * rng.normal(size=(14 * h, 14 * w, 3))).astype(
        np.float32)


@pytest.mark.gpu
def test_packed_cudnn_equals_the_dense_mask_on_the_gpu():
    batch = pack_images([coloured_image(i, h, w) for i, (h, w) in enumerate(GPU_GRIDS)],
                        patch_size=14, num_rows=2, max_patches=4096)
    assert bool(jnp.all(document_segments(document_index(jnp.asarray(batch.segment_ids)),
                                          GPU_TOWER.max_segments).fits))  # no fallback
    run = jax.jit(features_and_grads)

    def tower_with(implementation):  # bf16 compute: only the attention path differs
        cfg = dataclasses.replace(GPU_TOWER, implementation=implementation)
        return VisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

    results = {implementation: run(tower_with(implementation), batch)
               for implementation in ("cudnn_segments", "cudnn", "xla")}
    assert VisionTower(GPU_TOWER, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).blocks[0].implementation \
        == "cudnn_segments"  # Hopper's default
    packed = results["cudnn_segments"]
    for reference in (results["cudnn"], results["xla"]):  # the dense mask, by cuDNN and XLA
        assert relative_l2(packed[0], reference[0]) < 1e-2
        for got, want in zip(packed[1], reference[1]):
            assert relative_l2(got, want) < 2e-2
    # The images change the answer: attention across each whole row differs.
    joined = dataclasses.replace(batch, segment_ids=np.where(batch.segment_ids != 0, 1, 0))
    assert relative_l2(run(tower_with("xla"), joined)[0], results["xla"][0]) > 0.1
