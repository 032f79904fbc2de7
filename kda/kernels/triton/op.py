"""The Triton path for KDA (jax-triton): portable kernels for NVIDIA GPUs from Ampere on.

Triton kernels (`kda.kernels.triton.kernels`) for the two halves of the chunked op
(`kda.chunked`) with the contracts of the Mosaic GPU kernels (`RecurrenceOperands`):

* the chunk preparation with bounded gates (`gate_lower_bound` set), in two kernels of one
  program per (chunk of 64 tokens, batch row x value head): the scores (cumulative gates, the
  16x16 score tiles as bf16 `tl.dot`s around the causal anchor `G_first + 7.5 L`, document masks,
  the state factors), then the UT transform (`(I + beta Akk)^-1` by recursive doubling, W and U
  from hi/lo bf16 splits). With unbounded gates the preparation stays in plain JAX.
* the recurrence over chunks, one program per (32-column V tile, batch row x value head), its
  float32 state tile `S [K, 32]` in registers, bf16 `tl.dot`s with float32 accumulation.

Numerics follow the Mosaic GPU kernels (`kda.kernels.mosaic_gpu.prepare` describes them): bf16
matmul operands, float32 accumulators, state and elementwise math; U and chunk_decay in float32.
In Triton's interpreter the outputs and final states stay within fla's error bars (5e-3
relative) of the oracle. The block sizes and warp counts below keep every kernel's registers
from spilling, or nearly so (ptxas, sm_80 and sm_90).

Only the forward is a kernel: `jax.custom_vjp`s whose backward is plain JAX, recomputed from the
inputs, so gradients equal the chunked op's: the VJP of `chunk_recurrence` with unbounded gates
(JAX differentiates the plain-JAX preparation), of the whole chunked op with bounded gates.
`jax_triton` and `triton` are imported only when a kernel launches, so `import kda` works without
them. Importing this module registers `impl="triton"` with `kda.api` for calls that ask for it by
name: `impl="auto"` does not choose it (see the registration).
"""

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda.api import KDACall, register_kernel
from kda.chunked import (CHUNK_SIZE, TILE_SIZE, ChunkedInputs, chunk_kda, chunk_recurrence,
                         chunks_to_tokens)
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, RecurrenceOperands,
                                           recurrence_operands)
from kda.kernels.path import (BoundedOptions, KernelPath, compute_capability,
                              covers_call_shapes, kernel_kda)

NAME = "triton"
SUPPORTED_DIMS = (64, 128)  # K and V: powers of two (tl.arange), multiples of BLOCK_V
# State columns per recurrence program: S [K, 32] float32 in registers. With 64 columns the
# kernel spills registers at K = 128 (ptxas, sm_80 and sm_90, even with 8 warps); with 32 it does
# not, and the grid has twice the programs.
BLOCK_V = 32
RECURRENCE_WARPS = {64: 4, 128: 8}  # by K
RECURRENCE_STAGES = 2  # the loads of chunk n + 1 overlap the math of chunk n
# The preparation holds several [64, 64] float32 tiles at once; with fewer warps, or with its
# column-block loops software-pipelined, it spills more registers (ptxas, sm_80 and sm_90).
PREPARE_WARPS = 8
PREPARE_STAGES = 1


class KernelLaunch(NamedTuple):
    """One Triton kernel call: what `jax_triton.triton_call` (or an interpreter) needs."""

    kernel: str  # name of a `@triton.jit` function in `kda.kernels.triton.kernels`
    inputs: tuple  # arrays, in the kernel's parameter order; the outputs' pointers follow
    out_shape: tuple  # jax.ShapeDtypeStruct per output
    grid: tuple
    num_warps: int
    num_stages: int  # software-pipelining depth of the kernel's loops
    constants: dict  # the kernel's constexpr parameters


def launch(call: KernelLaunch):
    """Runs `call` on the GPU through jax-triton; returns its outputs."""
    import jax_triton  # noqa: PLC0415 (optional: needs a CUDA jaxlib and triton)

    from kda.kernels.triton import kernels as triton_kernels  # noqa: PLC0415 (imports triton)

    return jax_triton.triton_call(
        *call.inputs, kernel=getattr(triton_kernels, call.kernel), out_shape=call.out_shape,
        grid=call.grid, num_warps=call.num_warps, num_stages=call.num_stages,
        **call.constants)


