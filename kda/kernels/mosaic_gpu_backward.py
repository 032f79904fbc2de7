"""The backward of KDA's recurrence over chunks: a reversed Mosaic GPU kernel (Hopper), then
batched matmuls that are parallel over chunks.

Per chunk n of one (batch row, value head), the forward (`kda.chunked.chunk_recurrence`) is, with
S_n the state entering chunk n:

    V_new_n = U_n - W_n S_n
    O_n     = Qs_n S_n + Aqk_n V_new_n               (Qs = q_from_state)
    S_{n+1} = D_n * S_n + Kt_n^T V_new_n             (D = chunk_decay, Kt = k_to_state)

Its VJP carries dS, the cotangent of the state, from the last chunk to the first (dS_N is the
final-state cotangent; P_n = Aqk_n^T dO_n):

    dV_new_n = P_n + Kt_n dS_{n+1}
    dS_n     = D_n * dS_{n+1} + Qs_n^T dO_n - W_n^T dV_new_n

The reversed kernel runs this recurrence like the forward kernel runs its own: one program per
(batch row, value head, 64-column V tile) keeps `dS [K, 64]` in float32 registers; per chunk, with
the chunk's inputs streaming in by TMA while the previous chunk computes (`plgpu.emit_pipeline`,
two stages, chunks in reverse order), four wgmmas (M = C = 64, or K for the state):

    dV_new = Aqk^T dO + Kt dS                    [C, C] x [C, 64]  +  [C, K] x [K, 64]
    dS     = D * dS + Qs^T dO + W^T (-dV_new)    [K, C] x [C, 64]  +  [K, C] x [C, 64]

(the transposed operands are transposed views of the forward's SMEM tiles). It writes dS_{n+1}
per chunk (bf16, as FLA and jax-linear-attention keep it), dV_new per chunk (float32, or bf16
where every consumer rounds it so) and dS_0 (float32). Every other cotangent contracts over V,
which the programs split, so it is left to batched matmuls over all chunks at once
(`recurrence_cotangents`):

    dU = dV_new,  dW = -dV_new S_n^T,  dQs = dO S_n^T,  dAqk = dO V_new^T,
    dKt = V_new dS_{n+1}^T,  dD = sum over V of S_n * dS_{n+1}

with S_n and V_new_n the bf16 operands the forward kernel used (`RecurrenceResiduals`, written by
`kda.kernels.mosaic_gpu_recurrence.run_recurrence(..., save_for_backward=True)`). The cotangents a
consumer rounds to bf16 anyway (the preparation-backward kernels: dW, dU and dAqk, their
`ROUNDED_COTANGENTS`) can come out in bf16, rounded once from the float32 accumulation, which
gives the consumer the same operands in half the bytes written and read (dQs, dKt and dD stay
float32: the kernels use them so).

Numerics: matmul operands bf16 (dO, dS and -dV_new rounded when written to SMEM), accumulation
and the carried dS float32, D read in float32.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import ChunkedInputs
from kda.kernels.mosaic_gpu_common import (OPERAND_DTYPE, RecurrenceOperands, RecurrenceResiduals,
                                           load_state_tile, lowered_once, swizzled,
                                           swizzled_smem)

# The backward's own V tile, chosen as the forward's: dS [K, 64] float32 is 64 registers a thread
# at K = 128.
BLOCK_V = 64
PIPELINE_STAGES = 2


def _reversed_chunk_block(shape, dtype, num_chunks):
    """Chunk N-1-i's tile of a [N, *shape] array, fetched into swizzled SMEM at pipeline step i."""
    transforms = swizzled(shape, dtype) if len(shape) == 2 else ()
    return plgpu.BlockSpec((None, *shape), lambda i: (num_chunks - 1 - i,) + (0,) * len(shape),
                           transforms=transforms)


