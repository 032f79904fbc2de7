"""Pallas Mosaic GPU kernels (Hopper) for KDA's chunked op, and their kernel path.

Two kernels, each replacing one half of the chunked op (`kda.chunked`):

* the recurrence over chunks (this module), which replaces `kda.chunked.chunk_recurrence`;
* the chunk preparation with bounded gates (`kda.kernels.mosaic_gpu_prepare`), which replaces
  `kda.chunked.prepare_chunks` when `gate_lower_bound` is set and writes the recurrence kernel's
  operands directly. With unbounded gates the preparation stays in plain JAX.

The recurrence's backward is a kernel too (`kda.kernels.mosaic_gpu_backward`, see Backward).

The recurrence kernel runs one program per (batch row, value head, 64-column V tile); it keeps
its float32 state tile `S [K, 64]` in registers across all chunks and, per chunk of C = 64 tokens,
computes with wgmma (M = 64 = C, or K for the state update):

    V_new = U - W S                              [C, K] x [K, 64]
    O     = q_from_state S + Aqk V_new           [C, K] x [K, 64]  +  [C, C] x [C, 64]
    S     = chunk_decay * S + k_to_state^T V_new [K, C] x [C, 64]

Numerics: matmul operands are bfloat16 (W, q_from_state, k_to_state and Aqk are rounded once
when they are handed to the kernel; S and V_new each time they are written to shared memory for
the next wgmma), accumulation and the carried state are float32, U and chunk_decay are read in
float32. Inputs of the next chunk stream in by TMA while the current chunk computes
(`plgpu.emit_pipeline`, two stages); outputs leave through a double buffer in shared memory.

Backward (`jax.custom_vjp`s): for training the forward kernel also writes what the backward
reads (`save_for_backward`): the state entering each chunk and V_new, the bf16 wgmma operands it
used (two TMA stores a chunk from shared memory it fills anyway). The recurrence's VJP is then
the reversed recurrence kernel and batched matmuls over all chunks
(`kda.kernels.mosaic_gpu_backward.recurrence_vjp`). With unbounded gates JAX differentiates the
plain-JAX preparation around it (`kernel_recurrence`); with bounded gates (`_bounded_kda`) the
forward keeps the preparation kernel's operands, and the backward maps the recurrence's
cotangents through `prepare_chunks_vjp`, for now the VJP of the plain-JAX `prepare_chunks`
(recomputed from the inputs): the preparation's backward is not a kernel yet.

Importing this module registers `impl="mosaic_gpu"` with `kda.api`; it imports on any backend.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.api import KDACall, register_kernel
from kda.chunked import CHUNK_SIZE, ChunkedInputs, chunk_kda_with_recurrence, prepare_chunks
from kda.kernels.mosaic_gpu_backward import RecurrenceResiduals, recurrence_vjp
from kda.kernels.mosaic_gpu_common import (OPERAND_DTYPE, RecurrenceOperands, swizzled,
                                           swizzled_smem)
from kda.kernels.mosaic_gpu_prepare import prepare_chunks_kernel

NAME = "mosaic_gpu"
# State columns per program: S [K, 64] float32 is 64 registers a thread at K = 128. 32 would halve
# that, but the 64-byte swizzle of a [K, 32] bf16 operand cannot pair with W's 128-byte one.
BLOCK_V = 64
SUPPORTED_DIMS = (64, 128)  # K and V; K = 256 would not fit two pipeline stages in shared memory
PIPELINE_STAGES = 2



def _chunk_block(shape, dtype):
    """One chunk's tile of a [N, *shape] array, fetched into swizzled SMEM at pipeline step n."""
    transforms = swizzled(shape, dtype) if len(shape) == 2 else ()
    return plgpu.BlockSpec((None, *shape), lambda n: (n,) + (0,) * len(shape),
                           transforms=transforms)


