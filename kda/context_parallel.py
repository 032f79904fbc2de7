"""KDA with each sequence's tokens split over the `seq` mesh axis (context parallelism), exact.

Shard p of P holds tokens [p Tl, (p + 1) Tl). What it computes is affine in the state S_p
entering it (the GPU kernels' sequence parallelism, `kda.kernels.mosaic_gpu.sequence_parallel`,
lifted to devices):

    S_{p+1} = A_p S_p + b_p        A_p [K, K]: the product of its tokens' decays and delta-rule
                                   updates; b_p [K, V]: its end state from a zero start
    o_t     = o0_t + R_t S_p       o0_t: token t's output from a zero start; R_t [K]: what it
                                   reads of the entering state

1. Each shard runs the op twice on its own tokens: on its values from the zero state (o0, b_p),
   and on zero values of width K from the identity (R, A_p: the op's outputs and final state,
   S -> A S applied to I).
2. The maps (A_p, b_p), [B, HV, K, K + V] floats a shard whatever its length, are all-gathered
   and every shard scans them from the initial state, shard after shard (`entering_states`): it
   takes its own S_p, and every shard has the final state S_P.
3. o = o0 + R S_p, one batched matmul.

Two runs of head sizes K and V rather than one on values [v | 0] of width V + K (the kernels'
sequence parallelism runs that): every run keeps the sizes the GPU kernels take (K = V), at the
price of the chunk preparation done twice.

Packed documents: a document beginning inside a shard cuts the state there (the op's segment
ids make A_p and its tokens' R zero). A shard whose first token begins a document (its id differs
from the previous shard's last, `shards_start_documents`) has S_p = 0, as a segment boundary in
`kda.segments.kda_attention_in_segments`.

The gradients are the autodiff of the above (the all-gather's transpose is a reduce-scatter), so
outputs, final state and gradients equal the single-device op's up to float32 rounding (R comes
out of the op in v's dtype: for bfloat16 inputs the correction is rounded like o0). The op's
confinement of non-finite inputs holds within a shard; a non-finite state leaving a shard reaches
every later output of its row (R S_p is NaN even where R is 0) but those of shards that begin a
document.

Per shard, against the single-device op on the same tokens: two runs of the op, one matmul
[Tl, K] x [K, V] per head, and a collective of B HV K (K + V) floats, independent of T.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from core.context_parallel import SEQ_AXIS, over_token_shards, shard_index, varying_like
from kda.api import kda_attention
from kda.common import einsum
from kda.segments import segment_starts_document


def _from_every_shard(x: jax.Array) -> jax.Array:
    """[P, ...]: every shard's x, in shard order, the same on each shard."""
    return lax.all_gather(x, SEQ_AXIS, to="invarying")


def shards_start_documents(segment_ids: jax.Array) -> jax.Array:
    """bool [P, B]: shard p's first token begins a document (never for p = 0, which continues
    from the initial state). segment_ids: this shard's, integer [B, Tl]."""
    edges = jnp.stack([segment_ids[:, 0], segment_ids[:, -1]], axis=-1)  # [B, 2]
    edges = jnp.moveaxis(_from_every_shard(edges), 0, 1)  # [B, P, 2]: first, last id of each
    return segment_starts_document(edges.reshape(edges.shape[0], -1), 2)


def entering_states(transitions, offsets, restarts, initial_state):
    """The state entering each shard, shard after shard: S_0 = initial_state, S_{p+1} =
    A_p S_p + b_p, and S_p = 0 where shard p begins a document.

    A `lax.scan` over the P maps, not `lax.associative_scan` (as the kernels' combine): P is
    small, and XLA's SPMD partitioner crashes on the latter's gradient under `shard_map`.

    Args:
      transitions: A [P, B, HV, K, K] (rows: the state after the shard, columns: before).
      offsets: b [P, B, HV, K, V].
      restarts: bool [P, B].
      initial_state: float32 [B, HV, K, V].
    Returns:
      (entering [P, B, HV, K, V], final_state [B, HV, K, V]).
    """

    def shard_step(state, shard):
        transition, offset, restart = shard
        state = jnp.where(restart[:, None, None, None], 0.0, state)
        return einsum("bhij,bhjv->bhiv", transition, state) + offset, state

    final_state, entering = lax.scan(shard_step, initial_state, (transitions, offsets, restarts))
    return entering, final_state


