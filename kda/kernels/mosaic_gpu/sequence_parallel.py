"""Sequence parallelism for KDA's recurrence over chunks: every SM busy on a few long sequences.

The recurrence kernel (`kda.kernels.mosaic_gpu.recurrence`) and its reversed twin of the backward
(`kda.kernels.mosaic_gpu.reversed_recurrence`) run one program per (batch row, value head,
64-column V tile), each walking all N chunks in order: at small B * HV most SMs idle. Here the N
chunks are cut into P segments of L = ceil(N / P) chunks that run side by side in one launch of
the same kernel and are then combined exactly (derivation: docs/kda_chunked.md).

Exact because a chunk's update `S_{n+1} = M_n S_n + Kt_n^T U_n` (`M_n = diag(D_n) - Kt_n^T W_n`)
and output `O_n = (Qs_n - Aqk_n W_n) S_n + Aqk_n U_n` are affine in the entering state. Each
segment starts from `[0, I_K]` with `U' = [U, 0]`: its first V columns give the zero-start outputs
`O0_n` and end state `b_p`, the extra K columns its transition `A_p` and `R_n`, what the outputs
read of the entering state. A scan over the segments' maps (`combine_segments`) gives each true
entering state `S_p`, then `O_n = O0_n + R_n S_p` (one batched matmul); the saved states and V_new
are corrected alike. N is padded to P * L with inert chunks (zeros, D = 1); document masks live in
the operands. The backward's reversed recurrence, affine in the cotangent entering from the right,
is split the same way mirrored (`dO' = [dO, 0]`, right end `[0, I_K]`, combined from the last).
The segments' outputs are float32 (`R_n` still multiplies a state); the combine runs at full
float32 precision, the corrections at the default one (TF32 on Hopper: finer than the bf16 the
kernel rounds the same state to unsplit).

When it pays (`choose_num_segments`): the kernels are bound by the latency of their per-chunk
chain of wgmmas, one program an SM, so with `waves(x) = ceil(x / SMs)` the estimated times are

    plain:    waves(G)      * N         * STEP_SECONDS,  G  = B * HV * V / 64 programs
    segments: waves(G' * P) * ceil(N/P) * STEP_SECONDS,  G' = B * HV * (V + K) / 64 per segment
              + B * T * HV * (V + K) / 256 * EXTRA_SECONDS_PER_TOKEN_HEAD

the last term being the memory-bound passes over every token that splitting adds (U extended,
float32 outputs, corrections, transposes, both directions): it pays only at a few heads and rows.
"""

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kda.chunked import CHUNK_SIZE, chunks_to_tokens, tokens_to_chunks
from kda.common import einsum
from kda.kernels.mosaic_gpu.common import RecurrenceOperands
from kda.kernels.mosaic_gpu.recurrence import BLOCK_V, choose_block_v, run_recurrence
from kda.kernels.mosaic_gpu.reversed_recurrence import run_reversed_recurrence

HOPPER_SM_COUNT = 132  # H100 SXM and H200: the count assumed where no GPU is attached
# The cost model of the module docstring ("When it pays"), fitted at K = V = 128 on Hopper
# (the measurements: `benchmarks/kda_h200.md`).
STEP_SECONDS = 3.4e-6  # a chunk step of the recurrence kernel and its reversed twin together
EXTRA_SECONDS_PER_TOKEN_HEAD = 4.9e-9  # what splitting adds, per token and value head, at V+K=256
# The model's estimate must favour splitting by this much: its constants come from one shape.
MIN_TIME_GAIN = 1.2
# Shorter segments would spend a growing share of each program in its prologue and epilogue
# (initial-state load, pipeline fill, final-state store) for little further gain.
MIN_SEGMENT_CHUNKS = 16
# Past two waves a larger P no longer cuts the work (the extension doubles it for good); it only
# evens out the last wave, for a few percent at the price of more, shorter segments.
MAX_WAVES = 2


