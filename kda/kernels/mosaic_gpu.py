"""A Pallas Mosaic GPU kernel (Hopper) for KDA's recurrence over chunks, and its kernel path.

The chunk-parallel preparation (scores, document masks, the UT solve) stays in plain JAX
(`kda.chunked.prepare_chunks`); the kernel replaces `kda.chunked.chunk_recurrence`, the sequential
part and the latency bottleneck. One program per (batch row, value head, 64-column V tile) keeps
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

Backward: a `jax.custom_vjp` whose backward is the VJP of the plain-JAX `chunk_recurrence`,
recomputed from the float32 chunk inputs (the preparation is differentiated by JAX as in
`chunk_kda`), so gradients equal the chunked op's. That backward is exact but it is **not a kernel
yet**: training runs the forward recurrence here and the backward at plain-JAX speed.

Importing this module registers `impl="mosaic_gpu"` with `kda.api`; it imports on any backend.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.api import KDACall, register_kernel
from kda.chunked import CHUNK_SIZE, ChunkedInputs, chunk_kda_with_recurrence, chunk_recurrence

NAME = "mosaic_gpu"
# State columns per program: S [K, 64] float32 is 64 registers a thread at K = 128. 32 would halve
# that, but the 64-byte swizzle of a [K, 32] bf16 operand cannot pair with W's 128-byte one.
BLOCK_V = 64
SUPPORTED_DIMS = (64, 128)  # K and V; K = 256 would not fit two pipeline stages in shared memory
OPERAND_DTYPE = jnp.bfloat16
PIPELINE_STAGES = 2


def _swizzled(shape, dtype):
    """The (tiling, swizzle) transforms wgmma and TMA want for a [rows, cols] SMEM tile."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_swizzled(shape[-2:], dtype))


def _chunk_block(shape, dtype):
    """One chunk's tile of a [N, *shape] array, fetched into swizzled SMEM at pipeline step n."""
    transforms = _swizzled(shape, dtype) if len(shape) == 2 else ()
    return plgpu.BlockSpec((None, *shape), lambda n: (n,) + (0,) * len(shape),
                           transforms=transforms)


def _recurrence_kernel(w_gmem, u_gmem, q_gmem, kt_gmem, a_gmem, decay_gmem, s0_gmem,
                       o_gmem, s_final_gmem):
    """The body of one (batch row, value head, V tile) program; see the module docstring.

    GMEM operands: w, q [B, HV, N, C, K], kt [B, HV, N, K, C] and a [B, HV, N, C, C] in bfloat16;
    u [B, HV, N, C, V], decay [B, HV, N, K] and s0 [B, HV, K, V] in float32.
    Outputs: o [B, HV, N, C, V] and s_final [B, HV, K, V] (float32).
    """
    num_chunks, chunk, key_dim = w_gmem.shape[2:]
    batch, head, v_tile = (lax.axis_index(axis) for axis in ("batch", "heads", "v_tiles"))
    columns = pl.ds(v_tile * BLOCK_V, BLOCK_V)
    state_shape = (key_dim, BLOCK_V)

    def load_initial_state(state_smem, barrier):
        plgpu.copy_gmem_to_smem(s0_gmem.at[batch, head, :, columns], state_smem, barrier)
        plgpu.barrier_wait(barrier)
        state = plgpu.load(state_smem, layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # the load is done before TMA reuses this memory for the pipeline
        return state

    initial_state = pl.run_scoped(load_initial_state, _smem(state_shape, jnp.float32),
                                  plgpu.Barrier())

    def recur(state_smem, v_new_smem, o_smem):
        def chunk_step(indices, w, u, q, kt, a, decay, state):
            (n,) = indices
            state_smem[...] = state.astype(OPERAND_DTYPE)
            decayed_state = state * lax.broadcast_in_dim(decay[...], state_shape, (0,))
            # Fences the stores for wgmma, and orders the plain load of `decay` (like the one of
            # `u` below) before the TMA that refills this pipeline slot after the step.
            plgpu.commit_smem()

            def reads_of_state(ws_acc, o_acc, update_acc):
                plgpu.wgmma(ws_acc, w, state_smem)
                plgpu.wgmma(o_acc, q, state_smem)  # in flight while V_new is formed
                v_new = u[...] - plgpu.wgmma_accumulator_load(ws_acc, wait_n=1)
                v_new_smem[...] = v_new.astype(OPERAND_DTYPE)
                plgpu.commit_smem()
                plgpu.wgmma(o_acc, a, v_new_smem)
                plgpu.wgmma(update_acc, kt, v_new_smem)
                return o_acc[...], update_acc[...]

            o, update = pl.run_scoped(
                reads_of_state, plgpu.ACC((chunk, BLOCK_V)), plgpu.ACC((chunk, BLOCK_V)),
                plgpu.ACC(state_shape))
            slot = o_smem.at[lax.rem(n, 2)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's previous copy is out
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
        recur, _smem(state_shape, OPERAND_DTYPE), _smem((chunk, BLOCK_V), OPERAND_DTYPE),
        _smem((2, chunk, BLOCK_V), o_gmem.dtype))

    def store_final_state(state_smem):
        plgpu.wait_smem_to_gmem(0)  # the last outputs are out
        state_smem[...] = final_state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem, s_final_gmem.at[batch, head, :, columns])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store_final_state, _smem(state_shape, jnp.float32))


