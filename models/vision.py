"""Native-resolution vision: a MoonViT-style tower, the 2 x 2 patch merger, the projector, and
the merge of image features into the token embeddings (at full size, K3's MoonViT-V2).

    image [H, W, C] --patchify--> patches [h w, p p C] in merge-block order, (row, col) each
    images --pack_images--> VisionBatch: several images of any even grid per row of one buffer
    tower:     x = patches W_embed + bilinear(pos_table -> the image's grid)[row, col]
               x += Attn(RMSNorm(x))        2D RoPE on q, k; bidirectional within one image
               x += W_2 gelu_tanh(W_1 RMSNorm(x))                 (num_layers blocks)
               x = RMSNorm(x)
    merger:    [R, P, D] -> [R, P / 4, 4 D]   a reshape: each 2 x 2 block's patches are adjacent
    projector: RMSNorm(W_4 gelu(W_3 m))       -> [R, P / 4, d_model]
    merge_image_features: the k-th placeholder token of the token batch (row-major over [B, T])
               takes the k-th merged token of the buffer (row-major over [R, P / 4]), so the k-th
               image's placeholder run takes the k-th image's block.

The vision buffer (`VisionBatch`), R rows of P patch slots:
  pixels [R, P, p p C]   each patch's pixels in (y, x, channel) order (a Conv2d kernel
                         [D, C, p, p] is the patch embedding transposed to [p, p, C, D], flattened)
  segment_ids [R, P]     int32: 1, 2, ... for the images of a row (neighbours differ), 0 padding
  positions [R, P, 2]    int32: each patch's (row, col) in its image's patch grid, 0 on padding
An image is one run of equal non-zero ids, whole within one row, its h w patches (h and w even)
in merge-block order (2 x 2 blocks in raster order, each block's four patches in raster order),
starting at a slot that is a multiple of 4 (images packed back to back keep that: h w is one);
P is a multiple of 4. Images follow the order of their placeholder runs in the token batch.
Nothing but ids and positions tells the tower where images are: each image's grid (h, w) is its
largest (row, col) + 1, attention keeps to runs of one id, and the positional table is
interpolated per patch, so every shape is static whatever the images.

Attention within each image is `models.attention.document_attention` with causal=False, the
decoder's paths: a dense [R, 1, P, P] mask ("xla" on a CPU, "cudnn" on a GPU), or cuDNN's packed
layout ("cudnn_segments", Hopper), which skips the tiles between images; `VisionConfig`'s
implementation=None picks the packed layout where it can run (`default_implementation`).
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.norms import RMSNorm
from core.sharding import constrain, logical
from kda.common import document_index
from models.attention import (AttentionImplementation, _fan_in_init, default_implementation,
                              document_attention, is_positive_int)

# Patches merged into one token along each axis (2 x 2 pixel shuffle). The released configs'
# `merge_kernel_size` is [2, 2]; the buffer layout above depends on it.
MERGE = 2
MERGE_PATCHES = MERGE * MERGE
# What the released K3 config leaves out (`VisionConfig.from_hf_config`): its q/k/v width, 12
# heads of 128 (1024 / 12 is no head size), and the image placeholder id of the K3 tokenizer.
DEFAULT_QKV_WIDTH = 1536
K3_IMAGE_TOKEN_ID = 163605
# Tower activations [R, P, D]: rows over the batch axes; the patch axis is never split (the
# tower has no context-parallel attention).
ACTIVATION_AXES = ("batch", None, "embed")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower and projector; the defaults are K3's MoonViT-V2.

    Attributes:
      patch_size: p, pixels per patch side.
      in_channels: C, colour channels of the pixels.
      width: D, the tower's residual width.
      num_layers: transformer blocks.
      num_heads, head_dim: attention heads and their size (q/k/v width num_heads * head_dim, which
        need not be `width`); head_dim is a multiple of 4 (2D RoPE rotates pairs, alternating
        column and row).
      mlp_hidden: hidden width of each block's MLP.
      pos_table: (rows, cols) of the learned absolute position table, interpolated to each grid.
      rope_theta: base of the 2D RoPE frequencies theta^(-4 i / head_dim).
      norm_eps: epsilon of every RMSNorm of the tower and projector.
      image_token_id: the token id of an image placeholder (one per merged token); the decoder
        writes image features at these tokens (`merge_image_features`). Required inside a
        `ModelConfig`; a standalone tower does not need it.
      implementation: the tower's attention (`models.attention.document_attention`): "xla" or
        "cudnn" (a dense mask) or "cudnn_segments" (cuDNN's packed layout, Hopper and 16-bit
        compute only); None picks "cudnn_segments" where it can run, else the dense mask through
        cuDNN on a GPU for 16-bit compute and XLA otherwise (`default_implementation`).
      max_segments: with "cudnn_segments", the most runs of ids (images, and a row's trailing
        padding) a buffer row may hold, static; a batch with a fuller row takes the dense mask.
    """

    patch_size: int = 14
    in_channels: int = 3
    width: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    head_dim: int = 128
    mlp_hidden: int = 4096
    pos_table: tuple[int, int] = (64, 64)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    image_token_id: int | None = None
    implementation: AttentionImplementation | None = None
    max_segments: int = 16

    def __post_init__(self):
        object.__setattr__(self, "pos_table", tuple(self.pos_table))
        for name in ("patch_size", "in_channels", "width", "num_layers", "num_heads", "head_dim",
                     "mlp_hidden", "max_segments"):
            _require(is_positive_int(getattr(self, name)), name, getattr(self, name),
                     "a positive int")
        _require(self.head_dim % 4 == 0, "head_dim", self.head_dim,
                 "a multiple of 4 (2D RoPE rotates pairs of channels, alternating column and row)")
        _require(len(self.pos_table) == 2 and all(map(is_positive_int, self.pos_table)),
                 "pos_table", self.pos_table, "(rows, cols), two positive ints")
        _require(self.rope_theta > 1, "rope_theta", self.rope_theta, "a number above 1")
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "a positive number")
        _require(self.image_token_id is None or (isinstance(self.image_token_id, int)
                                                 and self.image_token_id >= 0),
                 "image_token_id", self.image_token_id, "None or a non-negative int")
        implementations = get_args(AttentionImplementation)
        _require(self.implementation in (None, *implementations), "implementation",
                 self.implementation, f"None or one of {implementations}")

    @property
    def qkv_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def patch_dim(self) -> int:
        """Numbers per patch: p * p * C."""
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def merged_width(self) -> int:
        """Width of one merged token: four patches' features side by side."""
        return MERGE_PATCHES * self.width

    @classmethod
    def from_hf_config(cls, vision_config: Mapping[str, Any], **overrides: Any) -> "VisionConfig":
        """The configuration of a released K3 `vision_config`, plus overrides.

        A missing `qkv_hidden_size` is `DEFAULT_QKV_WIDTH` (the released K3 config has none) and
        a missing `media_placeholder_token_id` is `K3_IMAGE_TOKEN_ID`. Settings this tower does
        not implement (another merge kernel, norm, projector or interpolation) raise ValueError.
        """
        supported = dict(merge_kernel_size=[MERGE, MERGE], norm_type="rmsnorm",
                         mm_projector_type="patchmergerv2", pos_emb_interpolation_mode="bilinear")
        for key, value in supported.items():
            got = vision_config.get(key, value)
            if (list(got) if isinstance(got, (list, tuple)) else got) != value:
                raise ValueError(f"vision_config[{key!r}]={got!r} is not supported: this tower "
                                 f"implements {value!r}")
        heads = vision_config["vt_num_attention_heads"]
        qkv = vision_config.get("qkv_hidden_size") or DEFAULT_QKV_WIDTH
        if qkv % heads:
            raise ValueError(f"vision_config['qkv_hidden_size']={qkv} is invalid: expected a "
                             f"multiple of vt_num_attention_heads={heads}")
        fields = dict(
            patch_size=vision_config["patch_size"],
            in_channels=vision_config.get("in_channels", 3),
            width=vision_config["vt_hidden_size"],
            num_layers=vision_config["vt_num_hidden_layers"],
            num_heads=heads,
            head_dim=qkv // heads,
            mlp_hidden=vision_config["vt_intermediate_size"],
            pos_table=(vision_config.get("init_pos_emb_height", 64),
                       vision_config.get("init_pos_emb_width", 64)),
            norm_eps=vision_config.get("projector_ln_eps", 1e-5),
            image_token_id=vision_config.get("media_placeholder_token_id", K3_IMAGE_TOKEN_ID),
        )
        fields.update(overrides)
        return cls(**fields)