def split_chunk_axis(x, num_segments: int, *, pad_value=0.0, extra_columns=0):
    """[B, HV, N, ..., cols] -> [B, HV * P, L, ..., cols + extra_columns], L = ceil(N / P).

    N is padded with `pad_value` up to P * L and the last axis with `extra_columns` zeros; the
    result is head-major, segment-minor (a free reshape when N = P * L and nothing is added).
    """
    batch, heads, num_chunks = x.shape[:3]
    segment_chunks = -(-num_chunks // num_segments)
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, segment_chunks * num_segments - num_chunks)
    x = jnp.pad(x, widths, constant_values=pad_value)
    widths = [(0, 0)] * x.ndim
    widths[-1] = (0, extra_columns)
    x = jnp.pad(x, widths)
    return x.reshape(batch, heads * num_segments, segment_chunks, *x.shape[3:])


def split_into_segments(operands, num_segments: int):
    """Cuts the chunk axis into segments, each a separate head, and extends U by K zero columns.

    Args:
      operands: `RecurrenceOperands` or `kda.chunked.ChunkedInputs` [B, HV, N, ...] (every field
        has the chunk axis third; both have `U` [B, HV, N, C, V], which may be None, and
        `chunk_decay` [B, HV, N, K]).
      num_segments: P; N is padded with inert chunks (zeros, and D = 1) up to P * L,
        L = ceil(N / P).
    Returns:
      The same type, [B, HV * P, L, ...] with U [B, HV * P, L, C, V + K].
    """
    key_dim = operands.W.shape[-1]
    special = {"U": dict(extra_columns=key_dim), "chunk_decay": dict(pad_value=1.0)}
    return type(operands)(**{
        name: None if x is None else split_chunk_axis(x, num_segments, **special.get(name, {}))
        for name, x in operands._asdict().items()})


def combine_segments(transitions, offsets, initial_state):
    """The state entering each segment, from each segment's affine map `S -> A_p S + b_p`.

    A scan over the maps (`lax.associative_scan`: log2(P) rounds of batched matmuls), in float32 at
    full precision.

    Args:
      transitions: A [B, HV, P, K, K] (rows: state rows after the segment, columns: before).
      offsets: b [B, HV, P, K, V], each segment's end state from a zero start.
      initial_state: S_0 [B, HV, K, V].
    Returns:
      (entering [B, HV, P, K, V]: S_0 .. S_{P-1}, final_state [B, HV, K, V]: S_P).
    """

    def compose(earlier, later):
        (a_first, b_first), (a_then, b_then) = earlier, later
        return (einsum("...ij,...jk->...ik", a_then, a_first),
                einsum("...ij,...jv->...iv", a_then, b_first) + b_then)

    through_a, through_b = lax.associative_scan(compose, (transitions, offsets), axis=2)
    leaving = einsum("bhpij,bhjv->bhpiv", through_a, initial_state) + through_b
    entering = jnp.concatenate([initial_state[:, :, None], leaving[:, :, :-1]], axis=2)
    return entering, leaving[:, :, -1]


def segment_starts(batch: int, heads: int, key_dim: int, value_dim: int, dtype):
    """`[0, I_K]` [B, HV * P, K, V + K], every segment's start: the extra K columns carry how
    everything the segment computes depends on its true start."""
    start = jnp.concatenate(
        [jnp.zeros((key_dim, value_dim), dtype), jnp.eye(key_dim, dtype=dtype)], axis=1)
    return jnp.broadcast_to(start, (batch, heads, key_dim, value_dim + key_dim))


