"""KDA's recurrence over chunks: a Pallas Mosaic GPU kernel (Hopper).

`run_recurrence` replaces `kda.chunked.chunk_recurrence` on `RecurrenceOperands` [B, HV, N, ...].
One program per (batch row, value head, 64-column V tile) keeps its float32 state tile
`S [K, 64]` in registers across all chunks and, per chunk of C = 64 tokens, computes with wgmma
(M = 64 = C, or K for the update):

    V_new = U - W S                              [C, K] x [K, 64]
    O     = q_from_state S + Aqk V_new           [C, K] x [K, 64]  +  [C, C] x [C, 64]
    S     = chunk_decay * S + k_to_state^T V_new [K, C] x [C, 64]

Where even twice as many programs fit one wave (B HV V / 32 <= the SM count), each takes 32
columns instead (`choose_block_v`), so that twice the SMs walk the chunks, each with half the
wgmma work a step; the columns do not mix, so the results are the same. Where the 64-column
programs exceed a wave the kernel is bound by its operand traffic, not by waves, so programs of
two compute warpgroups sharing their operands do not run faster there (`benchmarks/kda_notes.md`).

Numerics: bf16 wgmma operands (W, q_from_state, k_to_state and Aqk as handed in; S and V_new
rounded each time they are written to SMEM for the next wgmma), float32 accumulation and carried
state; U and chunk_decay are read in float32 (U in bf16 would save 16 of the 88.5 KiB read a chunk
at K = V = 128, but the bytes are not what bounds the forward). Without an initial state the
state starts as zeros in registers: nothing is read for it, and no zeros are written.

Pipeline: the next chunk's inputs stream in by TMA while the current one computes (two stages);
outputs leave through a double buffer in SMEM. The loads run on a warpgroup of their own
(`chunk_pipeline`, 40 registers a thread), so that TMA issue overlaps the chunk's math and the
computing warpgroup only waits on their barrier. With `save_for_backward` the kernel also writes
what `kda.kernels.mosaic_gpu.reversed_recurrence` reads: each chunk's entering state and V_new, as
the bf16 wgmma operands it used (two TMA stores a chunk from SMEM it fills anyway).

S is not carried transposed, as the reversed kernel carries dS: with S^T and V_new^T as wgmma's
left operands from registers the state's chain would skip SMEM, but U (float32 [C, V]) would have
to be read transposed, which Mosaic GPU does only for 16-bit values (through SMEM as a bf16 hi/lo
pair), and the saved S and V_new would need stores of their own: that variant is slower.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kda.kernels.mosaic_gpu.common import (OPERAND_DTYPE, WARPGROUP_AXIS, RecurrenceOperands,
                                           RecurrenceResiduals, chunk_pipeline, kernel_body,
                                           load_state_tile, lowered_once, store_state_tile,
                                           swizzled, swizzled_smem)

# State columns per program: S [K, 64] float32 is 64 registers a thread at K = 128.
BLOCK_V = 64
# Where few programs run (`choose_block_v`), 32 columns a program: twice the programs, each with
# half the wgmma work a chunk step. A [K, 32] bf16 operand's rows take a 64-byte swizzle, and
# wgmma's operands from SMEM must share one, so W, q_from_state, k_to_state^T and Aqk then take
# 64-byte swizzles too.
NARROW_BLOCK_V = 32
PIPELINE_STAGES = 2


def choose_block_v(batch_heads: int, value_dim: int, num_sms: int) -> int:
    """NARROW_BLOCK_V where even twice the programs of BLOCK_V columns fit one wave of
    `num_sms` (one program an SM), else BLOCK_V."""
    return NARROW_BLOCK_V if 2 * batch_heads * value_dim // BLOCK_V <= num_sms else BLOCK_V


def _chunk_block(shape, dtype, max_swizzle):
    """One chunk's tile of a [N, *shape] array, fetched into swizzled SMEM at pipeline step n."""
    transforms = swizzled(shape, dtype, max_swizzle) if len(shape) == 2 else ()
    return plgpu.BlockSpec((None, *shape), lambda n: (n,) + (0,) * len(shape),
                           transforms=transforms)


