"""The recurrence's per-chunk cotangents in one pass: a Pallas Mosaic GPU kernel (Hopper).

`chunk_cotangents` computes what `kda.kernels.mosaic_gpu.reversed_recurrence.recurrence_cotangents`
does, per chunk n of each (batch row, value head), from S = S_n and dS = dS_{n+1} [K, V], V_new,
dO and dV_new [C, V] (C = 64):

    dW  = -dV_new S^T,   dQs = dO S^T,   dKt = V_new dS^T    [C, K]
    dAqk = dO V_new^T                                        [C, C]
    dD  = sum over V of S * dS                               [K]
    dU  = dV_new                                             (passed through)

As four XLA einsums and a reduction, each reading its operands from HBM, that reads S three
times, dS, dO and V_new twice each: at K = V = 128 (bf16 inputs) 240 KiB a chunk where the inputs
are 112 KiB, besides 88.5 KiB written (dW and dAqk in bf16), and the pass is memory bound. Here
one program per (batch row, value head, chunk) reads each input once by TMA into SMEM, runs the
four products as wgmmas and the sum in registers, and writes each output once: 112 + 88.5 KiB a
chunk instead of 240 + 88.5.

Layout: every input tile has V as its last dimension (64 or 128 bf16: a 128-byte swizzle shared
by every wgmma operand), so each product is a wgmma with M = C = 64 whose A operand is a tile as
it is and whose B operand the transposed view of another. K and V are each 64 or 128. dO may be
chunk-major [B, HV, N, C, V] or token-major [B, N C, HV, V], as the forward kernel writes o: TMA
reads the chunk's 64 token rows (a strided view), so no transpose of dO runs in XLA. dO and dV_new
given in float32 are rounded to bf16 by XLA first, a pass of its own (the kernel path hands dV_new
over in bf16).

Numerics: as `recurrence_cotangents`: bf16 operands, float32 accumulation, each output rounded
once (bf16 where `rounded` names it, else float32); dW negates the float32 product (negation is
exact). dD sums each row's bf16 products in float32 within a thread, then across the row's four
threads (no cross-warp reduction, so no reduction scratch).

SMEM: the inputs take 2 K V + 3 C V bytes; the outputs are staged in the buffers of inputs whose
readers are done (`plgpu.RefUnion`, see `_cotangents_kernel`'s scratch). As Mosaic GPU allocates
it, a program takes 112 KiB at K = V = 128 whichever outputs are bf16, so two programs share an
SM (228 KiB, 1 KiB reserved a program); at K = V = 64, 48 KiB with dW and dAqk in bf16 and 64 KiB
in float32 (four or three an SM); 80 KiB at K = 64, V = 128; 88 or 112 KiB at K = 128, V = 64.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.chunked import ChunkedInputs
from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, SUPPORTED_DIMS, RecurrenceResiduals,
                                           check_output_cotangent, cotangent_dtypes,
                                           lowered_once, swizzled_smem)
from kda.kernels.mosaic_gpu.tiles import CHUNK, ROW_SUMS_COMPILER_PARAMS, WGMMA

# dD is summed over 64-row blocks of S and dS: two float32 [64, V] tiles live at once.
_ROWS = 64


def _cotangents_kernel(states_gmem, d_states_gmem, v_new_gmem, d_o_gmem, d_v_new_gmem,
                       d_w_gmem, d_q_gmem, d_kt_gmem, d_aqk_gmem, d_decay_gmem):
    """The body of one (batch row, value head, chunk) program; see the module docstring.

    GMEM inputs (bf16): states, d_states [B, HV, N, K, V]; v_new, d_v_new [B, HV, N, C, V];
    d_o [B, HV, N, C, V] or token-major, [B, N C, HV, V].
    Outputs: d_w, d_q, d_kt [B, HV, N, C, K], d_aqk [B, HV, N, C, C] (each bf16 or float32, as
    declared) and d_decay [B, HV, N, K] (float32).
    """
    key_dim, value_dim = states_gmem.shape[-2:]
    chunk_index = tuple(lax.axis_index(axis) for axis in ("batch", "heads", "chunks"))
    batch, head, chunk = chunk_index
    keys_shape = (CHUNK, key_dim)
    # Token-major, the chunk's dO is a strided [C, V] view of its token rows.
    d_o_tile = (d_o_gmem.at[batch, pl.ds(chunk * CHUNK, CHUNK), head] if d_o_gmem.ndim == 4
                else d_o_gmem.at[chunk_index])

    def body(s_union, ds_union, v_union, dv_union, barriers):
        s_smem, d_w_smem = s_union
        ds_smem, d_kt_smem = ds_union
        v_smem, d_aqk_smem, d_decay_smem = v_union
        (dv_smem, do_smem), d_q_smem = dv_union
        # In the order they are read: dD first, then the products of dS and V_new.
        inputs = ((states_gmem.at[chunk_index], s_smem), (d_states_gmem.at[chunk_index], ds_smem),
                  (v_new_gmem.at[chunk_index], v_smem), (d_o_tile, do_smem),
                  (d_v_new_gmem.at[chunk_index], dv_smem))
        for index, (source, target) in enumerate(inputs):
            plgpu.copy_gmem_to_smem(source, target, barriers.at[index])

        plgpu.barrier_wait(barriers.at[0])
        plgpu.barrier_wait(barriers.at[1])
        d_decay = []  # [64] row vectors, kept (two registers a thread each) until dAqk's
        for start in range(0, key_dim, _ROWS):  # buffer is free to hold them
            rows = pl.ds(start, _ROWS)
            s = plgpu.load(s_smem.at[rows], layout=WGMMA).astype(jnp.float32)
            ds = plgpu.load(ds_smem.at[rows], layout=WGMMA).astype(jnp.float32)
            d_decay.append(jnp.sum(s * ds, axis=1))

        plgpu.barrier_wait(barriers.at[2])
        plgpu.barrier_wait(barriers.at[3])

        def v_new_products(d_kt_acc, d_aqk_acc):
            plgpu.wgmma(d_kt_acc, v_smem, ds_smem.transpose((1, 0)))
            plgpu.wgmma(d_aqk_acc, do_smem, v_smem.transpose((1, 0)))
            return d_kt_acc[...], d_aqk_acc[...]

        d_kt, d_aqk = pl.run_scoped(v_new_products, plgpu.ACC(keys_shape),
                                    plgpu.ACC((CHUNK, CHUNK)))
        plgpu.commit_smem()  # every thread has read dS (for dD) before dKt overwrites it
        d_kt_smem[...] = d_kt.astype(d_kt_smem.dtype)
        d_aqk_smem[...] = d_aqk.astype(d_aqk_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_kt_smem, d_kt_gmem.at[chunk_index])
        plgpu.copy_smem_to_gmem(d_aqk_smem, d_aqk_gmem.at[chunk_index])

        plgpu.barrier_wait(barriers.at[4])

        def state_products(d_w_acc, d_q_acc):
            plgpu.wgmma(d_w_acc, dv_smem, s_smem.transpose((1, 0)))
            plgpu.wgmma(d_q_acc, do_smem, s_smem.transpose((1, 0)))
            return d_w_acc[...], d_q_acc[...]

        d_w, d_q = pl.run_scoped(state_products, plgpu.ACC(keys_shape), plgpu.ACC(keys_shape))
        # Every thread has read S (for dD) before dW overwrites it, and dD goes where dAqk was
        # once its store has read it: in no buffer of its own, dD would add 1 KiB (alignment)
        # at K = V = 128 in float32, past two programs an SM.
        plgpu.commit_smem()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        d_w_smem[...] = (-d_w).astype(d_w_smem.dtype)
        d_q_smem[...] = d_q.astype(d_q_smem.dtype)
        for start, block in zip(range(0, key_dim, _ROWS), d_decay):
            d_decay_smem[pl.ds(start, _ROWS)] = block
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_w_smem, d_w_gmem.at[chunk_index])
        plgpu.copy_smem_to_gmem(d_q_smem, d_q_gmem.at[chunk_index])
        plgpu.copy_smem_to_gmem(d_decay_smem, d_decay_gmem.at[chunk_index])
        plgpu.wait_smem_to_gmem(0)

    operand = lambda shape: swizzled_smem(shape, OPERAND_DTYPE)  # noqa: E731
    output = lambda gmem: swizzled_smem(gmem.shape[-2:], gmem.dtype)  # noqa: E731
    state_shape, values_shape = (key_dim, value_dim), (CHUNK, value_dim)
    pl.run_scoped(
        body,
        plgpu.RefUnion(operand(state_shape), output(d_w_gmem)),  # S, then dW
        plgpu.RefUnion(operand(state_shape), output(d_kt_gmem)),  # dS, then dKt
        plgpu.RefUnion(operand(values_shape), output(d_aqk_gmem),  # V_new, then dAqk, then dD
                       plgpu.SMEM((key_dim,), jnp.float32)),
        plgpu.RefUnion((operand(values_shape), operand(values_shape)),  # dV_new and dO, then dQs
                       output(d_q_gmem)),
        plgpu.Barrier(num_barriers=5),
    )


@lowered_once("w_dtype", "q_dtype", "kt_dtype", "aqk_dtype")
def _run_kernel(states, d_states, v_new, d_o, d_v_new, w_dtype, q_dtype, kt_dtype, aqk_dtype):
    """The kernel on bf16 inputs; returns (dW, dQs, dKt, dAqk, dD), their dtypes as given (dD:
    float32)."""
    batch, heads, num_chunks, key_dim, _ = states.shape
    keys = lambda dtype: jax.ShapeDtypeStruct(  # noqa: E731
        (batch, heads, num_chunks, CHUNK, key_dim), dtype)
    run = plgpu.kernel(
        _cotangents_kernel,
        out_type=(keys(w_dtype), keys(q_dtype), keys(kt_dtype),
                  jax.ShapeDtypeStruct((batch, heads, num_chunks, CHUNK, CHUNK), aqk_dtype),
                  jax.ShapeDtypeStruct((batch, heads, num_chunks, key_dim), jnp.float32)),
        grid=(batch, heads, num_chunks),
        grid_names=("batch", "heads", "chunks"),
        # Without the cross-warp scratch two programs fit an SM at K = V = 128.
        compiler_params=ROW_SUMS_COMPILER_PARAMS,
    )
    return run(states, d_states, v_new, d_o, d_v_new)


def chunk_cotangents(residuals: RecurrenceResiduals, d_o, d_states, d_v_new,
                     rounded=()) -> ChunkedInputs:
    """`recurrence_cotangents` by the one-pass kernel (same contract and result).

    Args:
      residuals: the forward's S_n [B, HV, N, K, V] and V_new_n [B, HV, N, C, V] (bf16).
      d_o: [B, HV, N, C, V], or the same token-major, [B, N C, HV, V] (as the forward kernel
        writes o: read from its token rows, no transpose); d_states: dS_{n+1} [B, HV, N, K, V];
        d_v_new: [B, HV, N, C, V]; K and V each in {64, 128}, C = 64.
      rounded: the `ChunkedInputs` fields whose cotangents the consumer rounds to bf16 anyway:
        given in bf16.
    Returns:
      `ChunkedInputs` of cotangents, bf16 where `rounded` names them, else float32 (k_to_state
      [B, HV, N, C, K], not transposed).
    """
    states, v_new = residuals
    key_dim, value_dim = states.shape[-2:]
    if key_dim not in SUPPORTED_DIMS:
        raise ValueError(f"residuals.states: K must be one of {SUPPORTED_DIMS}, got {key_dim}")
    if value_dim not in SUPPORTED_DIMS:
        raise ValueError(f"residuals.states: V must be one of {SUPPORTED_DIMS}, got {value_dim}")
    if v_new.shape[-2] != CHUNK:
        raise ValueError(f"residuals.v_new: chunks must have {CHUNK} rows, got {v_new.shape}")
    check_output_cotangent(d_o, v_new.shape)
    dtype = cotangent_dtypes(rounded)
    as_operand = lambda x: x.astype(OPERAND_DTYPE)  # noqa: E731
    d_w, d_q, d_kt, d_aqk, d_decay = _run_kernel(
        as_operand(states), as_operand(d_states), as_operand(v_new), as_operand(d_o),
        as_operand(d_v_new), dtype["W"], dtype["q_from_state"], dtype["k_to_state"],
        dtype["Aqk"])
    return ChunkedInputs(W=d_w, U=d_v_new.astype(dtype["U"]), q_from_state=d_q, k_to_state=d_kt,
                         chunk_decay=d_decay.astype(dtype["chunk_decay"]), Aqk=d_aqk)