def combine_and_correct(ends, per_chunk, boundary, *, num_chunks: int, reverse: bool,
                        precision):
    """Combines segments run from `segment_starts` and corrects what they computed per chunk.

    Args:
      ends: [B, HV * P, K, V + K], each segment's far end, `[b_p, A_p]` (offset and transition).
      per_chunk: a pytree of arrays [B, HV * P, L, rows, V + K], each affine in the segment's
        start (the first V columns from a zero start, the extra K its dependence on the start).
      boundary: [B, HV, K, V], the start of the whole sequence: S_0, or with `reverse` (segments
        chained from the last to the first) the final-state cotangent dS_N.
      num_chunks: N, the chunks kept of the P * L.
      reverse: whether segment p starts from what segment p + 1 leaves (else p - 1).
      precision: of the corrections (the combine is always at full precision).
    Returns:
      (per_chunk [B, HV, N, rows, V], each in its dtype, from the true segment starts; the far
      boundary [B, HV, K, V]: S_N, or with `reverse` dS_0).
    """
    batch, heads, key_dim, value_dim = boundary.shape
    ends = ends.reshape(batch, heads, -1, key_dim, value_dim + key_dim)
    in_order = (lambda x: jnp.flip(x, axis=2)) if reverse else (lambda x: x)
    starts, far_boundary = combine_segments(in_order(ends[..., value_dim:]),
                                            in_order(ends[..., :value_dim]), boundary)
    starts = in_order(starts)

    def corrected(x):
        """[B, HV * P, L, rows, V + K] from zero starts -> [B, HV, N, rows, V] from the starts."""
        x = x.reshape(batch, heads, starts.shape[2], -1, *x.shape[-2:])
        y = x[..., :value_dim] + jnp.einsum("bhplrk,bhpkv->bhplrv", x[..., value_dim:], starts,
                                            precision=precision)
        return y.reshape(batch, heads, -1, *y.shape[-2:])[:, :, :num_chunks].astype(x.dtype)

    return jax.tree.map(corrected, per_chunk), far_boundary


def recurrence_in_segments(recurrence: Callable, operands, initial_state, out_dtype, *,
                           num_segments: int, precision=lax.Precision.HIGHEST,
                           **recurrence_options):
    """Runs `recurrence` on P segments side by side, then combines them exactly (module docstring).

    Args:
      recurrence: `(operands, initial_state, out_dtype, **recurrence_options) ->
        (o [B', HV', N', C, V'], final_state [B', HV', K, V'], *residuals)`, the contract of
        `kda.chunked.chunk_recurrence` (on `ChunkedInputs`) or of
        `kda.kernels.mosaic_gpu.recurrence.run_recurrence` (on `RecurrenceOperands`). Each
        residual, if any, is a NamedTuple of per-chunk arrays [B', HV', N', rows, V'] affine in
        the entering state (the kernel's saved states and V_new), corrected like the outputs and
        kept in its dtype.
      operands: what `recurrence` takes, [B, HV, N, ...].
      initial_state: [B, HV, K, V].
      out_dtype: dtype of the chunk outputs.
      num_segments: P >= 1.
      precision: of the corrections `R_n S_p` (the combine is always at full precision).
    Returns:
      (o [B, HV, N, C, V] in out_dtype, final_state float32 [B, HV, K, V], *residuals
      [B, HV, N, rows, V]).
    """
    batch, heads, num_chunks, _, key_dim = operands.W.shape
    value_dim = operands.U.shape[-1]
    dtype = jnp.float32  # the segments' outputs and ends: R_n still multiplies a state
    o, ends, *residuals = recurrence(
        split_into_segments(operands, num_segments),
        segment_starts(batch, heads * num_segments, key_dim, value_dim, dtype), dtype,
        **recurrence_options)
    (o, residuals), final_state = combine_and_correct(
        ends, (o, residuals), initial_state.astype(dtype), num_chunks=num_chunks, reverse=False,
        precision=precision)
    return o.astype(out_dtype), final_state, *residuals


