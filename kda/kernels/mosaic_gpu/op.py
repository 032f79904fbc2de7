"""KDA's Mosaic GPU kernel path (Hopper): the kernels composed, differentiable, registered.

Forward, two kernels, each replacing one half of the chunked op (`kda.chunked`):

* the chunk preparation with bounded gates (`kda.kernels.mosaic_gpu.prepare`), which replaces
  `kda.chunked.prepare_chunks` when `gate_lower_bound` is set and writes the recurrence kernel's
  operands directly (with unbounded gates the preparation stays in plain JAX);
* the recurrence over chunks (`kda.kernels.mosaic_gpu.recurrence`), run over segments of the
  sequence side by side where the grid would leave SMs idle and that pays for the split's extra
  passes (`kda.kernels.mosaic_gpu.sequence_parallel`).

Backward (`jax.custom_vjp`s): the forward recurrence also writes the state entering each chunk
and V_new; the recurrence's VJP (`recurrence_vjp`) is the reversed recurrence kernel
(`kda.kernels.mosaic_gpu.reversed_recurrence`) and one kernel over all chunks for the cotangents
that contract over V (`kda.kernels.mosaic_gpu.recurrence_cotangents`).

* Unbounded gates (`kernel_recurrence`): JAX differentiates the plain-JAX preparation around it.
* Bounded gates (`_bounded_kda`): the forward keeps the preparation kernel's operands and what
  that kernel saves for its backward (`PreparationResiduals`: G, Akk and the inverse, written only
  when a backward will run); the backward maps the recurrence's cotangents through the
  preparation-backward kernels (`kda.kernels.mosaic_gpu.prepare_backward`), those that the kernels
  round to bf16 anyway (`ROUNDED_COTANGENTS`) handed over in bf16. The recurrence kernel writes o
  token-major, [B, N 64, HV, V] (the model's layout, cut to T), and both kernels of its VJP read
  the cotangent in that layout (padded to N 64 where T is not a multiple of 64), so neither
  direction transposes o in XLA.

Importing this module registers `impl="mosaic_gpu"` with `kda.api`; it imports on any backend.
"""

import functools

import jax
import jax.numpy as jnp

from kda.api import KDACall, register_kernel
from kda.chunked import CHUNK_SIZE, ChunkedInputs
from kda.kernels.mosaic_gpu.common import (SUPPORTED_DIMS, RecurrenceOperands,
                                           RecurrenceResiduals, cotangent_dtypes,
                                           recurrence_operands)
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.prepare_backward import ROUNDED_COTANGENTS, prepare_chunks_vjp_kernel
from kda.kernels.mosaic_gpu.recurrence_cotangents import chunk_cotangents
from kda.kernels.mosaic_gpu.sequence_parallel import (sequence_parallel_recurrence,
                                                      sequence_parallel_reversed_recurrence)
from kda.kernels.path import (BoundedOptions, KernelPath, compute_capability, covers_call_shapes,
                              kernel_kda)

NAME = "mosaic_gpu"


def recurrence_vjp(operands: RecurrenceOperands, residuals: RecurrenceResiduals, d_o,
                   d_final_state, rounded=()):
    """The VJP of the recurrence over chunks: the reversed kernel (over segments of the sequence
    side by side where the forward's choice of P splits it,
    `kda.kernels.mosaic_gpu.sequence_parallel`), then the parallel cotangents in one pass
    (`kda.kernels.mosaic_gpu.recurrence_cotangents`).

    Args:
      operands: the forward's `RecurrenceOperands` (U is not read and may be None).
      residuals: what the forward kernel saved for the backward.
      d_o: [B, HV, N, C, V], or token-major, [B, N C, HV, V] (the forward kernel's o with
        `token_major`): both kernels read that layout as it is.
      d_final_state: [B, HV, K, V].
      rounded: the `ChunkedInputs` fields whose cotangents the consumer rounds to bf16 anyway:
        given in bf16 (the same gradients, half the bytes).
    Returns:
      (`ChunkedInputs` of cotangents, d_initial_state float32 [B, HV, K, V]): what
      `jax.vjp(kda.chunked.chunk_recurrence, chunks, initial_state)` returns, float32 but where
      `rounded` names them.
    """
    d_states, d_v_new, d_initial_state = sequence_parallel_reversed_recurrence(
        operands, d_o, d_final_state, d_v_new_dtype=cotangent_dtypes(rounded)["U"])
    return chunk_cotangents(residuals, d_o, d_states, d_v_new, rounded), d_initial_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def kernel_recurrence(chunks: ChunkedInputs, initial_state, out_dtype):
    """`kda.chunked.chunk_recurrence` by the Mosaic GPU kernels (same contract; bf16 operands).

    Args:
      chunks: float32 `ChunkedInputs` [B, HV, N, 64, ...] with K and V in {64, 128}.
      initial_state: float32 [B, HV, K, V].
      out_dtype: dtype of the chunk outputs.
    Returns:
      (o [B, HV, N, 64, V] in out_dtype, final_state float32 [B, HV, K, V]).
    """
    return sequence_parallel_recurrence(recurrence_operands(chunks), initial_state, out_dtype)


def _kernel_recurrence_fwd(chunks, initial_state, out_dtype):
    operands = recurrence_operands(chunks)
    o, final_state, residuals = sequence_parallel_recurrence(operands, initial_state, out_dtype,
                                                             save_for_backward=True)
    return (o, final_state), (operands._replace(U=None), residuals)  # the backward reads no U