def _kernel_forward(chunks: ChunkedInputs, initial_state, out_dtype):
    """Runs the kernel: (o [B, HV, N, C, V] in out_dtype, final_state float32 [B, HV, K, V])."""
    batch, heads, num_chunks, chunk, key_dim = chunks.W.shape
    value_dim = chunks.U.shape[-1]
    as_operand = lambda x: x.astype(OPERAND_DTYPE)  # noqa: E731
    run = plgpu.kernel(
        _recurrence_kernel,
        out_type=(jax.ShapeDtypeStruct((batch, heads, num_chunks, chunk, value_dim), out_dtype),
                  jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32)),
        grid=(batch, heads, value_dim // BLOCK_V),
        grid_names=("batch", "heads", "v_tiles"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return run(as_operand(chunks.W), chunks.U.astype(jnp.float32),
               as_operand(chunks.q_from_state), as_operand(jnp.swapaxes(chunks.k_to_state, -1, -2)),
               as_operand(chunks.Aqk), chunks.chunk_decay.astype(jnp.float32),
               initial_state.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def kernel_recurrence(chunks: ChunkedInputs, initial_state, out_dtype):
    """`kda.chunked.chunk_recurrence` by the Mosaic GPU kernel (same contract; bf16 operands).

    Args:
      chunks: `ChunkedInputs` [B, HV, N, 64, ...] with K and V in {64, 128}.
      initial_state: [B, HV, K, V].
      out_dtype: dtype of the chunk outputs.
    Returns:
      (o [B, HV, N, 64, V] in out_dtype, final_state float32 [B, HV, K, V]).
    """
    return _kernel_forward(chunks, initial_state, out_dtype)


def _kernel_recurrence_fwd(chunks, initial_state, out_dtype):
    return _kernel_forward(chunks, initial_state, out_dtype), (chunks, initial_state)


def _kernel_recurrence_bwd(out_dtype, residuals, cotangents):
    """The VJP of the plain-JAX recurrence, recomputed (exact, not a kernel)."""
    chunks, initial_state = residuals
    _, vjp = jax.vjp(lambda c, s: chunk_recurrence(c, s, out_dtype), chunks, initial_state)
    return vjp(cotangents)


kernel_recurrence.defvjp(_kernel_recurrence_fwd, _kernel_recurrence_bwd)


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
    """KDA with the recurrence over chunks in the Mosaic GPU kernel; arguments and results as
    `kda.reference.kda_reference`, with K = V in {64, 128}. Differentiable (see the module
    docstring: the backward is plain JAX)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    if key_dim not in SUPPORTED_DIMS or value_dim not in SUPPORTED_DIMS:
        raise ValueError(
            f"the Mosaic GPU kernel needs K and V in {SUPPORTED_DIMS}, got K={key_dim}, "
            f"V={value_dim}; use impl='chunked' for other head sizes")
    return chunk_kda_with_recurrence(
        kernel_recurrence, q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound, chunk_size=CHUNK_SIZE)


def _on_hopper() -> bool:
    """Whether the default GPU is a Hopper chip (compute capability 9.0: H100, H200, H800)."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return getattr(device, "compute_capability", None) == "9.0"


def supports(call: KDACall) -> bool:
    """The calls `tests/test_kda_kernels.py` covers: bfloat16 on a Hopper GPU, K = V in {64, 128}.

    Any gate (bounded or not), grouped value heads, initial and final states, L2-normalised q/k,
    packed documents and any T are handled by the shared preparation and covered by the tests.
    """
    return (call.backend == "gpu"
            and call.dtype == jnp.bfloat16
            and call.key_dim == call.value_dim
            and call.key_dim in SUPPORTED_DIMS
            and _on_hopper())


register_kernel(NAME, mosaic_gpu_kda, supports)