def reversed_recurrence_in_segments(reversed_recurrence: Callable, operands, d_o, d_final_state,
                                    *, num_segments: int, precision=lax.Precision.HIGHEST):
    """Runs the reversed recurrence (the backward's) on P segments side by side, each from a zero
    right-end cotangent, then combines them from the last to the first.

    Per chunk, `dS_n = (diag(D_n) - W_n^T Kt_n) dS_{n+1} + (Qs_n^T - W_n^T Aqk_n^T) dO_n` is
    affine in the cotangent entering from the right, and so are dS_{n+1} and dV_new_n: the
    segments run with `dO' = [dO, 0]` and `dS_end' = [0, I_K]`, and their results are corrected by
    the true right-end cotangent of each segment as the forward's are by its entering state.

    Args:
      reversed_recurrence: `(operands, d_o, d_final_state) -> (d_states [B', HV', N', K, V'],
        d_v_new [B', HV', N', C, V'], d_initial_state [B', HV', K, V'])`, the contract of
        `kda.kernels.mosaic_gpu.reversed_recurrence.run_reversed_recurrence`.
      operands: what it takes, [B, HV, N, ...] (U may be None).
      d_o: [B, HV, N, C, V]; d_final_state: [B, HV, K, V].
      num_segments: P >= 1.
      precision: of the corrections (the combine is always at full precision).
    Returns:
      (d_states [B, HV, N, K, V], d_v_new [B, HV, N, C, V], each in the dtype
      `reversed_recurrence` gives it, d_initial_state float32 [B, HV, K, V]).
    """
    batch, heads, num_chunks, _, key_dim = operands.W.shape
    value_dim = d_o.shape[-1]
    d_states, d_v_new, d_starts = reversed_recurrence(
        split_into_segments(operands, num_segments),
        split_chunk_axis(d_o, num_segments, extra_columns=key_dim),
        segment_starts(batch, heads * num_segments, key_dim, value_dim, jnp.float32))
    (d_states, d_v_new), d_initial_state = combine_and_correct(
        d_starts, (d_states, d_v_new), d_final_state.astype(jnp.float32),
        num_chunks=num_chunks, reverse=True, precision=precision)
    return d_states, d_v_new, d_initial_state


def _multiprocessor_count() -> int:
    """SMs of the target GPU: the abstract mesh's device (tests), the default device, or Hopper."""
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None and abstract_device.num_cores:  # a CPU mesh's has no count
        return abstract_device.num_cores
    return getattr(jax.devices()[0], "core_count", None) or HOPPER_SM_COUNT