def kda_attention_on_shard(q, k, v, g, beta, initial_state, segment_ids, *, attend, options):
    """One shard's part of `context_parallel_kda` (module docstring), inside `shard_map` with
    the `seq` axis manual.

    Args:
      q, k: [B, Tl, H, K]; v: [B, Tl, HV, V]; g: [B, Tl, HV, K]; beta: [B, Tl, HV]: this shard's.
      initial_state: float32 [B, HV, K, V], the state before the sequence's first token.
      segment_ids: integer [B, Tl] or None.
      attend, options: as in `context_parallel_kda`.
    Returns:
      (o [B, Tl, HV, V] in v's dtype, final_state float32 [B, HV, K, V], the same on every shard).
    """
    batch, _, heads, value_dim = v.shape
    key_dim = q.shape[-1]

    def run(values, start):  # the op on this shard's tokens from `start`, a state of every shard
        start = varying_like(start, q, k, v, g, beta)  # typed as the op's scans carry it
        return attend(q, k, values, g, beta, initial_state=start, output_final_state=True,
                      segment_ids=segment_ids, **options)

    o_from_zero, offset = run(v, jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32))
    reads, transition = run(jnp.zeros((*v.shape[:3], key_dim), v.dtype),
                            jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32),
                                             (batch, heads, key_dim, key_dim)))
    transitions, offsets = _from_every_shard(transition), _from_every_shard(offset)  # [P, ...]
    restarts = (jnp.zeros(transitions.shape[:2], bool) if segment_ids is None
                else shards_start_documents(segment_ids))
    entering, final_state = entering_states(transitions, offsets, restarts,
                                            varying_like(initial_state, transitions))
    o = o_from_zero + einsum("bthk,bhkv->bthv", reads.astype(jnp.float32),
                             entering[shard_index()])
    return o.astype(v.dtype), final_state


def context_parallel_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    attend=kda_attention,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, jax.Array | None]:
    """`kda.kda_attention` with the tokens split over the current mesh's `seq` axis (module
    docstring); called under `jax.set_mesh`, outside `shard_map`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; T must divide
        by the `seq` axis size.
      attend: the op each shard runs on its tokens, with `kda_attention`'s signature
        (`kda_attention`, or `kda.segments.kda_attention_in_segments` with its segment size).
      initial_state: float32 [B, HV, K, V] or None (zeros).
      output_final_state: also return the state after the last token.
      segment_ids: integer [B, T] for packed documents, or None.
      options: the other keyword arguments of `kda_attention` (scale, use_qk_l2norm,
        gate_lower_bound, impl, check_inputs), the same on every shard.
    Returns:
      (o [B, T, HV, V] in v's dtype, final_state float32 [B, HV, K, V] or None).
    """
    batch, length, heads, key_dim = q.shape
    if initial_state is None:
        initial_state = jnp.zeros((batch, v.shape[2], key_dim, v.shape[3]), jnp.float32)
    tokens = ("batch", "seq", "heads", None)
    states = ("batch", "heads", None, None)
    sharded = over_token_shards(
        functools.partial(kda_attention_on_shard, attend=attend, options=options),
        in_names=(tokens, tokens, tokens, tokens, tokens[:3], states, ("batch", "seq")),
        out_names=(tokens, states), batch=batch, length=length, heads=heads)
    o, final_state = sharded(q, k, v, g, beta, initial_state, segment_ids)
    return o, final_state if output_final_state else None
