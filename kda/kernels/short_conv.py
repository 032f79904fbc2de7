"""Pallas GPU kernels (Triton backend) for the KDA layer's short convolution and its SiLU.

The layer mixes each projected q|k|v channel over the current and `W - 1` preceding tokens of its
document (`kda.layer.causal_depthwise_conv`, W = 4) and applies SiLU, then splits q, k and v.
Here, for a sequence's first call (zero prefix):

- the forward reads x [B, T, C] once and writes the parts [B, T, C_i] (q, k, v) directly;
- the backward reads x and the parts' cotangents once, recomputes the pre-activation of every
  token it needs in float32 registers, and writes dx [B, T, C] and each program's float32 partial
  sums of the weight's gradient [B, T / SPAN, W, C] (summed by XLA: the weight gradient is a sum
  over every token of the batch).

Why not XLA: on the H200 the `1b` training step spent 16.0 ms (of ~308 ms of device time) in
these fusions, 1.33 ms a layer: the forward's fused slices ran at ~1.1 TB/s, and the backward
split into five fusions (the transposed pads of the shifted windows, the SiLU's cotangent
concatenated across q, k and v, the weight's partial reductions in two passes, and the
recomputed forward), where reading x and the cotangents once and writing dx is ~0.6 GB a layer.

Shifted rows are loaded by gathering clipped row indices and masking the rows before the
sequence, past its end, or in another document: a dynamic slice starting before row 0 would be
clamped by interpret mode (so tests on a CPU would see other rows than the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

BLOCK_TOKENS = 32  # rows of one inner step; Triton tensors are powers of two
BLOCK_CHANNELS = 128
SPAN_TOKENS = 256  # tokens of one program, and of one partial sum of the weight's gradient
_COMPILER_PARAMS = pallas_triton.CompilerParams(num_warps=4, num_stages=1)


def span_tokens(length: int) -> int:
    """Tokens a program covers: the largest power of two <= SPAN_TOKENS dividing `length`."""
    return min(length & -length, SPAN_TOKENS)


def refusal(x_shape: tuple[int, ...], widths: tuple[int, ...], width: int) -> str | None:
    """Why the kernels cannot run x [B, T, C] split into `widths` with a width-`width` filter, or
    None when they can."""
    if len(x_shape) != 3:
        return f"x must be [B, T, C], got shape {x_shape}"
    if sum(widths) != x_shape[2]:
        return f"the parts' widths {widths} must add up to C = {x_shape[2]}"
    if any(w % BLOCK_CHANNELS for w in widths):
        return f"every part's width must be a multiple of {BLOCK_CHANNELS}, got {widths}"
    if x_shape[1] % BLOCK_TOKENS:
        return f"T must be a multiple of {BLOCK_TOKENS}, got {x_shape[1]}"
    if width < 1:
        return f"the filter width must be positive, got {width}"
    return None


def _check(x, widths, weight):
    reason = refusal(x.shape, widths, weight.shape[0])
    if reason is not None:
        raise ValueError(f"kda.kernels.short_conv: {reason}; kda.layer falls back to XLA for "
                         "such calls")
    if weight.shape[1] != x.shape[2]:
        raise ValueError(f"weight must be [W, C] with C = {x.shape[2]}, got {weight.shape}")


def _part_block_ranges(widths):
    """[(first, end)) channel blocks of each part."""
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w // BLOCK_CHANNELS)
    return tuple(zip(bounds[:-1], bounds[1:]))


def _specs(x, widths, width):
    """Grid, x's, the documents', each part's (channel blocks clamped into the part: a program
    stores only to its own) and the width-`width` weight's block specs."""
    batch, length, channels = x.shape
    span = span_tokens(length)
    grid = (batch, length // span, channels // BLOCK_CHANNELS)
    x_spec = pl.BlockSpec((None, length, BLOCK_CHANNELS), lambda b, s, c: (b, 0, c))
    doc_spec = pl.BlockSpec((None, length), lambda b, s, c: (b, 0))
    part_specs = [
        pl.BlockSpec((None, length, BLOCK_CHANNELS),
                     lambda b, s, c, lo=lo, hi=hi: (b, 0, jnp.clip(c - lo, 0, hi - lo - 1)))
        for lo, hi in _part_block_ranges(widths)
    ]
    weight_spec = pl.BlockSpec((width, BLOCK_CHANNELS), lambda b, s, c: (0, c))
    return span, grid, x_spec, doc_spec, part_specs, weight_spec


def _rows_of(ref, rows, length):
    """ref's rows `rows` [R] (clipped into [0, length)): [R, ...] for a token-major block."""
    return ref[jnp.clip(rows, 0, length - 1)]


def _pre_activation(x_ref, doc_ref, weights, rows, length, documents):
    """The convolution at tokens `rows` [R] in float32, [R, BLOCK_CHANNELS]: the sum over taps o
    of weights[o] times x W - 1 - o tokens back, zero before the sequence or in another
    document (in XLA's order of the taps)."""
    width = len(weights)
    here = _rows_of(doc_ref, rows, length) if documents else None
    pre = jnp.zeros((rows.shape[0], BLOCK_CHANNELS), jnp.float32)
    for tap, weight in enumerate(weights):
        source = rows - (width - 1 - tap)
        valid = source >= 0
        if documents:
            valid &= _rows_of(doc_ref, source, length) == here
        window = _rows_of(x_ref, source, length).astype(jnp.float32)
        pre = pre + jnp.where(valid[:, None], window, 0.0) * weight[None, :]
    return pre


def _in_part(channel_block, part_range):
    lo, hi = part_range
    return (channel_block >= lo) & (channel_block < hi)


def _forward_kernel(x_ref, w_ref, doc_ref, *out_refs, part_ranges, span, documents):
    length = x_ref.shape[0]
    weights = [w_ref[tap, :].astype(jnp.float32) for tap in range(w_ref.shape[0])]
    # Program ids are read here, outside the loop: interpret mode resolves them at the top level.
    first = pl.program_id(1) * span
    in_parts = [_in_part(pl.program_id(2), part_range) for part_range in part_ranges]

    def step(i, carry):
        start = first + i * BLOCK_TOKENS
        rows = start + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
        pre = _pre_activation(x_ref, doc_ref, weights, rows, length, documents)
        out = pre * jax.nn.sigmoid(pre)
        for out_ref, in_part in zip(out_refs, in_parts):
            @pl.when(in_part)
            def _(out_ref=out_ref):
                out_ref[pl.ds(start, BLOCK_TOKENS), :] = out.astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, span // BLOCK_TOKENS, step, 0)


def _backward_kernel(x_ref, w_ref, doc_ref, *refs, part_ranges, span, documents):
    *grad_refs, dx_ref, dw_ref = refs
    first = pl.program_id(1) * span
    for grad_ref, part_range in zip(grad_refs, part_ranges):
        @pl.when(_in_part(pl.program_id(2), part_range))
        def _(grad_ref=grad_ref):
            _backward_block(x_ref, w_ref, doc_ref, grad_ref, dx_ref, dw_ref, first, span,
                            documents)


def _backward_block(x_ref, w_ref, doc_ref, grad_ref, dx_ref, dw_ref, first, span, documents):
    """One program's tokens of one part: dx, and the partial sums of the weight's gradient.

    Token t's input feeds the outputs t + k (k < W) through tap W - 1 - k, so dx[t] sums the
    SiLU-scaled cotangents g of those outputs (recomputed from x), and the tap-o gradient sums
    g[t] * x[t - (W - 1 - o)] over the program's tokens.
    """
    length = x_ref.shape[0]
    width = w_ref.shape[0]
    weights = [w_ref[tap, :].astype(jnp.float32) for tap in range(width)]

    def step(i, weight_grads):
        start = first + i * BLOCK_TOKENS
        rows = start + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
        here = _rows_of(doc_ref, rows, length) if documents else None
        dx = jnp.zeros((BLOCK_TOKENS, BLOCK_CHANNELS), jnp.float32)
        weight_grads = list(weight_grads)
        for k in range(width):
            outputs = rows + k
            pre = _pre_activation(x_ref, doc_ref, weights, outputs, length, documents)
            sig = jax.nn.sigmoid(pre)
            g = _rows_of(grad_ref, outputs, length).astype(jnp.float32) * (
                sig * (1.0 + pre * (1.0 - sig)))
            valid = outputs < length
            if documents:
                valid &= _rows_of(doc_ref, outputs, length) == here
            dx = dx + jnp.where(valid[:, None], g, 0.0) * weights[width - 1 - k][None, :]
            if k == 0:
                for tap in range(width):
                    source = rows - (width - 1 - tap)
                    seen = source >= 0
                    if documents:
                        seen &= _rows_of(doc_ref, source, length) == here
                    window = _rows_of(x_ref, source, length).astype(jnp.float32)
                    weight_grads[tap] = weight_grads[tap] + jnp.sum(
                        jnp.where(seen[:, None], window, 0.0) * g, axis=0)
        dx_ref[pl.ds(start, BLOCK_TOKENS), :] = dx.astype(dx_ref.dtype)
        return tuple(weight_grads)

    zeros = tuple(jnp.zeros((BLOCK_CHANNELS,), jnp.float32) for _ in range(width))
    weight_grads = jax.lax.fori_loop(0, span // BLOCK_TOKENS, step, zeros)
    for tap in range(width):
        dw_ref[tap, :] = weight_grads[tap]


def _documents(x, document):
    """The document index operand ([B, T] int32; zeros when there are no documents)."""
    if document is None:
        return jnp.zeros(x.shape[:2], jnp.int32)
    return document.astype(jnp.int32)


def conv_silu_forward(x, weight, document, widths, *, interpret: bool = False):
    """SiLU(causal depthwise conv) of x [B, T, C] with a zero prefix, split into parts.

    weight: [W, C] (tap W - 1 multiplies the current token); document: int [B, T] (each token's
    document, `kda.common.document_starts` summed along the row) or None; widths: the parts'
    widths (q, k, v), adding up to C. Returns a tuple of [B, T, width] arrays in x.dtype.
    """
    _check(x, widths, weight)
    span, grid, x_spec, doc_spec, part_specs, weight_spec = _specs(x, widths, weight.shape[0])
    kernel = functools.partial(_forward_kernel, part_ranges=_part_block_ranges(widths),
                               span=span, documents=document is not None)
    return tuple(pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape[:2] + (w,), x.dtype) for w in widths],
        grid=grid,
        in_specs=[x_spec, weight_spec, doc_spec],
        out_specs=part_specs,
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )(x, weight, _documents(x, document)))


def conv_silu_backward(x, weight, document, grads, *, interpret: bool = False):
    """The cotangents of x [B, T, C] and of weight [W, C] (float32) given the parts' cotangents
    `grads` (a tuple of [B, T, width], as `conv_silu_forward` returns the parts)."""
    widths = tuple(g.shape[2] for g in grads)
    _check(x, widths, weight)
    batch, length, channels = x.shape
    width = weight.shape[0]
    span, grid, x_spec, doc_spec, part_specs, weight_spec = _specs(x, widths, width)
    kernel = functools.partial(_backward_kernel, part_ranges=_part_block_ranges(widths),
                               span=span, documents=document is not None)
    dx, weight_partials = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((batch, length // span, width, channels), jnp.float32)],
        grid=grid,
        in_specs=[x_spec, weight_spec, doc_spec, *part_specs],
        out_specs=[x_spec, pl.BlockSpec((None, None, width, BLOCK_CHANNELS),
                                        lambda b, s, c: (b, s, 0, c))],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )(x, weight, _documents(x, document), *grads)
    return dx, jnp.sum(weight_partials, axis=(0, 1))
