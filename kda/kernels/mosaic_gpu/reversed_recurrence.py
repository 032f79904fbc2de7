"""The backward of KDA's recurrence over chunks: a reversed Mosaic GPU kernel (Hopper), then
products that are parallel over chunks.

With S_n the state entering chunk n, the forward (`kda.chunked.chunk_recurrence`;
Qs = q_from_state, Kt = k_to_state, D = chunk_decay) and its VJP (dS_N: the final-state
cotangent) are, per chunk n of one (batch row, value head),

    V_new_n = U_n - W_n S_n,  O_n = Qs_n S_n + Aqk_n V_new_n,  S_{n+1} = D_n * S_n + Kt_n^T V_new_n
    dV_new_n = Aqk_n^T dO_n + Kt_n dS_{n+1},  dS_n = D_n * dS_{n+1} + Qs_n^T dO_n - W_n^T dV_new_n

`run_reversed_recurrence` runs the dS recurrence as the forward kernel runs its own: one program
per (batch row, value head, 64-column V tile), chunks in reverse, the next chunk's inputs loaded
by TMA (two stages) from a warpgroup of its own (`chunk_pipeline`). It carries `E = dS^T [64, K]`
(float32 registers), four wgmmas (M = 64) a chunk:

    dV_new^T = dO^T Aqk + E Kt^T                     [64, C] x [C, C]  +  [64, K] x [K, C]
    E        = E * D + dO^T Qs + (-dV_new^T) W        [64, C] x [C, K]  +  [64, C] x [C, K]

Transposed, E and dV_new^T are wgmma's left operands straight from registers: the chain from one
chunk's cotangent to the next passes through no SMEM, fence or barrier (the forward, transposed
alike, is slower: `recurrence` says why). dO^T is a view of dO's tile as TMA brings it, from
[B, HV, N, C, V] or from the token rows of [B, N C, HV, V], as the forward kernel writes o (no
transpose in XLA).

It writes dS_{n+1} (bf16, as FLA and jax-linear-attention keep it), dV_new (bf16 where every
consumer rounds it so, else float32) and dS_0 (float32), transposed on their way through SMEM;
Mosaic GPU transposes only 16-bit values there, so a float32 dV_new leaves value-major and dS_0
[B, HV, V, K], swapped back in XLA. The other cotangents contract over V, which the programs
split, so a pass parallel over chunks computes them (`recurrence_cotangents` in XLA here, its
kernel `kda.kernels.mosaic_gpu.recurrence_cotangents` on the kernel path) from the forward's bf16
S_n and V_new_n (`RecurrenceResiduals`):

    dU = dV_new,  dW = -dV_new S_n^T,  dQs = dO S_n^T,  dAqk = dO V_new^T,
    dKt = V_new dS_{n+1}^T,  dD = sum over V of S_n * dS_{n+1}

Numerics: bf16 matmul operands (dO as given, E and -dV_new^T rounded as they become operands),
float32 accumulation and carried cotangent, D in float32. dW, dU and dAqk, which the preparation
backward rounds to bf16 anyway (`ROUNDED_COTANGENTS`), can come out in bf16, rounded once.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import ChunkedInputs
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, WARPGROUP_AXIS, RecurrenceOperands,
                                           RecurrenceResiduals, check_output_cotangent,
                                           chunk_pipeline, cotangent_dtypes, kernel_body,
                                           load_state_tile, lowered_once, store_state_tile,
                                           swizzled, swizzled_smem)
from kda.kernels.mosaic_gpu.tiles import COLUMN_VECTOR, per_column

# The backward's own V tile, chosen as the forward's: dS^T [64, K] float32 is 64 registers a
# thread at K = 128.
BLOCK_V = 64
PIPELINE_STAGES = 2


def _reversed_chunk_block(shape, dtype, num_chunks):
    """Chunk N-1-i's tile of a [N, *shape] array, fetched into swizzled SMEM at pipeline step i."""
    transforms = swizzled(shape, dtype) if len(shape) == 2 else ()
    return plgpu.BlockSpec((None, *shape), lambda i: (num_chunks - 1 - i,) + (0,) * len(shape),
                           transforms=transforms)