def _recurrence_kernel(w_gmem, u_gmem, q_gmem, kt_gmem, a_gmem, decay_gmem, *gmems, block_v,
                       has_initial_state):
    """The body of one (batch row, value head, V tile) program; see the module docstring.

    GMEM operands: w, q [B, HV, N, C, K], kt [B, HV, N, K, C] and a [B, HV, N, C, C] in bfloat16;
    u [B, HV, N, C, V], decay [B, HV, N, K] and, with `has_initial_state`, s0 [B, HV, K, V] in
    float32.
    Outputs: o [B, HV, N, C, V] (or token-major, [B, N C, HV, V]: `run_recurrence`'s
    `token_major`) and s_final [B, HV, K, V] (float32), and when the backward needs
    them (`saved_gmem`, `RecurrenceResiduals`) the entering states [B, HV, N, K, V] and V_new
    [B, HV, N, C, V], both as the bf16 wgmma operands the forward used.
    """
    s0_gmem = gmems[0] if has_initial_state else None
    o_gmem, s_final_gmem, *saved_gmem = gmems[has_initial_state:]
    num_chunks, chunk, key_dim = w_gmem.shape[2:]
    batch, head, v_tile = (lax.axis_index(axis) for axis in ("batch", "heads", "v_tiles"))
    columns = pl.ds(v_tile * block_v, block_v)
    # The swizzle of a [., block_v] bf16 operand, which every wgmma operand from SMEM shares.
    max_swizzle = block_v * jnp.dtype(OPERAND_DTYPE).itemsize
    token_major = o_gmem.ndim == 4

    def output_tile(n):
        """Chunk n's [C, 64] tile of o (a strided view where o is token-major)."""
        if token_major:
            return o_gmem.at[batch, pl.ds(n * chunk, chunk), head, columns]
        return o_gmem.at[batch, head, n, :, columns]

    state_shape = (key_dim, block_v)
    saves = bool(saved_gmem)
    # Copies to GMEM a step issues, in order: [entering state, V_new,] output. Waiting until at
    # most m copies are pending frees the buffer of every copy issued before the last m. (The
    # pipeline commits a group of its own after each step, empty here: where empty groups
    # count, the waits are only stricter.)
    copies_per_step = 3 if saves else 1

    def save(smem, gmem, n):
        """Writes a bf16 operand of chunk n out for the backward."""
        plgpu.copy_smem_to_gmem(smem, gmem.at[batch, head, n, :, columns])

    def recur(buffers, state_barrier):
        (state_smem, v_new_smem, o_smem), state_f32_smem = buffers

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
                reads_of_state, plgpu.ACC((chunk, block_v)), plgpu.ACC((chunk, block_v)),
                plgpu.ACC(state_shape))
            slot = o_smem.at[lax.rem(n, 2)]
            # This slot's previous copy (two steps ago) is out.
            plgpu.wait_smem_to_gmem(copies_per_step, wait_read_only=True)
            slot[...] = o.astype(slot.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slot, output_tile(n))
            return decayed_state + update

        def initial_state():
            """S_0 [K, block_v] float32 in WGMMA-layout registers (in the compute warpgroup, as
            all of the pipeline's `compute_context`)."""
            if not has_initial_state:
                return plgpu.layout_cast(jnp.zeros(state_shape, jnp.float32),
                                         plgpu.Layout.WGMMA)
            return load_state_tile(s0_gmem.at[batch, head, :, columns], state_f32_smem,
                                   state_barrier)

        in_specs = [
            _chunk_block((chunk, key_dim), OPERAND_DTYPE, max_swizzle),  # W
            _chunk_block((chunk, block_v), jnp.float32, max_swizzle),  # U
            _chunk_block((chunk, key_dim), OPERAND_DTYPE, max_swizzle),  # q_from_state
            _chunk_block((key_dim, chunk), OPERAND_DTYPE, max_swizzle),  # k_to_state^T
            _chunk_block((chunk, chunk), OPERAND_DTYPE, max_swizzle),  # Aqk
            _chunk_block((key_dim,), jnp.float32, max_swizzle),  # chunk_decay
        ]
        chunk_inputs = (w_gmem.at[batch, head], u_gmem.at[batch, head, :, :, columns],
                        q_gmem.at[batch, head], kt_gmem.at[batch, head], a_gmem.at[batch, head],
                        decay_gmem.at[batch, head])
        pipeline = chunk_pipeline(
            chunk_step, in_specs, num_chunks, PIPELINE_STAGES,
            compute_context=lambda run: store_state_tile(
                run(initial_state()), s_final_gmem.at[batch, head, :, columns], state_f32_smem))
        pipeline(*chunk_inputs)

    pl.run_scoped(
        recur,
        # The loop's buffers: the bf16 state, V_new and o's double buffer; before and after the
        # loop, the float32 initial and final state.
        plgpu.RefUnion((swizzled_smem(state_shape, OPERAND_DTYPE),
                        swizzled_smem((chunk, block_v), OPERAND_DTYPE),
                        swizzled_smem((2, chunk, block_v), o_gmem.dtype)),
                       swizzled_smem(state_shape, jnp.float32)),
        plgpu.Barrier(),
        collective_axes=WARPGROUP_AXIS)