def preparation_launches(q, k, v, g, beta, *, scale, segment_ids, use_qk_l2norm,
                         gate_lower_bound):
    """The preparation kernels' calls for `kda.chunked.prepare_chunks` (chunk 64, bounded gates).

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K], every g >= gate_lower_bound;
        beta: [B, T, HV]; K and V in {64, 128}.
      scale, segment_ids, use_qk_l2norm: as in `kda.chunked.chunk_kda`.
      gate_lower_bound: L in [-5, 0).
    Returns:
      (scores, solve): `scores` outputs q_from_state, k_to_state^T, Aqk, chunk_decay and
      N = beta Akk; `solve` outputs W and U, and lacks its last input, the N that `scores` writes
      (`prepare_chunks_kernel` appends it).
    """
    batch, length, num_value_heads, value_dim = v.shape
    num_heads, key_dim = q.shape[2:]
    num_chunks = -(-length // CHUNK_SIZE)
    if segment_ids is None:  # one document: every token has the same id
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    q, k, v = (x.astype(OPERAND_DTYPE) for x in (q, k, v))
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    segment_ids = segment_ids.astype(jnp.int32)
    chunked = lambda *tail: (batch, num_value_heads, num_chunks, *tail)  # noqa: E731
    grid = (num_chunks, batch * num_value_heads)
    shapes = {"T": length, "H": num_heads, "HV": num_value_heads, "K": key_dim,
              "NUM_CHUNKS": num_chunks, "CHUNK": CHUNK_SIZE}
    scores = KernelLaunch(
        kernel="scores_kernel",
        inputs=(q, k, g, beta, segment_ids),
        out_shape=(jax.ShapeDtypeStruct(chunked(CHUNK_SIZE, key_dim), OPERAND_DTYPE),
                   jax.ShapeDtypeStruct(chunked(key_dim, CHUNK_SIZE), OPERAND_DTYPE),
                   jax.ShapeDtypeStruct(chunked(CHUNK_SIZE, CHUNK_SIZE), OPERAND_DTYPE),
                   jax.ShapeDtypeStruct(chunked(key_dim), jnp.float32),
                   jax.ShapeDtypeStruct(chunked(CHUNK_SIZE, CHUNK_SIZE), OPERAND_DTYPE)),
        grid=grid,
        num_warps=PREPARE_WARPS,
        num_stages=PREPARE_STAGES,
        constants={**shapes, "TILE": TILE_SIZE, "SCALE": float(scale),
                   "LOWER_BOUND": float(gate_lower_bound), "USE_QK_L2NORM": bool(use_qk_l2norm)},
    )
    solve = KernelLaunch(
        kernel="solve_kernel",
        inputs=(k, v, g, beta, segment_ids),
        out_shape=(jax.ShapeDtypeStruct(chunked(CHUNK_SIZE, key_dim), OPERAND_DTYPE),
                   jax.ShapeDtypeStruct(chunked(CHUNK_SIZE, value_dim), jnp.float32)),
        grid=grid,
        num_warps=PREPARE_WARPS,
        num_stages=PREPARE_STAGES,
        constants={**shapes, "V": value_dim, "USE_QK_L2NORM": bool(use_qk_l2norm)},
    )
    return scores, solve


def recurrence_launch(operands: RecurrenceOperands, initial_state, out_dtype) -> KernelLaunch:
    """The recurrence kernel's call: outputs (o [B, HV, N, C, V] in out_dtype, final_state
    float32 [B, HV, K, V]) from `RecurrenceOperands` [B, HV, N, ...] and initial_state (None:
    zeros)."""
    batch, heads, num_chunks, chunk, key_dim = operands.W.shape
    value_dim = operands.U.shape[-1]
    if initial_state is None:  # this kernel always reads one
        initial_state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    return KernelLaunch(
        kernel="recurrence_kernel",
        inputs=(*operands, initial_state.astype(jnp.float32)),
        out_shape=(jax.ShapeDtypeStruct((batch, heads, num_chunks, chunk, value_dim), out_dtype),
                   jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32)),
        grid=(value_dim // BLOCK_V, batch * heads),
        num_warps=RECURRENCE_WARPS[key_dim],
        num_stages=RECURRENCE_STAGES,
        constants=dict(NUM_CHUNKS=num_chunks, CHUNK=chunk, K=key_dim, V=value_dim,
                       BLOCK_V=BLOCK_V),
    )


def prepare_chunks_kernel(q, k, v, g, beta, **options) -> RecurrenceOperands:
    """`kda.chunked.prepare_chunks` by the Triton kernels; arguments as `preparation_launches`."""
    scores, solve = preparation_launches(q, k, v, g, beta, **options)
    q_from_state, k_to_state_t, aqk, chunk_decay, unit_lower = launch(scores)
    w, u = launch(solve._replace(inputs=(*solve.inputs, unit_lower)))
    return RecurrenceOperands(W=w, U=u, q_from_state=q_from_state, k_to_state_t=k_to_state_t,
                              Aqk=aqk, chunk_decay=chunk_decay)


def run_recurrence(operands: RecurrenceOperands, initial_state, out_dtype):
    """`kda.chunked.chunk_recurrence` by the Triton kernel, on the kernel's operands."""
    return tuple(launch(recurrence_launch(operands, initial_state, out_dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def kernel_recurrence(chunks: ChunkedInputs, initial_state, out_dtype):
    """`kda.chunked.chunk_recurrence` by the Triton kernel (same contract; bf16 operands).

    Args:
      chunks: `ChunkedInputs` [B, HV, N, 64, ...] with K and V in {64, 128}.
      initial_state: [B, HV, K, V].
      out_dtype: dtype of the chunk outputs.
    Returns:
      (o [B, HV, N, 64, V] in out_dtype, final_state float32 [B, HV, K, V]).
    """
    return run_recurrence(recurrence_operands(chunks), initial_state, out_dtype)


def _kernel_recurrence_fwd(chunks, initial_state, out_dtype):
    return kernel_recurrence(chunks, initial_state, out_dtype), (chunks, initial_state)


def _kernel_recurrence_bwd(out_dtype, residuals, cotangents):
    """The VJP of the plain-JAX recurrence, recomputed (exact, not a kernel)."""
    chunks, initial_state = residuals
    _, vjp = jax.vjp(lambda c, s: chunk_recurrence(c, s, out_dtype), chunks, initial_state)
    return vjp(cotangents)


kernel_recurrence.defvjp(_kernel_recurrence_fwd, _kernel_recurrence_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _bounded_kda(q, k, v, g, beta, initial_state, segment_ids, options: BoundedOptions):
    """Both kernels, preparation then recurrence: (o [B, T, HV, V], final_state [B, HV, K, V])."""
    operands = prepare_chunks_kernel(q, k, v, g, beta, segment_ids=segment_ids,
                                     **options._asdict())
    o, final_state = run_recurrence(operands, initial_state, v.dtype)
    return chunks_to_tokens(o)[:, :v.shape[1]], final_state


def _bounded_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, options):
    outputs = _bounded_kda(q, k, v, g, beta, initial_state, segment_ids, options)
    return outputs, (q, k, v, g, beta, initial_state, segment_ids)


def _bounded_kda_bwd(options, residuals, cotangents):
    """The VJP of the plain-JAX chunked op, recomputed from the inputs (exact, not a kernel)."""
    *differentiable, segment_ids = residuals

    def chunked(q, k, v, g, beta, initial_state):
        return chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         segment_ids=segment_ids, **options._asdict())

    _, vjp = jax.vjp(chunked, *differentiable)
    return (*vjp(cotangents), None)


_bounded_kda.defvjp(_bounded_kda_fwd, _bounded_kda_bwd)


_PATH = KernelPath(kernels="the Triton kernels", supported_dims=SUPPORTED_DIMS,
                   recurrence=kernel_recurrence, bounded_kda=_bounded_kda,
                   bounded_needs_equal_dims=False)


def triton_kda(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
               segment_ids=None, use_qk_l2norm=False, gate_lower_bound=None):
    """KDA by the Triton kernels; arguments and results as `kda.reference.kda_reference`, with
    K and V in {64, 128}. With `gate_lower_bound` set the chunk preparation is a kernel too;
    otherwise it is plain JAX. Differentiable (the backward is plain JAX: module docstring)."""
    return kernel_kda(_PATH, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, segment_ids=segment_ids,
                      use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound)


MIN_COMPUTE_CAPABILITY = 8.0  # bf16 mma: Ampere and later


def _on_ampere_or_later() -> bool:
    """Whether the default GPU is an NVIDIA GPU of compute capability >= 8.0."""
    try:  # CUDA devices report e.g. "9.0"; other GPUs report none or another format
        return float(compute_capability() or "") >= MIN_COMPUTE_CAPABILITY
    except ValueError:
        return False


@functools.cache
def _jax_triton_importable() -> bool:
    try:
        importlib.import_module("jax_triton")
    except ImportError:  # not installed, or installed with a jaxlib without CUDA
        return False
    return True


def supports(call: KDACall) -> bool:
    """The calls `tests/kda/kernels/test_triton.py` covers on the GPU: bfloat16, K = V in {64,
    128}, on an NVIDIA GPU of compute capability >= 8.0 with jax-triton installed
    (`pip install k3-jax[gpu]`).

    Any gate (bounded: both kernels; unbounded: plain-JAX preparation), grouped value heads,
    initial and final states, L2-normalised q/k, packed documents and any T.
    """
    return (call.backend == "gpu"
            and covers_call_shapes(call, SUPPORTED_DIMS)
            and _on_ampere_or_later()
            and _jax_triton_importable())


# Opt-in (impl="triton"): on Hopper `auto` takes the faster mosaic_gpu path, and the GPUs this
# path is for (Ampere, Ada) have not run its GPU tests.
register_kernel(NAME, triton_kda, supports, auto=False)
