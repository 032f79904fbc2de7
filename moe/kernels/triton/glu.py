"""Pallas GPU kernels (Triton backend) for a GLU activation of a fused gate/up product.

The forward reads gate_up [R, 2, M] (gate at index 0, up at 1) once and writes act(gate, up)
[R, M]; the backward reads gate_up and the output cotangent once and writes d(gate_up)
[R, 2, M]. Each program owns a block of rows and columns and recomputes the activation's
intermediates (tanh, sigmoid, ...) in float32 registers, so nothing but the operands and results
ever crosses memory.

Why not XLA: XLA's backward is one fusion that writes two float32 [R, M] intermediates and a
second one that reads them back and assembles d(gate) and d(up) (XLA will not duplicate the
transcendentals into the second fusion), several times the memory traffic of reading and writing
the bf16 operands and results once (`benchmarks/moe_notes.md`).

Pallas' Triton backend is deprecated as of jax 0.11 (in favour of Mosaic GPU); it is kept here
because the project pins jax 0.11.2 and an elementwise kernel needs nothing Mosaic-specific.
The kernels run any GPU the Triton backend supports; `moe.activations.fused_glu` calls them on
GPUs when `supports` says the shape tiles, and falls back to XLA otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

BLOCK_ROWS = 8  # the grouped matmuls pad their rows to a multiple of 8 (moe.grouped_matmul)
MAX_BLOCK_COLUMNS = 1024  # 8 x 2 x 1024 elements a program: Triton tensors are powers of two
_COMPILER_PARAMS = pallas_triton.CompilerParams(num_warps=8, num_stages=1)

Activation = Callable[[jax.Array, jax.Array], jax.Array]


def block_columns(hidden: int) -> int:
    """Columns of a program's block: the largest power of two <= 1024 dividing `hidden`."""
    return min(hidden & -hidden, MAX_BLOCK_COLUMNS)


def supports(gate_up: jax.Array) -> bool:
    """Whether the kernels tile `gate_up` [..., 2, M]: rows a multiple of 8, M of 128."""
    if gate_up.ndim < 2 or gate_up.shape[-2] != 2 or gate_up.shape[-1] % 128:
        return False
    rows = gate_up.size // (2 * gate_up.shape[-1])
    return rows > 0 and rows % BLOCK_ROWS == 0


def glu_forward(activation: Activation, gate_up: jax.Array, *, interpret: bool = False):
    """activation(gate, up) of gate_up [..., 2, M] -> [..., M] in gate_up.dtype."""
    rows, hidden, grid, spec = _layout(gate_up)
    out = pl.pallas_call(
        functools.partial(_forward_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), gate_up.dtype),
        grid=grid,
        in_specs=[spec],
        out_specs=pl.BlockSpec((BLOCK_ROWS, spec.block_shape[-1]), lambda i, j: (i, j)),
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )(gate_up.reshape(rows, 2, hidden))
    return out.reshape(gate_up.shape[:-2] + (hidden,))


def glu_backward(activation: Activation, gate_up: jax.Array, out_grad: jax.Array, *,
                 interpret: bool = False):
    """The cotangent of gate_up [..., 2, M] given out_grad [..., M], in gate_up.dtype."""
    rows, hidden, grid, spec = _layout(gate_up)
    grad = pl.pallas_call(
        functools.partial(_backward_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((rows, 2, hidden), gate_up.dtype),
        grid=grid,
        in_specs=[spec, pl.BlockSpec((BLOCK_ROWS, spec.block_shape[-1]), lambda i, j: (i, j))],
        out_specs=spec,
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
    )(gate_up.reshape(rows, 2, hidden), out_grad.reshape(rows, hidden))
    return grad.reshape(gate_up.shape)


def _layout(gate_up):
    """Rows, M, the grid and the [rows, 2, M] view's block spec of a supported gate_up."""
    if not supports(gate_up):
        raise ValueError(
            f"gate_up must be [..., 2, M] with M a multiple of 128 and the leading dimensions "
            f"holding a multiple of {BLOCK_ROWS} rows, got {gate_up.shape}; use "
            "moe.activations.fused_glu, which falls back to XLA for other shapes."
        )
    hidden = gate_up.shape[-1]
    rows = gate_up.size // (2 * hidden)
    columns = block_columns(hidden)
    spec = pl.BlockSpec((BLOCK_ROWS, 2, columns), lambda i, j: (i, 0, j))
    return rows, hidden, (rows // BLOCK_ROWS, hidden // columns), spec


def _forward_kernel(gate_up_ref, out_ref, *, activation):
    out_ref[...] = activation(gate_up_ref[:, 0, :], gate_up_ref[:, 1, :]).astype(out_ref.dtype)


def _backward_kernel(gate_up_ref, out_grad_ref, grad_ref, *, activation):
    gate = gate_up_ref[:, 0, :].astype(jnp.float32)
    up = gate_up_ref[:, 1, :].astype(jnp.float32)
    _, pullback = jax.vjp(activation, gate, up)
    gate_grad, up_grad = pullback(out_grad_ref[...].astype(jnp.float32))
    grad_ref[:, 0, :] = gate_grad.astype(grad_ref.dtype)
    grad_ref[:, 1, :] = up_grad.astype(grad_ref.dtype)