@lowered_once("out_dtype", "save_for_backward", "token_major", "block_v")
def run_recurrence(operands: RecurrenceOperands, initial_state, out_dtype, *,
                   save_for_backward=False, token_major=False, block_v=BLOCK_V):
    """Runs the kernel: (o [B, HV, N, C, V] in out_dtype, final_state float32 [B, HV, K, V]).

    `initial_state` is [B, HV, K, V], or None for zeros (then nothing is read for it).

    With `save_for_backward`, also returns the `RecurrenceResiduals` the backward reads (the
    entering states and V_new, which the kernel then writes as it goes) as a third result. With
    `token_major`, o is [B, N C, HV, V], the layout of the model's v: the kernel stores each
    chunk's tile into its token rows, and no transpose follows. `block_v`: the state columns of a
    program, BLOCK_V or NARROW_BLOCK_V (`choose_block_v`); the results do not depend on it.
    """
    if block_v not in (BLOCK_V, NARROW_BLOCK_V):
        raise ValueError(f"block_v must be {BLOCK_V} or {NARROW_BLOCK_V}, got {block_v}")
    batch, heads, num_chunks, chunk, key_dim = operands.W.shape
    value_dim = operands.U.shape[-1]
    chunked = lambda *tail: (batch, heads, num_chunks, *tail)  # noqa: E731
    o_shape = ((batch, num_chunks * chunk, heads, value_dim) if token_major
               else chunked(chunk, value_dim))
    out_type = (jax.ShapeDtypeStruct(o_shape, out_dtype),
                jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32))
    if save_for_backward:
        out_type += RecurrenceResiduals(
            states=jax.ShapeDtypeStruct(chunked(key_dim, value_dim), OPERAND_DTYPE),
            v_new=jax.ShapeDtypeStruct(chunked(chunk, value_dim), OPERAND_DTYPE))
    run = plgpu.kernel(
        kernel_body(_recurrence_kernel, block_v=block_v,
                    has_initial_state=initial_state is not None),
        out_type=out_type,
        grid=(batch, heads, value_dim // block_v),
        grid_names=("batch", "heads", "v_tiles"),
        num_threads=2,
        thread_name=WARPGROUP_AXIS,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    initial_states = () if initial_state is None else (initial_state.astype(jnp.float32),)
    o, final_state, *saved = run(*operands, *initial_states)
    if save_for_backward:
        return o, final_state, RecurrenceResiduals(*saved)
    return o, final_state