def _require(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"VisionConfig.{field}={value!r} is invalid: expected {expected}.")


def count_vision_params(cfg: VisionConfig, d_model: int) -> dict[str, int]:
    """Parameters of the tower and of the projector into a `d_model`-wide decoder."""
    d, qkv = cfg.width, cfg.qkv_width
    block = 2 * d + 3 * d * qkv + qkv * d + 2 * d * cfg.mlp_hidden  # norms, qkv, out, MLP
    rows, cols = cfg.pos_table
    tower = cfg.patch_dim * d + rows * cols * d + cfg.num_layers * block + d  # + final norm
    merged = cfg.merged_width
    return dict(tower=tower, projector=merged * merged + merged * d_model + d_model)


# ----------------------------------------------------------------------------------------------
# Host side: patches, their order, packing.


def patch_grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """(h, w) patches of an image of height x width pixels; both must be even (whole 2 x 2
    blocks), so height and width must be positive multiples of 2 * patch_size."""
    for name, size in (("height", height), ("width", width)):
        if not (is_positive_int(size) and size % (MERGE * patch_size) == 0):
            raise ValueError(
                f"image {name}={size!r} is invalid: expected a positive multiple of "
                f"{MERGE} * patch_size = {MERGE * patch_size} pixels (whole {MERGE} x {MERGE} "
                f"blocks of patches); resize the image first")
    return height // patch_size, width // patch_size