def _reversed_recurrence_kernel(w_gmem, q_gmem, kt_gmem, a_gmem, decay_gmem, d_o_gmem,
                                d_final_t_gmem, d_states_gmem, d_v_new_gmem, d_initial_t_gmem,
                                *, value_major):
    """The body of one (batch row, value head, V tile) program; see the module docstring.

    GMEM inputs: w, q [B, HV, N, C, K], kt [B, HV, N, K, C], a [B, HV, N, C, C] and
    d_o [B, HV, N, C, V] (or token-major, [B, N C, HV, V], as the forward kernel writes o) in
    bfloat16; decay [B, HV, N, K] and d_final_t [B, HV, V, K] (the final-state cotangent,
    transposed) in float32.
    Outputs: d_states [B, HV, N, K, V] (dS_{n+1}, bf16), d_v_new [B, HV, N, C, V] (bf16) or,
    with `value_major` (float32), [B, HV, N, V, C], and d_initial_t [B, HV, V, K] (float32,
    transposed).
    """
    num_chunks, chunk, key_dim = w_gmem.shape[2:]
    batch, head, v_tile = (lax.axis_index(axis) for axis in ("batch", "heads", "v_tiles"))
    columns = pl.ds(v_tile * BLOCK_V, BLOCK_V)
    state_shape, values_shape = (BLOCK_V, key_dim), (BLOCK_V, chunk)
    # Token-major (the layout the forward writes o in, so that no transpose comes between),
    # chunk n of dO is block n of rows of this program's strided [N C, 64] view.
    if d_o_gmem.ndim == 4:
        d_o_spec = plgpu.BlockSpec((chunk, BLOCK_V), lambda i: (num_chunks - 1 - i, 0),
                                   transforms=swizzled((chunk, BLOCK_V), OPERAND_DTYPE))
        d_o_columns = d_o_gmem.at[batch, :, head, columns]
    else:
        d_o_spec = _reversed_chunk_block((chunk, BLOCK_V), OPERAND_DTYPE, num_chunks)
        d_o_columns = d_o_gmem.at[batch, head, :, :, columns]

    def d_v_new_tile(n):
        if value_major:
            return d_v_new_gmem.at[batch, head, n, columns]
        return d_v_new_gmem.at[batch, head, n, :, columns]

    def recur(buffers, d_state_f32_barrier):
        (d_state_smem, d_v_new_smem), d_state_f32_smem = buffers

        def chunk_step(indices, w, q, kt, a, decay, d_o, d_state_t):
            n = num_chunks - 1 - indices[0]
            d_state_operand = d_state_t.astype(OPERAND_DTYPE)
            decay_row = plgpu.load(decay, layout=COLUMN_VECTOR)
            d_o_t = d_o.transpose((1, 0))

            def products(d_v_new_acc, d_state_acc):
                # The products of dO need no dS: issued first, they run while dS^T is converted.
                plgpu.wgmma(d_state_acc, d_o_t, q)
                plgpu.wgmma(d_v_new_acc, d_o_t, a)
                plgpu.wgmma(d_v_new_acc, d_state_operand, kt)
                # A step issues two copies to GMEM, dS then dV_new: waiting until at most one is
                # pending frees the buffer of the other one of the previous step.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                d_state_smem.transpose((1, 0))[...] = d_state_operand
                # Fences the store for TMA, and orders the plain load of `decay` before the TMA
                # that refills this pipeline slot after the step.
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(d_state_smem,
                                        d_states_gmem.at[batch, head, n, :, columns])
                d_v_new_t = plgpu.wgmma_accumulator_load(d_v_new_acc)
                plgpu.wgmma(d_state_acc, (-d_v_new_t).astype(OPERAND_DTYPE), w)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                if value_major:
                    d_v_new_smem[...] = d_v_new_t
                else:
                    d_v_new_smem.transpose((1, 0))[...] = d_v_new_t.astype(d_v_new_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(d_v_new_smem, d_v_new_tile(n))
                return (d_state_t * per_column(decay_row, state_shape)
                        + plgpu.wgmma_accumulator_load(d_state_acc))

            return pl.run_scoped(products, plgpu.ACC(values_shape), plgpu.ACC(state_shape))

        def reversed_loop(run):
            """dS_N^T in, dS_0^T out, in the compute warpgroup (as all of the pipeline's
            `compute_context`)."""
            d_final_state_t = load_state_tile(d_final_t_gmem.at[batch, head, columns],
                                              d_state_f32_smem, d_state_f32_barrier)
            store_state_tile(run(d_final_state_t), d_initial_t_gmem.at[batch, head, columns],
                             d_state_f32_smem)

        in_specs = [
            _reversed_chunk_block((chunk, key_dim), OPERAND_DTYPE, num_chunks),  # W
            _reversed_chunk_block((chunk, key_dim), OPERAND_DTYPE, num_chunks),  # Qs
            _reversed_chunk_block((key_dim, chunk), OPERAND_DTYPE, num_chunks),  # Kt^T
            _reversed_chunk_block((chunk, chunk), OPERAND_DTYPE, num_chunks),  # Aqk
            _reversed_chunk_block((key_dim,), jnp.float32, num_chunks),  # chunk_decay
            d_o_spec,  # dO
        ]
        pipeline = chunk_pipeline(chunk_step, in_specs, num_chunks, PIPELINE_STAGES,
                                  compute_context=reversed_loop)
        pipeline(w_gmem.at[batch, head], q_gmem.at[batch, head], kt_gmem.at[batch, head],
                 a_gmem.at[batch, head], decay_gmem.at[batch, head], d_o_columns)

    pl.run_scoped(
        recur,
        # The loop's buffers: dS and dV_new on their way out; before and after the loop, the
        # float32 final-state cotangent and dS_0 (as the forward kernel's initial and final state).
        # A kernel of two warpgroups allocates its SMEM for both: sharing, 164,904 bytes at
        # K = V = 128 instead of 197,672.
        plgpu.RefUnion((swizzled_smem(state_shape[::-1], OPERAND_DTYPE),
                        swizzled_smem(values_shape if value_major else values_shape[::-1],
                                      d_v_new_gmem.dtype)),
                       swizzled_smem(state_shape, jnp.float32)),
        plgpu.Barrier(),
        collective_axes=WARPGROUP_AXIS)


@lowered_once("d_v_new_dtype")
def run_reversed_recurrence(operands: RecurrenceOperands, d_o, d_final_state,
                            d_v_new_dtype=jnp.float32):
    """Runs the reversed kernel (reads every operand but U).

    Args:
      operands: the forward's `RecurrenceOperands` [B, HV, N, ...] (U may be None).
      d_o: [B, HV, N, C, V], the cotangent of the chunk outputs, or the same token-major,
        [B, N C, HV, V] (as `run_recurrence(..., token_major=True)` writes o): the kernel reads
        each chunk's tile from its token rows.
      d_final_state: [B, HV, K, V], the cotangent of the final state.
      d_v_new_dtype: float32, or bf16 where every consumer of dV_new rounds it to bf16 (a float32
        dV_new comes out of the kernel value-major and is swapped here).
    Returns:
      (d_states bf16 [B, HV, N, K, V]: dS_{n+1} for chunk n, d_v_new [B, HV, N, C, V] in
      d_v_new_dtype, d_initial_state float32 [B, HV, K, V]).
    """
    batch, heads, num_chunks, chunk, key_dim = operands.W.shape
    value_dim = d_o.shape[-1]
    check_output_cotangent(d_o, (batch, heads, num_chunks, chunk, value_dim))
    value_major = jnp.dtype(d_v_new_dtype).itemsize != 2  # transposed stores take 16 bits only
    chunked = lambda *tail: (batch, heads, num_chunks, *tail)  # noqa: E731
    run = plgpu.kernel(
        kernel_body(_reversed_recurrence_kernel, value_major=value_major),
        out_type=(
            jax.ShapeDtypeStruct(chunked(key_dim, value_dim), OPERAND_DTYPE),
            jax.ShapeDtypeStruct(chunked(value_dim, chunk) if value_major
                                 else chunked(chunk, value_dim), d_v_new_dtype),
            jax.ShapeDtypeStruct((batch, heads, value_dim, key_dim), jnp.float32)),
        grid=(batch, heads, value_dim // BLOCK_V),
        grid_names=("batch", "heads", "v_tiles"),
        num_threads=2,
        thread_name=WARPGROUP_AXIS,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    d_states, d_v_new, d_initial_state_t = run(
        operands.W, operands.q_from_state, operands.k_to_state_t, operands.Aqk,
        operands.chunk_decay, d_o.astype(OPERAND_DTYPE),
        jnp.swapaxes(d_final_state.astype(jnp.float32), -1, -2))
    if value_major:
        d_v_new = jnp.swapaxes(d_v_new, -1, -2)
    return d_states, d_v_new, jnp.swapaxes(d_initial_state_t, -1, -2)


def _products(subscripts, x, y, dtype):
    """A batched bf16 matmul with float32 accumulation (the wgmma numerics, on XLA's GEMMs), its
    result in dtype (float32, or bf16: rounded once from the float32 sums)."""
    return jnp.einsum(subscripts, x.astype(OPERAND_DTYPE), y.astype(OPERAND_DTYPE),
                      preferred_element_type=dtype)


def recurrence_cotangents(residuals: RecurrenceResiduals, d_o, d_states, d_v_new,
                          rounded=()) -> ChunkedInputs:
    """The cotangents of the recurrence's inputs, parallel over chunks, by XLA's batched matmuls:
    the plain-JAX twin of `kda.kernels.mosaic_gpu.recurrence_cotangents.chunk_cotangents`, its
    oracle.

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
    dtype = cotangent_dtypes(rounded)
    return ChunkedInputs(
        # bf16 negation is exact: -dV_new rounds as dV_new does.
        W=_products("...cv,...kv->...ck", -d_v_new, states, dtype["W"]),
        U=d_v_new.astype(dtype["U"]),
        q_from_state=_products("...cv,...kv->...ck", d_o, states, dtype["q_from_state"]),
        k_to_state=_products("...cv,...kv->...ck", v_new, d_states, dtype["k_to_state"]),
        chunk_decay=jnp.sum(states.astype(jnp.float32) * d_states.astype(jnp.float32),
                            axis=-1).astype(dtype["chunk_decay"]),
        Aqk=_products("...iv,...jv->...ij", d_o, v_new, dtype["Aqk"]))
