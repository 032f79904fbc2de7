"""Context parallelism: each sequence's tokens split over the `seq` mesh axis.

On a mesh whose `seq` axis holds P > 1 devices, activations [B, T, ...] are cut into P contiguous
shards of T / P tokens, shard p on the devices of seq index p (`core.sharding`: logical seq ->
mesh seq). `jit` partitions everything that works token by token (projections, norms, AttnRes,
the MoE) with no further help. The token mixers exchange what crosses a shard boundary
themselves, under `jax.shard_map` (`over_token_shards`), manual over every mesh axis, so that
each device holds whole arrays of its own tokens (and the GPU kernels may run there):

    KDA op       each shard's affine state map, all-gathered and combined (`kda.context_parallel`)
    short conv   the previous shard's last W - 1 inputs (`previous_tokens`: one ppermute)
    Gated MLA    every shard's latents (`all_tokens`: one all-gather) for the local queries
                 (`models.attention.context_parallel_attention`)

`previous_tokens`, `all_tokens` and `shard_index` run inside such a `shard_map` only.
"""

from collections.abc import Callable, Sequence

import jax
from jax import lax
from jax.sharding import PartitionSpec

from core.sharding import logical_to_mesh

SEQ_AXIS = "seq"


def context_shards() -> int:
    """P, the devices of the current mesh's `seq` axis (`jax.set_mesh`) that split the tokens: 1
    without a mesh or such an axis, and inside `shard_map` over it (the tokens are local there)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQ_AXIS not in mesh.axis_names or SEQ_AXIS in mesh.manual_axes:
        return 1
    return mesh.shape[SEQ_AXIS]


def shard_index() -> jax.Array:
    """p, this shard's place along the sequence: int32 scalar in 0 .. P - 1."""
    return lax.axis_index(SEQ_AXIS)


def previous_tokens(x: jax.Array, count: int) -> jax.Array:
    """The previous shard's last `count` tokens, zeros on the first shard (a halo):
    x [B, Tl, ...] -> [B, count, ...], count <= Tl."""
    if count > x.shape[1]:
        raise ValueError(
            f"a shard of {x.shape[1]} tokens cannot give the {count} tokens the next one needs: "
            f"use fewer devices on the seq mesh axis or longer sequences"
        )
    shards = lax.axis_size(SEQ_AXIS)
    return lax.ppermute(x[:, x.shape[1] - count:], SEQ_AXIS,
                        [(p, p + 1) for p in range(shards - 1)])


def all_tokens(x: jax.Array) -> jax.Array:
    """Every shard's tokens in sequence order: x [B, Tl, ...] -> [B, P Tl, ...]."""
    return lax.all_gather(x, SEQ_AXIS, axis=1, tiled=True)


def varying_like(x: jax.Array, *arrays: jax.Array) -> jax.Array:
    """x typed as varying over every manual mesh axis that one of `arrays` varies over (a no-op
    outside `shard_map`): a value made inside, the same on every shard, that a `lax.scan` carries
    along with values computed from `arrays` must have their type."""
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
    missing = tuple(varying - jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def over_token_shards(
    fn: Callable,
    *,
    in_names: Sequence[tuple[str | None, ...]],
    out_names,
    batch: int,
    length: int,
    heads: int = 1,
) -> Callable:
    """`fn` under `jax.shard_map` over every axis of the current mesh, its arrays split by
    logical axis names: "batch" over the batch axes and "seq" over `seq` (as `logical_to_mesh`
    resolves them for [batch, length]), "heads" over tensor as it resolves for `heads` heads
    (every array's heads the same way, so grouped value heads stay with their query head),
    anything else whole.

    in_names: one tuple of names per positional argument of `fn`; out_names: the same for its
    outputs (a tuple of tuples for several). Raises ValueError unless `length` divides by the
    `seq` axis.
    """
    mesh = jax.sharding.get_abstract_mesh()
    resolved = logical_to_mesh(("batch", "seq", "heads"), (batch, length, heads), mesh)
    if resolved[1] != SEQ_AXIS:
        raise ValueError(
            f"context parallelism splits the sequence over the seq mesh axis of "
            f"{mesh.shape[SEQ_AXIS]} devices, which does not divide its length {length}: "
            f"choose a length that divides by it"
        )
    axes = dict(zip(("batch", "seq", "heads"), resolved))

    def spec(names):
        return PartitionSpec(*(axes.get(name) for name in names))

    def specs(names):
        return spec(names) if all(isinstance(n, (str, type(None))) for n in names) else tuple(
            map(specs, names))

    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(spec, in_names)),
                         out_specs=specs(out_names))