def num_image_tokens(height: int, width: int, patch_size: int) -> int:
    """Merged tokens of an image, (h / 2)(w / 2): the length of its placeholder run."""
    h, w = patch_grid(height, width, patch_size)
    return (h // MERGE) * (w // MERGE)


def merge_block_order(array: np.ndarray, h: int, w: int) -> np.ndarray:
    """[h, w, ...] in raster order -> [h w, ...] in merge-block order: the 2 x 2 blocks in raster
    order, each block's four entries in raster order (top-left, top-right, bottom-left,
    bottom-right)."""
    rest = array.shape[2:]
    blocks = array.reshape(h // MERGE, MERGE, w // MERGE, MERGE, *rest)
    return blocks.swapaxes(1, 2).reshape(h * w, *rest)


def patch_positions(h: int, w: int) -> np.ndarray:
    """(row, col) of the patches of an h x w grid in merge-block order: int32 [h w, 2]."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return merge_block_order(np.stack([rows, cols], -1).astype(np.int32), h, w)


def patchify(image, patch_size: int):
    """image [H, W, C] (numpy or jax) -> (patches [h w, p p C], positions int32 [h w, 2]).

    Patches in merge-block order (`merge_block_order`), each patch's pixels in (y, x, channel)
    order; positions are each patch's (row, col) in the grid (`patch_positions`).
    """
    if image.ndim != 3:
        raise ValueError(f"image must be [H, W, C], got shape {image.shape}")
    height, width, channels = image.shape
    h, w = patch_grid(height, width, patch_size)
    grid = image.reshape(h, patch_size, w, patch_size, channels).swapaxes(1, 2)  # [h, w, p, p, C]
    patches = merge_block_order(grid, h, w).reshape(h * w, patch_size * patch_size * channels)
    return patches, patch_positions(h, w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """The packed vision buffer (layout in the module docstring).

    pixels: [R, P, p p C] float; segment_ids: [R, P] int32, an image's id in its row, 0 padding;
    positions: [R, P, 2] int32, (row, col) in the image's patch grid.
    """

    pixels: jax.Array
    segment_ids: jax.Array
    positions: jax.Array


def pack_images(images: Sequence[np.ndarray], *, patch_size: int, num_rows: int,
                max_patches: int, channels: int = 3, dtype=np.float32) -> VisionBatch:
    """Packs images [H, W, channels] (each H and W a multiple of 2 * patch_size) into a
    `VisionBatch` of num_rows x max_patches slots, in order: each row takes images back to back
    until the next one does not fit, then the next row does. Row r's images get ids 1, 2, ...;
    numpy arrays. No images: an all-padding buffer (a batch of text only, same shapes)."""
    if not (is_positive_int(max_patches) and max_patches % MERGE_PATCHES == 0):
        raise ValueError(f"max_patches={max_patches!r} is invalid: expected a positive multiple "
                         f"of {MERGE_PATCHES} (whole merged tokens)")
    if not is_positive_int(num_rows):
        raise ValueError(f"num_rows={num_rows!r} is invalid: expected a positive int")
    pixels = np.zeros((num_rows, max_patches, patch_size * patch_size * channels), dtype)
    segment_ids = np.zeros((num_rows, max_patches), np.int32)
    positions = np.zeros((num_rows, max_patches, 2), np.int32)
    row, used, image_id = 0, 0, 0
    for index, image in enumerate(images):
        if np.ndim(image) != 3 or np.shape(image)[-1] != channels:
            raise ValueError(f"images[{index}] must be [H, W, channels={channels}], got shape "
                             f"{np.shape(image)}")
        patches, coords = patchify(np.asarray(image), patch_size)
        count = len(patches)
        if count > max_patches:
            raise ValueError(f"images[{index}] has {count} patches, more than max_patches="
                             f"{max_patches}; resize it to a smaller patch budget")
        if used + count > max_patches:
            row, used, image_id = row + 1, 0, 0
        if row == num_rows:
            raise ValueError(f"images[{index}:] do not fit in num_rows={num_rows} rows of "
                             f"{max_patches} patches; pack them in more rows")
        image_id += 1
        pixels[row, used:used + count] = patches
        segment_ids[row, used:used + count] = image_id
        positions[row, used:used + count] = coords
        used += count
    return VisionBatch(pixels, segment_ids, positions)


# ----------------------------------------------------------------------------------------------
# Pure functions of the tower.


def image_grid_sizes(segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Each patch's image grid (h, w): its image's largest (row, col) + 1.

    segment_ids [R, P] int, positions [R, P, 2] int -> [R, P, 2] int32. An image is a run of
    equal ids (`kda.common.document_index`), so padding runs get a grid too (unused).
    """
    rows, slots = segment_ids.shape
    run = document_index(segment_ids) + slots * jnp.arange(rows, dtype=jnp.int32)[:, None]
    largest = jax.ops.segment_max(positions.reshape(rows * slots, 2), run.reshape(-1),
                                  num_segments=rows * slots)
    return (largest[run] + 1).astype(jnp.int32)


def bilinear_source(index: jax.Array, size: jax.Array, table_size: int):
    """Where output sample `index` of `size` samples reads a table axis of `table_size` entries:
    half-pixel centres, no antialiasing (PyTorch's `interpolate(mode="bilinear")`). Returns the
    lower entry, the upper entry and the upper one's weight."""
    source = (index.astype(jnp.float32) + 0.5) * (table_size / size.astype(jnp.float32)) - 0.5
    source = jnp.clip(source, 0.0, table_size - 1)
    lower = jnp.floor(source).astype(jnp.int32)
    return lower, jnp.minimum(lower + 1, table_size - 1), source - lower


def interpolated_positions(table: jax.Array, positions: jax.Array, grid: jax.Array) -> jax.Array:
    """The table [Ht, Wt, D] resized bilinearly to each patch's grid (h, w), read at its (row,
    col): positions, grid int [..., 2] -> [..., D] in table's dtype. Equal to resizing the whole
    table to h x w and indexing it, without building one table per image size."""
    table_rows, table_cols, width = table.shape
    y0, y1, wy = bilinear_source(positions[..., 0], grid[..., 0], table_rows)
    x0, x1, wx = bilinear_source(positions[..., 1], grid[..., 1], table_cols)
    flat = table.reshape(table_rows * table_cols, width).astype(jnp.float32)

    def read(y, x):
        return flat[y * table_cols + x]

    wy, wx = wy[..., None], wx[..., None]
    top = read(y0, x0) * (1 - wx) + read(y0, x1) * wx
    bottom = read(y1, x0) * (1 - wx) + read(y1, x1) * wx
    return (top * (1 - wy) + bottom * wy).astype(table.dtype)


def rope_2d_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotation angles of 2D RoPE: positions int [..., 2] (row, col) -> float32 [..., K / 2].

    Channel pair j = (x[2j], x[2j+1]) turns by col * f_i for j = 2i and by row * f_i for
    j = 2i + 1, with f_i = theta^(-4 i / K), i < K / 4: pairs alternate column and row.
    """
    freqs = theta ** (-4.0 * jnp.arange(head_dim // 4, dtype=jnp.float32) / head_dim)
    rows = positions[..., 0:1].astype(jnp.float32) * freqs
    cols = positions[..., 1:2].astype(jnp.float32) * freqs
    return jnp.stack([cols, rows], axis=-1).reshape(*positions.shape[:-1], head_dim // 2)


def rope_2d(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotates each channel pair (x[2j], x[2j+1]) of x [..., T, H, K] by angles [..., T, K / 2]
    (`rope_2d_angles`), as the complex product (x[2j] + i x[2j+1]) e^(i angle_j); float32
    arithmetic, x's dtype out."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # [..., T, 1, K/2]
    real, imag = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return turned.reshape(x.shape).astype(x.dtype)


def merge_patches(x: jax.Array) -> jax.Array:
    """The 2 x 2 pixel shuffle of patches in merge-block order: [R, P, D] -> [R, P / 4, 4 D],
    each merged token its block's four patches side by side (top-left, top-right, bottom-left,
    bottom-right)."""
    rows, slots, width = x.shape
    return x.reshape(rows, slots // MERGE_PATCHES, MERGE_PATCHES * width)


def merged_valid(segment_ids: jax.Array) -> jax.Array:
    """bool [R, P / 4]: the merged tokens that hold an image block (not padding)."""
    return segment_ids[:, ::MERGE_PATCHES] != 0


def merge_image_features(embedded: jax.Array, is_image: jax.Array, features: jax.Array,
                         valid: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] with the image placeholders replaced by image features.

    is_image: bool [B, T], the placeholder tokens; features [R, M, D] and valid bool [R, M]: the
    merged tokens of the vision buffer and which of them hold an image block. The k-th
    placeholder, counting row-major over [B, T], takes the k-th valid feature, counting row-major
    over [R, M] (cumsum, gather, where). Placeholders beyond the valid features get zeros;
    features beyond the placeholders are unused.
    """
    width = features.shape[-1]
    flat, valid = features.reshape(-1, width), valid.reshape(-1)
    filled = jnp.cumsum(valid, dtype=jnp.int32)  # valid features up to and including each
    k = (jnp.cumsum(is_image.reshape(-1), dtype=jnp.int32) - 1).reshape(is_image.shape)
    source = jnp.searchsorted(filled, k + 1, side="left")  # the (k+1)-th valid feature
    taken = jnp.take(flat, source, axis=0, mode="fill", fill_value=0)
    return jnp.where(is_image[..., None], taken.astype(embedded.dtype), embedded)


# ----------------------------------------------------------------------------------------------
# Modules.


class VisionBlock(nnx.Module):
    """Pre-norm block: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)); no biases.

    Parameters (logical axes): qkv [D, 3, H, K] ("embed", None, "heads", "kv"); out [H, K, D]
    ("heads", "kv", "embed"); mlp_in [D, F] ("embed", "mlp"); mlp_out [F, D] ("mlp", "embed");
    two RMSNorm gains [D].
    """

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype, self.head_dim, self.max_segments = dtype, cfg.head_dim, cfg.max_segments
        self.implementation = cfg.implementation or default_implementation(dtype, cfg.head_dim)
        d, heads = cfg.width, cfg.num_heads
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=cfg.norm_eps, axis_name="embed", dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = RMSNorm(d, **norm)
        qkv_axes = ("embed", None, "heads", "kv")
        self.qkv = nnx.Einsum("rpd,dchk->rpchk", (d, 3, heads, cfg.head_dim),
                              kernel_init=_fan_in_init(0, (1, 2, 3), qkv_axes), **common)
        self.out = nnx.Einsum("rphk,hkd->rpd", (heads, cfg.head_dim, d),
                              kernel_init=_fan_in_init((0, 1), 2, ("heads", "kv", "embed")),
                              **common)
        self.mlp_norm = RMSNorm(d, **norm)
        linear_init = nnx.initializers.lecun_normal()
        self.mlp_in = nnx.Linear(d, cfg.mlp_hidden, use_bias=False,
                                 kernel_init=logical(linear_init, ("embed", "mlp")), **common)
        self.mlp_out = nnx.Linear(cfg.mlp_hidden, d, use_bias=False,
                                  kernel_init=logical(linear_init, ("mlp", "embed")), **common)

    def __call__(self, x: jax.Array, angles: jax.Array, images: jax.Array) -> jax.Array:
        """x [R, P, D], RoPE angles [R, P, K / 2], images int [R, P] (each patch's run of ids,
        `kda.common.document_index`) -> [R, P, D]. A patch attends to every patch of its own
        run, in both directions; padding runs only to themselves."""
        q, k, v = jnp.moveaxis(self.qkv(self.attn_norm(x)), 2, 0)  # each [R, P, H, K]
        o = document_attention(
            rope_2d(q, angles), rope_2d(k, angles), v, scale=self.head_dim**-0.5, causal=False,
            segment_ids=images, implementation=self.implementation,
            max_segments=self.max_segments)
        x = x + self.out(o)
        hidden = jax.nn.gelu(self.mlp_in(self.mlp_norm(x)), approximate=True)
        return constrain(x + self.mlp_out(hidden), ACTIVATION_AXES)


def _apply_block(graphdef, state, x, angles, images, remat):
    """One block (merged from graphdef and state) on x, recomputed in the backward pass as the
    checkpoint policy `remat` says (None: stored), one block per checkpoint as in the decoder."""

    def call(state, x):
        return nnx.merge(graphdef, state)(x, angles, images)

    if remat is not None:
        call = jax.checkpoint(call, policy=remat)
    return call(state, x)


class VisionTower(nnx.Module):
    """Patch embedding, interpolated absolute positions, `num_layers` blocks with 2D RoPE, final
    RMSNorm. `tower(batch: VisionBatch)` -> features [R, P, D] in `dtype`.

    scan_layers: the blocks stacked on a leading axis and applied with `lax.scan` (one compiled
    body, as `ModelConfig.scan_layers` does for the decoder).
    Parameters (logical axes): patch_embed [p p C, D] (None, "embed"); pos_table [Ht, Wt, D]
    (None, None, "embed"); blocks (`VisionBlock`); final_norm [D].
    """

    def __init__(self, cfg: VisionConfig, *, scan_layers: bool = False, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.scan_layers, self.dtype = cfg, scan_layers, dtype
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.patch_embed = nnx.Linear(
            cfg.patch_dim, cfg.width, use_bias=False,
            kernel_init=logical(nnx.initializers.lecun_normal(), (None, "embed")), **common)
        init = logical(nnx.initializers.normal(0.02), (None, None, "embed"))
        self.pos_table = nnx.Param(init(rngs.params(), (*cfg.pos_table, cfg.width), param_dtype))
        if scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def build(rngs):
                return VisionBlock(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

            self.blocks = build(rngs)
        else:
            self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype, param_dtype=param_dtype,
                                                rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.width, eps=cfg.norm_eps, axis_name="embed", dtype=dtype,
                                  param_dtype=param_dtype)

    def __call__(self, batch: VisionBatch, *, remat=None) -> jax.Array:
        """batch: pixels [R, P, p p C], segment_ids [R, P], positions [R, P, 2] -> [R, P, D].

        remat: a checkpoint policy (`models.lm.REMAT`) for each block, or None. ("offload" names
        no tower activation, so the tower recomputes as under "full".)
        """
        check_vision_batch(batch, self.cfg)
        grid = image_grid_sizes(batch.segment_ids, batch.positions)
        x = self.patch_embed(batch.pixels.astype(self.dtype))
        x = x + interpolated_positions(self.pos_table[...], batch.positions, grid).astype(x.dtype)
        x = constrain(x, ACTIVATION_AXES)
        angles = rope_2d_angles(batch.positions, self.cfg.head_dim, self.cfg.rope_theta)
        images = document_index(batch.segment_ids)
        if self.scan_layers:
            graphdef, state = nnx.split(self.blocks)

            def body(x, state):
                return _apply_block(graphdef, state, x, angles, images, remat), None

            x, _ = jax.lax.scan(body, x, state)
        else:
            for block in self.blocks:
                x = _apply_block(*nnx.split(block), x, angles, images, remat)
        return self.final_norm(x)


class VisionProjector(nnx.Module):
    """Merged tokens [..., 4 D] -> RMSNorm(W_out gelu(W_in m)) [..., d_model]; no biases, exact
    (erf) GELU. Parameters: w_in [4D, 4D] ("embed", "mlp"), w_out [4D, d_model] ("mlp", "embed"),
    norm gain [d_model]."""

    def __init__(self, cfg: VisionConfig, d_model: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        linear_init = nnx.initializers.lecun_normal()
        merged = cfg.merged_width
        self.w_in = nnx.Linear(merged, merged, kernel_init=logical(linear_init, ("embed", "mlp")),
                               **common)
        self.w_out = nnx.Linear(merged, d_model,
                                kernel_init=logical(linear_init, ("mlp", "embed")), **common)
        self.norm = RMSNorm(d_model, eps=cfg.norm_eps, axis_name="embed", dtype=dtype,
                            param_dtype=param_dtype)

    def __call__(self, merged: jax.Array) -> jax.Array:
        return self.norm(self.w_out(jax.nn.gelu(self.w_in(merged), approximate=False)))


class VisionEncoder(nnx.Module):
    """Tower, 2 x 2 merger and projector: `encoder(batch)` -> (features [R, P / 4, d_model] in
    `dtype`, valid bool [R, P / 4]), ready for `merge_image_features`."""

    def __init__(self, cfg: VisionConfig, d_model: int, *, scan_layers: bool = False,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        dtypes = dict(dtype=dtype, param_dtype=param_dtype)
        self.tower = VisionTower(cfg, scan_layers=scan_layers, rngs=rngs, **dtypes)
        self.projector = VisionProjector(cfg, d_model, rngs=rngs, **dtypes)

    def __call__(self, batch: VisionBatch, *, remat=None) -> tuple[jax.Array, jax.Array]:
        features = self.projector(merge_patches(self.tower(batch, remat=remat)))
        return features, merged_valid(batch.segment_ids)


def check_vision_batch(batch: VisionBatch, cfg: VisionConfig) -> None:
    """Raises ValueError, naming the field, unless batch's shapes fit the layout and `cfg`."""
    pixels, segment_ids, positions = batch.pixels, batch.segment_ids, batch.positions
    if pixels.ndim != 3 or pixels.shape[-1] != cfg.patch_dim:
        raise ValueError(f"VisionBatch.pixels must be [R, P, patch_size^2 * in_channels = "
                         f"{cfg.patch_dim}], got shape {pixels.shape}")
    rows, slots = pixels.shape[:2]
    if slots % MERGE_PATCHES:
        raise ValueError(f"VisionBatch.pixels has P={slots} patch slots a row: expected a "
                         f"multiple of {MERGE_PATCHES} (whole merged tokens)")
    if segment_ids.shape != (rows, slots) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"VisionBatch.segment_ids must be int [R, P] = {(rows, slots)}, got "
                         f"{segment_ids.dtype} {segment_ids.shape}")
    if positions.shape != (rows, slots, 2) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"VisionBatch.positions must be int [R, P, 2] = {(rows, slots, 2)}, "
                         f"got {positions.dtype} {positions.shape}")
