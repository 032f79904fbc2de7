"""Pallas GPU kernels (Triton backend) for the KDA layer's short convolution and its SiLU.

The layer mixes each projected q|k|v channel over the current and `W - 1` preceding tokens of its
document (`kda.layer.causal_depthwise_conv`, W = 4) and applies SiLU, then splits q, k and v.
Here, for a sequence's first call (zero prefix), each program owns a block of tokens x channels:

- the forward reads x [B, T, C] and writes the parts [B, T, C_i] (q, k, v) directly;
- the backward (`KernelOptions.backward`), by default two kernels: the first recomputes the
  pre-activation from x, writes g = the parts' cotangents times SiLU's slope (float32
  [B, T, C]) and each block's sums of g times the shifted x, the filter's gradient (summed over
  blocks by XLA); the second gathers g's shifted rows into dx. Or one kernel that recomputes g
  at every shift dx needs ("recompute"): less HBM traffic and peak memory, but 4x the SiLU and
  the loads, and slower than the two kernels.

Both take the SiLU in float32 before one rounding, so they are more accurate than XLA's path
(which rounds the pre-activation to bf16 first). They run where `KDAConfig.conv_kernels` (on by
default) and the shapes allow. Alone, their forward is about twice as fast as XLA's and their
forward+backward a little faster; in the training step they gain more, since there they also
spare the backward XLA's recomputed forward (`benchmarks/short_conv_h200.md`,
`benchmarks/train_h200.md`).

Shifted rows are loaded by gathering clipped row indices and masking the rows before the
sequence, past its end, or in another document: a dynamic slice starting before row 0 would be
clamped by interpret mode (so tests on a CPU would see other rows than the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton


BACKWARDS = ("two_pass", "recompute")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """One program's block, `tokens` x `channels` (powers of two: Triton tensors are), run by
    `warps` warps, and the backward's scheme:

    - "two_pass": one kernel writes g (the cotangents through SiLU, float32) and the filter's
      partial sums, a second gathers g's shifted rows into dx;
    - "recompute": one kernel recomputes g at the W shifts each block's dx needs from x (4x the
      SiLU and the loads, from L1/L2), moving only x, the cotangents and dx: about half the bytes.

    The default, 32 x 64 by 4 warps with two passes, had the shortest forward+backward device
    time of the blocks and schemes timed (`benchmarks/short_conv_h200.md`).
    """

    tokens: int = 32
    channels: int = 64
    warps: int = 4
    backward: str = "two_pass"

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")

    def __str__(self):
        scheme = "" if self.backward == "two_pass" else f"/{self.backward}"
        return f"{self.tokens}x{self.channels}/{self.warps}w{scheme}"


OPTIONS = KernelOptions()


def refusal(x_shape: tuple[int, ...], widths: tuple[int, ...], width: int,
            options: KernelOptions | None = None) -> str | None:
    """Why the kernels cannot run x [B, T, C] split into `widths` with a width-`width` filter
    (with `options`, default `OPTIONS`), or None when they can."""
    options = options or OPTIONS
    if len(x_shape) != 3:
        return f"x must be [B, T, C], got shape {x_shape}"
    if sum(widths) != x_shape[2]:
        return f"the parts' widths {widths} must add up to C = {x_shape[2]}"
    if any(w % options.channels for w in widths):
        return f"every part's width must be a multiple of {options.channels}, got {widths}"
    if x_shape[1] % options.tokens:
        return f"T must be a multiple of {options.tokens}, got {x_shape[1]}"
    if width < 1:
        return f"the filter width must be positive, got {width}"
    return None


def _check(x, widths, weight, options):
    reason = refusal(x.shape, widths, weight.shape[0], options)
    if reason is not None:
        raise ValueError(f"kda.kernels.triton.short_conv: {reason}; kda.layer falls back to XLA "
                         "for such calls")
    if weight.shape[1] != x.shape[2]:
        raise ValueError(f"weight must be [W, C] with C = {x.shape[2]}, got {weight.shape}")


def _part_block_ranges(widths, options):
    """[(first, end)) channel blocks of each part."""
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w // options.channels)
    return tuple(zip(bounds[:-1], bounds[1:]))


class _Layout:
    """The grid (B, T / tokens, C / channels) and the block specs: token-major arrays are seen
    whole along T (a program gathers its shifted rows), one block of channels wide."""

    def __init__(self, x_shape, widths, width, options):
        batch, length, channels = x_shape
        self.options = options
        self.grid = (batch, length // options.tokens, channels // options.channels)
        self.tokens = pl.BlockSpec((None, length, options.channels), lambda b, t, c: (b, 0, c))
        self.documents = pl.BlockSpec((None, length), lambda b, t, c: (b, 0))
        self.weight = pl.BlockSpec((width, options.channels), lambda b, t, c: (0, c))
        self.weight_partials = pl.BlockSpec((None, None, width, options.channels),
                                            lambda b, t, c: (b, t, 0, c))
        # A program touches only its own part; other parts' blocks are clamped into range.
        self.part_ranges = _part_block_ranges(widths, options)
        self.parts = [
            pl.BlockSpec((None, length, options.channels),
                         lambda b, t, c, lo=lo, hi=hi: (b, 0, jnp.clip(c - lo, 0, hi - lo - 1)))
            for lo, hi in self.part_ranges
        ]

    def call(self, kernel, out_shape, in_specs, out_specs, interpret, **params):
        return pl.pallas_call(
            functools.partial(kernel, options=self.options, **params),
            out_shape=out_shape, grid=self.grid, in_specs=in_specs, out_specs=out_specs,
            compiler_params=pallas_triton.CompilerParams(num_warps=self.options.warps,
                                                         num_stages=1),
            interpret=interpret,
        )


def _rows_of(ref, rows, length):
    """ref's rows `rows` [R] (clipped into [0, length)): [R, ...] for a token-major block."""
    return ref[jnp.clip(rows, 0, length - 1)]