def _recurrence_kernel(w_gmem, u_gmem, q_gmem, kt_gmem, a_gmem, decay_gmem, s0_gmem,
                       o_gmem, s_final_gmem, *saved_gmem):
    """The body of one (batch row, value head, V tile) program; see the module docstring.

    GMEM operands: w, q [B, HV, N, C, K], kt [B, HV, N, K, C] and a [B, HV, N, C, C] in bfloat16;
    u [B, HV, N, C, V], decay [B, HV, N, K] and s0 [B, HV, K, V] in float32.
    Outputs: o [B, HV, N, C, V] and s_final [B, HV, K, V] (float32), and when the backward needs
    them (`saved_gmem`, `RecurrenceResiduals`) the entering states [B, HV, N, K, V] and V_new
    [B, HV, N, C, V], both as the bf16 wgmma operands the forward used.
    """
    num_chunks, chunk, key_dim = w_gmem.shape[2:]
    batch, head, v_tile = (lax.axis_index(axis) for axis in ("batch", "heads", "v_tiles"))
    columns = pl.ds(v_tile * BLOCK_V, BLOCK_V)
    state_shape = (key_dim, BLOCK_V)
    saves = bool(saved_gmem)
    # Copies to GMEM a step issues, in order: [entering state, V_new,] output. Waiting until at
    # most m copies are pending frees the buffer of every copy issued before the last m.
    copies_per_step = 3 if saves else 1

    def load_initial_state(state_smem, barrier):
        plgpu.copy_gmem_to_smem(s0_gmem.at[batch, head, :, columns], state_smem, barrier)
        plgpu.barrier_wait(barrier)
        state = plgpu.load(state_smem, layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # the load is done before TMA reuses this memory for the pipeline
        return state

    initial_state = pl.run_scoped(load_initial_state, swizzled_smem(state_shape, jnp.float32),
                                  plgpu.Barrier())

    def save(smem, gmem, n):
        """Writes a bf16 operand of chunk n out for the backward."""
        plgpu.copy_smem_to_gmem(smem, gmem.at[batch, head, n, :, columns])

    def recur(state_smem, v_new_smem, o_smem):
        def chunk_step(indices, w, u, q, kt, a, decay, state):
            (n,) = indices
            if saves:  # the previous step's state copy is out
                plgpu.wait_smem_to_gmem(copies_per_step - 1, wait_read_only=True)
            state_smem[...] = state.astype(OPERAND_DTYPE)
            decayed_state = state * lax.broadcast_in_dim(decay[...], state_shape, (0,))
            # Fences the stores for wgmma, and orders the plain load of `decay` (like the one of
            # `u` below) before the TMA that refills this pipeline slot after the step.
            plgpu.commit_smem()
            if saves:
                save(state_smem, saved_gmem[0], n)

            def reads_of_state(ws_acc, o_acc, update_acc):
                plgpu.wgmma(ws_acc, w, state_smem)
                plgpu.wgmma(o_acc, q, state_smem)  # in flight while V_new is formed
                v_new = u[...] - plgpu.wgmma_accumulator_load(ws_acc, wait_n=1)
                if saves:  # the previous step's V_new copy is out
                    plgpu.wait_smem_to_gmem(copies_per_step - 1, wait_read_only=True)
                v_new_smem[...] = v_new.astype(OPERAND_DTYPE)
                plgpu.commit_smem()
                if saves:
                    save(v_new_smem, saved_gmem[1], n)
                plgpu.wgmma(o_acc, a, v_new_smem)
                plgpu.wgmma(update_acc, kt, v_new_smem)
                return o_acc[...], update_acc[...]

            o, update = pl.run_scoped(
                reads_of_state, plgpu.ACC((chunk, BLOCK_V)), plgpu.ACC((chunk, BLOCK_V)),
                plgpu.ACC(state_shape))
            slot = o_smem.at[lax.rem(n, 2)]
            # This slot's previous copy (two steps ago) is out.
            plgpu.wait_smem_to_gmem(copies_per_step, wait_read_only=True)
            slot[...] = o.astype(slot.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slot, o_gmem.at[batch, head, n, :, columns])
            return decayed_state + update

        pipeline = plgpu.emit_pipeline(
            chunk_step,
            grid=(num_chunks,),
            in_specs=[
                _chunk_block((chunk, key_dim), OPERAND_DTYPE),  # W
                _chunk_block((chunk, BLOCK_V), jnp.float32),  # U
                _chunk_block((chunk, key_dim), OPERAND_DTYPE),  # q_from_state
                _chunk_block((key_dim, chunk), OPERAND_DTYPE),  # k_to_state^T
                _chunk_block((chunk, chunk), OPERAND_DTYPE),  # Aqk
                _chunk_block((key_dim,), jnp.float32),  # chunk_decay
            ],
            max_concurrent_steps=PIPELINE_STAGES,
            init_carry=initial_state,
        )
        return pipeline(w_gmem.at[batch, head], u_gmem.at[batch, head, :, :, columns],
                        q_gmem.at[batch, head], kt_gmem.at[batch, head], a_gmem.at[batch, head],
                        decay_gmem.at[batch, head])

    final_state = pl.run_scoped(
        recur, swizzled_smem(state_shape, OPERAND_DTYPE),
        swizzled_smem((chunk, BLOCK_V), OPERAND_DTYPE),
        swizzled_smem((2, chunk, BLOCK_V), o_gmem.dtype))

    def store_final_state(state_smem):
        plgpu.wait_smem_to_gmem(0)  # the last outputs are out
        state_smem[...] = final_state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, s_final_gmem.at[batch, head, :, columns])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_final_state, swizzled_smem(state_shape, jnp.float32))