def _reversed_recurrence_kernel(w_gmem, q_gmem, kt_gmem, a_gmem, decay_gmem, d_o_gmem,
                                d_final_gmem, d_states_gmem, d_v_new_gmem, d_initial_gmem):
    """The body of one (batch row, value head, V tile) program; see the module docstring.

    GMEM inputs: w, q [B, HV, N, C, K], kt [B, HV, N, K, C], a [B, HV, N, C, C] and
    d_o [B, HV, N, C, V] in bfloat16; decay [B, HV, N, K] and d_final [B, HV, K, V] in float32.
    Outputs: d_states [B, HV, N, K, V] (dS_{n+1}, bf16), d_v_new [B, HV, N, C, V] (float32 or
    bf16) and d_initial [B, HV, K, V] (float32).
    """
    num_chunks, chunk, key_dim = w_gmem.shape[2:]
    batch, head, v_tile = (lax.axis_index(axis) for axis in ("batch", "heads", "v_tiles"))
    columns = pl.ds(v_tile * BLOCK_V, BLOCK_V)
    state_shape, values_shape = (key_dim, BLOCK_V), (chunk, BLOCK_V)

    d_final_state = load_state_tile(d_final_gmem.at[batch, head, :, columns], state_shape)

    def recur(d_state_smem, minus_d_v_new_smem, d_v_new_smem):
        def chunk_step(indices, w, q, kt, a, decay, d_o, d_state):
            n = num_chunks - 1 - indices[0]

            def products(d_v_new_acc, d_state_acc):
                # The products of dO need no dS: they run while dS is written for the next one.
                plgpu.wgmma(d_v_new_acc, a.T, d_o)
                plgpu.wgmma(d_state_acc, q.T, d_o)
                # A step issues two copies to GMEM, dS then dV_new: waiting until at most one is
                # pending frees the buffer of the other one of the previous step.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                d_state_smem[...] = d_state.astype(OPERAND_DTYPE)
                plgpu.commit_smem()  # fences the store for wgmma and TMA
                plgpu.copy_smem_to_gmem(d_state_smem,
                                        d_states_gmem.at[batch, head, n, :, columns])
                plgpu.wgmma(d_v_new_acc, kt.T, d_state_smem)
                # Formed once dS is stored, so that dS and its decayed copy are not both live.
                decayed = d_state * lax.broadcast_in_dim(decay[...], state_shape, (0,))
                d_v_new = d_v_new_acc[...]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                minus_d_v_new_smem[...] = (-d_v_new).astype(OPERAND_DTYPE)
                d_v_new_smem[...] = d_v_new.astype(d_v_new_smem.dtype)
                # Fences the stores for wgmma and TMA, and orders the plain load of `decay`
                # before the TMA that refills this pipeline slot after the step.
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(d_v_new_smem,
                                        d_v_new_gmem.at[batch, head, n, :, columns])
                plgpu.wgmma(d_state_acc, w.T, minus_d_v_new_smem)
                return decayed + d_state_acc[...]

            return pl.run_scoped(products, plgpu.ACC(values_shape), plgpu.ACC(state_shape))

        pipeline = plgpu.emit_pipeline(
            chunk_step,
            grid=(num_chunks,),
            in_specs=[
                _reversed_chunk_block((chunk, key_dim), OPERAND_DTYPE, num_chunks),  # W
                _reversed_chunk_block((chunk, key_dim), OPERAND_DTYPE, num_chunks),  # Qs
                _reversed_chunk_block((key_dim, chunk), OPERAND_DTYPE, num_chunks),  # Kt^T
                _reversed_chunk_block((chunk, chunk), OPERAND_DTYPE, num_chunks),  # Aqk
                _reversed_chunk_block((key_dim,), jnp.float32, num_chunks),  # chunk_decay
                _reversed_chunk_block(values_shape, OPERAND_DTYPE, num_chunks),  # dO
            ],
            max_concurrent_steps=PIPELINE_STAGES,
            init_carry=d_final_state,
        )
        return pipeline(w_gmem.at[batch, head], q_gmem.at[batch, head], kt_gmem.at[batch, head],
                        a_gmem.at[batch, head], decay_gmem.at[batch, head],
                        d_o_gmem.at[batch, head, :, :, columns])

    d_initial_state = pl.run_scoped(
        recur, swizzled_smem(state_shape, OPERAND_DTYPE),
        swizzled_smem(values_shape, OPERAND_DTYPE),
        swizzled_smem(values_shape, d_v_new_gmem.dtype))

    def store_initial_cotangent(state_smem):
        plgpu.wait_smem_to_gmem(0)  # the last chunk's outputs are out
        state_smem[...] = d_initial_state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, d_initial_gmem.at[batch, head, :, columns])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_initial_cotangent, swizzled_smem(state_shape, jnp.float32))