def _program_rows(options):
    """The first token of this program's block and all of them, [tokens] int32. (Program ids
    are read at a kernel's top level: interpret mode resolves them there.)"""
    start = pl.program_id(1) * options.tokens
    return start, start + jnp.arange(options.tokens, dtype=jnp.int32)


def _taps(x_ref, doc_ref, rows, width, length, documents):
    """x at `rows` - (W - 1 - o) for each tap o, float32 [R, channels], zero before the sequence
    or in another document than the row's."""
    here = _rows_of(doc_ref, rows, length) if documents else None
    windows = []
    for tap in range(width):
        source = rows - (width - 1 - tap)
        window = _rows_of(x_ref, source, length).astype(jnp.float32)
        valid = (source >= 0) & _in_row_document(doc_ref, source, here, length)
        windows.append(jnp.where(valid[:, None], window, 0.0))
    return windows


def _in_row_document(doc_ref, shifted, here, length):
    """Whether the rows `shifted` [R] (clipped into the sequence) hold the document `here` [R] of
    their unshifted rows; True without documents (`here` None)."""
    return True if here is None else _rows_of(doc_ref, shifted, length) == here


def _weights(w_ref):
    return [w_ref[tap, :].astype(jnp.float32) for tap in range(w_ref.shape[0])]


def _pre_activation(windows, weights):
    """The convolution: taps summed in XLA's order, float32."""
    pre = windows[0] * weights[0][None, :]
    for window, weight in zip(windows[1:], weights[1:]):
        pre = pre + window * weight[None, :]
    return pre


def _silu_slope(pre):
    """d SiLU / d pre, float32."""
    sig = jax.nn.sigmoid(pre)
    return sig * (1.0 + pre * (1.0 - sig))


def _forward_kernel(x_ref, w_ref, doc_ref, *out_refs, options, part_ranges, documents):
    start, rows = _program_rows(options)
    channel_block = pl.program_id(2)
    weights = _weights(w_ref)
    pre = _pre_activation(
        _taps(x_ref, doc_ref, rows, len(weights), x_ref.shape[0], documents), weights)
    out = pre * jax.nn.sigmoid(pre)
    for out_ref, (lo, hi) in zip(out_refs, part_ranges):
        @pl.when((channel_block >= lo) & (channel_block < hi))
        def _(out_ref=out_ref):
            out_ref[pl.ds(start, options.tokens), :] = out.astype(out_ref.dtype)


def _slope_kernel(x_ref, w_ref, doc_ref, *refs, options, part_ranges, documents):
    """g = the part's cotangent times SiLU's slope at the recomputed pre-activation (float32),
    and this block's sums over tokens of g times each tap's window: the weight's gradient."""
    *grad_refs, g_ref, dw_ref = refs
    start, rows = _program_rows(options)
    channel_block = pl.program_id(2)
    weights = _weights(w_ref)
    windows = _taps(x_ref, doc_ref, rows, len(weights), x_ref.shape[0], documents)
    slope = _silu_slope(_pre_activation(windows, weights))
    for grad_ref, (lo, hi) in zip(grad_refs, part_ranges):
        @pl.when((channel_block >= lo) & (channel_block < hi))
        def _(grad_ref=grad_ref):
            g = grad_ref[pl.ds(start, options.tokens), :].astype(jnp.float32) * slope
            g_ref[pl.ds(start, options.tokens), :] = g
            for tap, window in enumerate(windows):
                dw_ref[tap, :] = jnp.sum(window * g, axis=0)


def _input_cotangent(g_at, doc_ref, rows, length, weights, documents, options):
    """dx at `rows` [tokens], float32: the sum over k < W of w[W - 1 - k] g[t + k], within t's
    document and the sequence (token t's input feeds the outputs t + k through tap W - 1 - k).
    `g_at(k, outputs)` gives g, float32 [tokens, channels], at the rows `outputs` = rows + k."""
    width = len(weights)
    here = _rows_of(doc_ref, rows, length) if documents else None
    dx = jnp.zeros((options.tokens, options.channels), jnp.float32)
    for k in range(width):
        outputs = rows + k
        g = g_at(k, outputs)
        valid = (outputs < length) & _in_row_document(doc_ref, outputs, here, length)
        dx = dx + jnp.where(valid[:, None], g, 0.0) * weights[width - 1 - k][None, :]
    return dx