def recurrence_operands(chunks: ChunkedInputs) -> RecurrenceOperands:
    """The kernel's operands from the plain-JAX preparation: bf16 matmul operands, k transposed."""
    as_operand = lambda x: x.astype(OPERAND_DTYPE)  # noqa: E731
    return RecurrenceOperands(
        W=as_operand(chunks.W), U=chunks.U.astype(jnp.float32),
        q_from_state=as_operand(chunks.q_from_state),
        k_to_state_t=as_operand(jnp.swapaxes(chunks.k_to_state, -1, -2)),
        Aqk=as_operand(chunks.Aqk), chunk_decay=chunks.chunk_decay.astype(jnp.float32))


def run_recurrence(operands: RecurrenceOperands, initial_state, out_dtype, *,
                   save_for_backward=False):
    """Runs the kernel: (o [B, HV, N, C, V] in out_dtype, final_state float32 [B, HV, K, V]).

    With `save_for_backward`, also returns the `RecurrenceResiduals` the backward reads (the
    entering states and V_new, which the kernel then writes as it goes) as a third result.
    """
    batch, heads, num_chunks, chunk, key_dim = operands.W.shape
    value_dim = operands.U.shape[-1]
    chunked = lambda *tail: (batch, heads, num_chunks, *tail)  # noqa: E731
    out_type = (jax.ShapeDtypeStruct(chunked(chunk, value_dim), out_dtype),
                jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32))
    if save_for_backward:
        out_type += RecurrenceResiduals(
            states=jax.ShapeDtypeStruct(chunked(key_dim, value_dim), OPERAND_DTYPE),
            v_new=jax.ShapeDtypeStruct(chunked(chunk, value_dim), OPERAND_DTYPE))
    run = plgpu.kernel(
        _recurrence_kernel,
        out_type=out_type,
        grid=(batch, heads, value_dim // BLOCK_V),
        grid_names=("batch", "heads", "v_tiles"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    o, final_state, *saved = run(*operands, initial_state.astype(jnp.float32))
    if save_for_backward:
        return o, final_state, RecurrenceResiduals(*saved)
    return o, final_state


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
    return run_recurrence(recurrence_operands(chunks), initial_state, out_dtype)


def _kernel_recurrence_fwd(chunks, initial_state, out_dtype):
    operands = recurrence_operands(chunks)
    o, final_state, residuals = run_recurrence(operands, initial_state, out_dtype,
                                               save_for_backward=True)
    return (o, final_state), (operands._replace(U=None), residuals)  # the backward reads no U


def _kernel_recurrence_bwd(out_dtype, saved, cotangents):
    """The reversed kernel and the parallel cotangents (`kda.kernels.mosaic_gpu_backward`)."""
    del out_dtype
    operands, residuals = saved
    return recurrence_vjp(operands, residuals, *cotangents)


kernel_recurrence.defvjp(_kernel_recurrence_fwd, _kernel_recurrence_bwd)


class _BoundedOptions(NamedTuple):
    """The static arguments of `_bounded_kda` (hashable, for `nondiff_argnums`)."""

    scale: float
    use_qk_l2norm: bool
    gate_lower_bound: float


def prepare_chunks_vjp(q, k, v, g, beta, segment_ids, options: _BoundedOptions,
                       cotangents: ChunkedInputs):
    """The VJP of the chunk preparation (chunk 64): the cotangents of the recurrence's inputs
    (float32 `ChunkedInputs`, k_to_state [C, K] not transposed) -> (dq, dk, dv, dg, dbeta).

    For now the VJP of the plain-JAX `prepare_chunks`, recomputed from the inputs.
    """

    def prepare(q, k, v, g, beta):
        return prepare_chunks(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=CHUNK_SIZE,
                              **options._asdict())

    _, vjp = jax.vjp(prepare, q, k, v, g, beta)
    return vjp(cotangents)


def _bounded_forward(q, k, v, g, beta, initial_state, segment_ids, options, save_for_backward):
    """Both kernels, preparation then recurrence: (o [B, T, HV, V], final_state [B, HV, K, V]),
    then, with `save_for_backward`, (operands, `RecurrenceResiduals`)."""
    batch, length, num_value_heads, value_dim = v.shape
    operands = prepare_chunks_kernel(q, k, v, g, beta, segment_ids=segment_ids,
                                     **options._asdict())
    o, final_state, *saved = run_recurrence(operands, initial_state, v.dtype,
                                            save_for_backward=save_for_backward)
    o = jnp.moveaxis(o, 1, 3).reshape(batch, -1, num_value_heads, value_dim)
    return (o[:, :length], final_state), (operands, *saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _bounded_kda(q, k, v, g, beta, initial_state, segment_ids, options: _BoundedOptions):
    """Both kernels, preparation then recurrence: (o [B, T, HV, V], final_state [B, HV, K, V])."""
    outputs, _ = _bounded_forward(q, k, v, g, beta, initial_state, segment_ids, options,
                                  save_for_backward=False)
    return outputs


def _bounded_kda_fwd(q, k, v, g, beta, initial_state, segment_ids, options):
    # The operands are kept rather than recomputed: the preparation kernel writes them to GMEM
    # anyway, so keeping them costs memory (U is dropped: the backward reads no U) but no time.
    outputs, (operands, residuals) = _bounded_forward(
        q, k, v, g, beta, initial_state, segment_ids, options, save_for_backward=True)
    return outputs, ((q, k, v, g, beta), segment_ids, operands._replace(U=None), residuals)


def _bounded_kda_bwd(options, saved, cotangents):
    """The recurrence's VJP by kernels, then the preparation's VJP (`prepare_chunks_vjp`)."""
    inputs, segment_ids, operands, residuals = saved
    d_o, d_final_state = cotangents
    batch, length, num_value_heads, value_dim = d_o.shape
    num_chunks = operands.W.shape[2]
    # The transpose of the forward's [B, HV, N, C, V] -> [B, T, HV, V]: zeros for the padding.
    d_o = jnp.pad(d_o, ((0, 0), (0, num_chunks * CHUNK_SIZE - length), (0, 0), (0, 0)))
    d_o = jnp.moveaxis(d_o.reshape(batch, num_chunks, CHUNK_SIZE, num_value_heads, value_dim),
                       3, 1)
    d_chunks, d_initial_state = recurrence_vjp(operands, residuals, d_o, d_final_state)
    return (*prepare_chunks_vjp(*inputs, segment_ids, options, d_chunks), d_initial_state, None)


_bounded_kda.defvjp(_bounded_kda_fwd, _bounded_kda_bwd)


def mosaic_gpu_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state=None,
    output_final_state=False,
    segment_ids=None,
    use_qk_l2norm=False,
    gate_lower_bound=None,
):
    """KDA by the Mosaic GPU kernels; arguments and results as `kda.reference.kda_reference`, with
    K and V in {64, 128}. With `gate_lower_bound` set and K = V the chunk preparation is a kernel
    too; otherwise it is plain JAX. Differentiable (see the module docstring: the recurrence's
    backward is a kernel, the preparation's is plain JAX)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    if key_dim not in SUPPORTED_DIMS or value_dim not in SUPPORTED_DIMS:
        raise ValueError(
            f"the Mosaic GPU kernel needs K and V in {SUPPORTED_DIMS}, got K={key_dim}, "
            f"V={value_dim}; use impl='chunked' for other head sizes")
    if gate_lower_bound is None or key_dim != value_dim:
        return chunk_kda_with_recurrence(
            kernel_recurrence, q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids,
            use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound,
            chunk_size=CHUNK_SIZE)
    batch, _, num_value_heads, _ = v.shape
    if initial_state is None:
        initial_state = jnp.zeros((batch, num_value_heads, key_dim, value_dim), jnp.float32)
    o, final_state = _bounded_kda(
        q, k, v, g, beta, initial_state.astype(jnp.float32), segment_ids,
        _BoundedOptions(float(scale), bool(use_qk_l2norm), float(gate_lower_bound)))
    return o, (final_state if output_final_state else None)


def _on_hopper() -> bool:
    """Whether the default GPU is a Hopper chip (compute capability 9.0: H100, H200, H800)."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return getattr(device, "compute_capability", None) == "9.0"


def supports(call: KDACall) -> bool:
    """The calls `tests/test_kda_kernels.py` covers: bfloat16 on a Hopper GPU, K = V in {64, 128}.

    Any gate (bounded: both kernels; unbounded: plain-JAX preparation), grouped value heads,
    initial and final states, L2-normalised q/k, packed documents and any T are covered.
    """
    return (call.backend == "gpu"
            and call.dtype == jnp.bfloat16
            and call.key_dim == call.value_dim
            and call.key_dim in SUPPORTED_DIMS
            and _on_hopper())


register_kernel(NAME, mosaic_gpu_kda, supports)