@lowered_once("d_v_new_dtype")
def run_reversed_recurrence(operands: RecurrenceOperands, d_o, d_final_state,
                            d_v_new_dtype=jnp.float32):
    """Runs the reversed kernel (reads every operand but U).

    Args:
      operands: the forward's `RecurrenceOperands` [B, HV, N, ...] (U may be None).
      d_o: [B, HV, N, C, V], the cotangent of the chunk outputs.
      d_final_state: [B, HV, K, V], the cotangent of the final state.
      d_v_new_dtype: float32, or bf16 where every consumer of dV_new rounds it to bf16.
    Returns:
      (d_states bf16 [B, HV, N, K, V]: dS_{n+1} for chunk n, d_v_new [B, HV, N, C, V] in
      d_v_new_dtype, d_initial_state float32 [B, HV, K, V]).
    """
    batch, heads, num_chunks, chunk, key_dim = operands.W.shape
    value_dim = d_o.shape[-1]
    run = plgpu.kernel(
        _reversed_recurrence_kernel,
        out_type=(
            jax.ShapeDtypeStruct((batch, heads, num_chunks, key_dim, value_dim), OPERAND_DTYPE),
            jax.ShapeDtypeStruct((batch, heads, num_chunks, chunk, value_dim), d_v_new_dtype),
            jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32)),
        grid=(batch, heads, value_dim // BLOCK_V),
        grid_names=("batch", "heads", "v_tiles"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return run(operands.W, operands.q_from_state, operands.k_to_state_t, operands.Aqk,
               operands.chunk_decay, d_o.astype(OPERAND_DTYPE),
               d_final_state.astype(jnp.float32))


def _products(subscripts, x, y, dtype):
    """A batched bf16 matmul with float32 accumulation (the wgmma numerics, on XLA's GEMMs), its
    result in dtype (float32, or bf16: rounded once from the float32 sums)."""
    return jnp.einsum(subscripts, x.astype(OPERAND_DTYPE), y.astype(OPERAND_DTYPE),
                      preferred_element_type=dtype)


def recurrence_cotangents(residuals: RecurrenceResiduals, d_o, d_states, d_v_new,
                          rounded=()) -> ChunkedInputs:
    """The cotangents of the recurrence's inputs, parallel over chunks.

    Args:
      residuals: the forward's S_n and V_new_n.
      d_o: [B, HV, N, C, V]; d_states: dS_{n+1} [B, HV, N, K, V]; d_v_new: [B, HV, N, C, V].
      rounded: the `ChunkedInputs` fields whose cotangents the consumer rounds to bf16 anyway
        (module docstring): given in bf16.
    Returns:
      `ChunkedInputs` of cotangents, bf16 where `rounded` names them, else float32 (k_to_state
      [B, HV, N, C, K], not transposed).
    """
    states, v_new = residuals
    dtype = {name: OPERAND_DTYPE if name in rounded else jnp.float32
             for name in ChunkedInputs._fields}
    return ChunkedInputs(
        # bf16 negation is exact: -dV_new rounds as dV_new does.
        W=_products("...cv,...kv->...ck", -d_v_new, states, dtype["W"]),
        U=d_v_new.astype(dtype["U"]),
        q_from_state=_products("...cv,...kv->...ck", d_o, states, dtype["q_from_state"]),
        k_to_state=_products("...cv,...kv->...ck", v_new, d_states, dtype["k_to_state"]),
        chunk_decay=jnp.sum(states.astype(jnp.float32) * d_states.astype(jnp.float32),
                            axis=-1).astype(dtype["chunk_decay"]),
        Aqk=_products("...iv,...jv->...ij", d_o, v_new, dtype["Aqk"]))