def _kernel_recurrence_bwd(out_dtype, saved, cotangents):
    """The reversed kernel and the parallel cotangents (`recurrence_vjp`)."""
    del out_dtype
    operands, residuals = saved
    return recurrence_vjp(operands, residuals, *cotangents)


kernel_recurrence.defvjp(_kernel_recurrence_fwd, _kernel_recurrence_bwd)


def _bounded_forward(q, k, v, g, beta, initial_state, segment_ids, options, save_for_backward):
    """Both kernels, preparation then recurrence: (o [B, T, HV, V], final_state [B, HV, K, V]),
    then (operands, `PreparationResiduals`, `RecurrenceResiduals`), the residuals only with
    `save_for_backward` (else None and nothing: neither kernel writes them)."""
    length = v.shape[1]
    prepare = functools.partial(prepare_chunks_kernel, q, k, v, g, beta, segment_ids=segment_ids,
                                **options._asdict())
    if save_for_backward:
        operands, preparation_residuals = prepare(save_for_backward=True)
    else:
        operands, preparation_residuals = prepare(), None
    o, final_state, *recurrence_residuals = sequence_parallel_recurrence(
        operands, initial_state, v.dtype, save_for_backward=save_for_backward, token_major=True)
    return (o[:, :length], final_state), (operands, preparation_residuals, *recurrence_residuals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _bounded_kda(q, k, v, g, beta, initial_state, segment_ids, options: BoundedOptions):
    """Both kernels, preparation then recurrence: (o [B, T, HV, V], final_state [B, HV, K, V]).
    initial_state: float32 [B, HV, K, V], or None for zeros (the recurrence kernel reads none)."""
    outputs, _ = _bounded_forward(q, k, v, g, beta, initial_state, segment_ids, options,
                                  save_for_backward=False)
    return outputs


def _bounded_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, options):
    # The operands are kept rather than recomputed: the preparation kernel writes them to GMEM
    # anyway, so keeping them costs memory (U is dropped: the backward reads no U) but no time.
    # Its residuals cost both, and are written only here.
    outputs, (operands, preparation_residuals, recurrence_residuals) = _bounded_forward(
        q, k, v, g, beta, initial_state, segment_ids, options, save_for_backward=True)
    return outputs, ((q, k, v, g, beta), segment_ids, initial_state is not None,
                     operands._replace(U=None), preparation_residuals, recurrence_residuals)


def _bounded_kda_bwd(options, saved, cotangents):
    """The recurrence's VJP by kernels, then the preparation's VJP by kernels."""
    (inputs, segment_ids, has_initial_state, operands, preparation_residuals,
     recurrence_residuals) = saved
    d_o, d_final_state = cotangents
    # The kernels read d_o token-major, as the forward wrote o; the padding the forward cut off
    # gets zeros (a pass only where T is not a multiple of 64).
    padding = operands.W.shape[2] * CHUNK_SIZE - d_o.shape[1]
    if padding:
        d_o = jnp.pad(d_o, ((0, 0), (0, padding), (0, 0), (0, 0)))
    d_chunks, d_initial_state = recurrence_vjp(operands, recurrence_residuals, d_o, d_final_state,
                                               rounded=ROUNDED_COTANGENTS)
    d_inputs = prepare_chunks_vjp_kernel(*inputs, segment_ids=segment_ids,
                                         residuals=preparation_residuals, cotangents=d_chunks,
                                         **options._asdict())
    return (*d_inputs, d_initial_state if has_initial_state else None, None)


_bounded_kda.defvjp(_bounded_kda_fwd, _bounded_kda_bwd)


_PATH = KernelPath(kernels="the Mosaic GPU kernels", supported_dims=SUPPORTED_DIMS,
                   recurrence=kernel_recurrence, bounded_kda=_bounded_kda,
                   bounded_needs_equal_dims=True)


def mosaic_gpu_kda(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
                   segment_ids=None, use_qk_l2norm=False, gate_lower_bound=None):
    """KDA by the Mosaic GPU kernels; arguments and results as `kda.reference.kda_reference`, with
    K and V in {64, 128}. With `gate_lower_bound` set and K = V the chunk preparation and its
    backward are kernels too; otherwise the preparation is plain JAX. Differentiable (module
    docstring)."""
    return kernel_kda(_PATH, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, segment_ids=segment_ids,
                      use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound)


def _on_hopper() -> bool:
    """Whether the default GPU is a Hopper chip (compute capability 9.0: H100, H200, H800)."""
    return compute_capability() == "9.0"


def supports(call: KDACall) -> bool:
    """The calls `tests/kda/kernels/test_mosaic_gpu.py` covers: bfloat16 on a Hopper GPU, K = V
    in {64, 128}.

    Any gate (bounded: both kernels; unbounded: plain-JAX preparation), grouped value heads,
    initial and final states, L2-normalised q/k, packed documents and any T are covered.
    """
    return call.backend == "gpu" and covers_shapes(call) and _on_hopper()


def covers_shapes(call: KDACall) -> bool:
    """What `supports` asks of the call itself, whatever the device: bfloat16, K = V in {64,
    128}."""
    return covers_call_shapes(call, SUPPORTED_DIMS)


register_kernel(NAME, mosaic_gpu_kda, supports)