def _transpose_kernel(g_ref, w_ref, doc_ref, dx_ref, *, options, documents):
    """dx from the g that `_slope_kernel` wrote (`_input_cotangent`)."""
    start, rows = _program_rows(options)
    length = g_ref.shape[0]
    dx = _input_cotangent(lambda k, outputs: _rows_of(g_ref, outputs, length), doc_ref, rows,
                          length, _weights(w_ref), documents, options)
    dx_ref[pl.ds(start, options.tokens), :] = dx.astype(dx_ref.dtype)


def _recompute_backward_kernel(x_ref, w_ref, doc_ref, *refs, options, part_ranges, documents):
    """dx and the filter's partial sums in one kernel: g at each shift k < W that dx needs is
    recomputed from x (`_input_cotangent`)."""
    *grad_refs, dx_ref, dw_ref = refs
    start, rows = _program_rows(options)
    channel_block = pl.program_id(2)
    length = x_ref.shape[0]
    weights = _weights(w_ref)
    for grad_ref, (lo, hi) in zip(grad_refs, part_ranges):
        @pl.when((channel_block >= lo) & (channel_block < hi))
        def _(grad_ref=grad_ref):
            def g_at(k, outputs):
                windows = _taps(x_ref, doc_ref, outputs, len(weights), length, documents)
                g = _rows_of(grad_ref, outputs, length).astype(jnp.float32) * _silu_slope(
                    _pre_activation(windows, weights))
                if k == 0:  # the block's own outputs: the filter's gradient
                    for tap, window in enumerate(windows):
                        dw_ref[tap, :] = jnp.sum(window * g, axis=0)
                return g

            dx = _input_cotangent(g_at, doc_ref, rows, length, weights, documents, options)
            dx_ref[pl.ds(start, options.tokens), :] = dx.astype(dx_ref.dtype)


def _documents(x, document):
    """The document index operand ([B, T] int32; zeros when there are no documents)."""
    if document is None:
        return jnp.zeros(x.shape[:2], jnp.int32)
    return document.astype(jnp.int32)


def conv_silu_forward(x, weight, document, widths, *, options: KernelOptions | None = None,
                      interpret: bool = False):
    """SiLU(causal depthwise conv) of x [B, T, C] with a zero prefix, split into parts.

    weight: [W, C] (tap W - 1 multiplies the current token); document: int [B, T] (each token's
    document, `kda.common.document_index`) or None; widths: the parts' widths (q, k, v), adding
    up to C; options: default `OPTIONS`. Returns a tuple of [B, T, width] arrays in x.dtype.
    """
    options = options or OPTIONS
    _check(x, widths, weight, options)
    layout = _Layout(x.shape, widths, weight.shape[0], options)
    return tuple(layout.call(
        _forward_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape[:2] + (w,), x.dtype) for w in widths],
        in_specs=[layout.tokens, layout.weight, layout.documents],
        out_specs=layout.parts,
        interpret=interpret, part_ranges=layout.part_ranges, documents=document is not None,
    )(x, weight, _documents(x, document)))


def conv_silu_backward(x, weight, document, grads, *, options: KernelOptions | None = None,
                       interpret: bool = False):
    """The cotangents of x [B, T, C] and of weight [W, C] (float32) given the parts' cotangents
    `grads` (a tuple of [B, T, width], as `conv_silu_forward` returns the parts).

    `options.backward` picks the scheme (`KernelOptions`; default `OPTIONS`).
    """
    options = options or OPTIONS
    widths = tuple(g.shape[2] for g in grads)
    _check(x, widths, weight, options)
    batch, length, channels = x.shape
    width = weight.shape[0]
    layout = _Layout(x.shape, widths, width, options)
    documents = _documents(x, document)
    partials_shape = jax.ShapeDtypeStruct((batch, length // options.tokens, width, channels),
                                          jnp.float32)
    # The first kernel writes dx itself ("recompute") or g for the second (float32).
    recompute = options.backward == "recompute"
    first, weight_partials = layout.call(
        _recompute_backward_kernel if recompute else _slope_kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype if recompute else jnp.float32),
                   partials_shape],
        in_specs=[layout.tokens, layout.weight, layout.documents, *layout.parts],
        out_specs=[layout.tokens, layout.weight_partials],
        interpret=interpret, part_ranges=layout.part_ranges, documents=document is not None,
    )(x, weight, documents, *grads)
    if recompute:
        return first, jnp.sum(weight_partials, axis=(0, 1))
    dx = layout.call(
        _transpose_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[layout.tokens, layout.weight, layout.documents],
        out_specs=layout.tokens,
        interpret=interpret, documents=document is not None,
    )(first, weight, documents)
    return dx, jnp.sum(weight_partials, axis=(0, 1))