def choose_num_segments(batch_heads: int, num_chunks: int, key_dim: int, value_dim: int,
                        num_sms: int | None = None) -> int:
    """P with the least estimated time (module docstring) in at most `MAX_WAVES` waves, or 1 where
    splitting does not cut the estimate by `MIN_TIME_GAIN`. Ties go to the smaller P.

    Args:
      batch_heads: B * HV.
      num_chunks: N.
      key_dim, value_dim: K and V (multiples of 64).
      num_sms: SMs of the GPU (default: `_multiprocessor_count()`).
    """
    num_sms = num_sms or _multiprocessor_count()

    plain_programs = batch_heads * value_dim // BLOCK_V
    segment_programs = batch_heads * (value_dim + key_dim) // BLOCK_V

    def waves(num_segments):
        programs = plain_programs if num_segments == 1 else segment_programs * num_segments
        return math.ceil(programs / num_sms)

    extras = (batch_heads * num_chunks * CHUNK_SIZE * (value_dim + key_dim) / 256
              * EXTRA_SECONDS_PER_TOKEN_HEAD)

    def seconds(num_segments):
        steps = waves(num_segments) * math.ceil(num_chunks / num_segments)
        return steps * STEP_SECONDS + (extras if num_segments > 1 else 0.0)

    candidates = [p for p in range(1, max(1, num_chunks // MIN_SEGMENT_CHUNKS) + 1)
                  if p == 1 or waves(p) <= MAX_WAVES]
    best = min(candidates, key=seconds)
    return best if MIN_TIME_GAIN * seconds(best) <= seconds(1) else 1


def _segment_count(num_segments: int | None, operands, value_dim: int) -> int:
    """P as asked, or chosen (`choose_num_segments`) where None; the same for both directions."""
    batch, heads, num_chunks, _, key_dim = operands.W.shape
    if num_segments is None:
        return choose_num_segments(batch * heads, num_chunks, key_dim, value_dim)
    if not 1 <= num_segments <= num_chunks:
        raise ValueError(f"num_segments must be between 1 and the number of chunks N = "
                         f"{num_chunks}, got {num_segments}; pass None to choose it")
    return num_segments


def sequence_parallel_recurrence(operands: RecurrenceOperands, initial_state, out_dtype, *,
                                 num_segments: int | None = None, save_for_backward=False,
                                 token_major=False):
    """`kda.kernels.mosaic_gpu.recurrence.run_recurrence` over P segments, side by side.

    Args:
      operands: `RecurrenceOperands` [B, HV, N, 64, ...], K and V in {64, 128}.
      initial_state: [B, HV, K, V], or None for zeros.
      out_dtype: dtype of the chunk outputs.
      num_segments: P in [1, N]; None chooses it from the grid and the SM count
        (`choose_num_segments`). P = 1 is the plain kernel.
      save_for_backward: also return the `RecurrenceResiduals` the backward reads (the entering
        states and V_new, bf16), as `run_recurrence` does; over segments they are corrected from
        each segment's zero start to its true entering state like the outputs.
      token_major: o as [B, N 64, HV, V] (`run_recurrence`'s `token_major`): written so by the
        kernel when P = 1, transposed after the segments are combined otherwise.
    Returns:
      (o [B, HV, N, 64, V] (token-major: [B, N 64, HV, V]) in out_dtype, final_state float32
      [B, HV, K, V][, residuals]).
    """
    num_segments = _segment_count(num_segments, operands, operands.U.shape[-1])
    if num_segments == 1:
        batch, heads, _, _, _ = operands.W.shape
        block_v = choose_block_v(batch * heads, operands.U.shape[-1], _multiprocessor_count())
        return run_recurrence(operands, initial_state, out_dtype,
                              save_for_backward=save_for_backward, token_major=token_major,
                              block_v=block_v)
    if initial_state is None:  # the combine starts from it
        batch, heads, _, _, key_dim = operands.W.shape
        initial_state = jnp.zeros((batch, heads, key_dim, operands.U.shape[-1]), jnp.float32)
    # The kernel already rounds the state to bf16 where it multiplies it; TF32 here is finer.
    o, *rest = recurrence_in_segments(
        run_recurrence, operands, initial_state, out_dtype, num_segments=num_segments,
        precision=lax.Precision.DEFAULT, save_for_backward=save_for_backward)
    return (chunks_to_tokens(o) if token_major else o), *rest


def sequence_parallel_reversed_recurrence(operands: RecurrenceOperands, d_o, d_final_state, *,
                                          num_segments: int | None = None,
                                          d_v_new_dtype=jnp.float32):
    """`kda.kernels.mosaic_gpu.reversed_recurrence.run_reversed_recurrence` over P segments, side
    by side.

    Args:
      operands: the forward's `RecurrenceOperands` [B, HV, N, 64, ...] (U may be None).
      d_o: [B, HV, N, 64, V], or token-major, [B, N 64, HV, V] (as `sequence_parallel_recurrence`
        writes o with `token_major`): read so by the kernel when P = 1, transposed to chunk-major
        before the split otherwise.
      d_final_state: [B, HV, K, V].
      num_segments: P in [1, N]; None chooses it as the forward does. P = 1 is the plain kernel.
      d_v_new_dtype: float32, or bf16 where every consumer of dV_new rounds it to bf16 (written
        so by the kernel at P = 1, rounded after the float32 corrections at P > 1).
    Returns:
      (d_states bf16 [B, HV, N, K, V]: dS_{n+1} for chunk n, d_v_new [B, HV, N, 64, V] in
      d_v_new_dtype, d_initial_state float32 [B, HV, K, V]).
    """
    num_segments = _segment_count(num_segments, operands, d_o.shape[-1])
    if num_segments == 1:
        return run_reversed_recurrence(operands, d_o, d_final_state, d_v_new_dtype)
    if d_o.ndim == 4:  # the split cuts the chunk axis (rare: few heads and rows, module docstring)
        d_o = tokens_to_chunks(d_o, CHUNK_SIZE)
    # As forward: the kernel rounds dS to bf16 where it multiplies it; TF32 here is finer.
    d_states, d_v_new, d_initial_state = reversed_recurrence_in_segments(
        run_reversed_recurrence, operands, d_o, d_final_state, num_segments=num_segments,
        precision=lax.Precision.DEFAULT)
    return d_states, d_v_new.astype(d_v_new_dtype), d_initial_state
