"""Token dispatch to routed experts: dropless on one device, fixed-capacity expert parallel.

Dropless (`dropless_moe`): sort the T·k token copies by expert, run every expert's GLU MLP with two
grouped matmuls, un-sort, and sum each token's k outputs with its mixture weights. The sort moves
rows with gathers whose gradients are gathers too (`gather_rows`), so no scatter-add appears in
the backward pass, which is where XLA's default gather transpose loses its time on GPU.

Expert parallel (`expert_parallel_moe`, under `jax.shard_map`): experts are split over the mesh
axis `expert`, tokens over all mesh axes. Each shard packs its token copies into a fixed buffer
per destination shard (`capacity` rows, first choices first), exchanges buffers with
`jax.lax.all_to_all`, runs the dropless path on what it received, and sends the results back.
Copies beyond a full buffer are dropped and counted; `capacity_factor=None` sizes the buffers so
that nothing can be dropped, and then the result equals `dropless_moe`.

Data parallel (`data_parallel_moe`, under `jax.shard_map`): on a mesh without an `expert` axis,
each device runs the dropless path on its own tokens with every expert's weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe import grouped_matmul as grouped
from moe.activations import fused_glu, glu_kernel_runs
from moe.grouped_matmul import ROW_MULTIPLE, grouped_matmul, mosaic_gpu_supports
from moe.kernels.mosaic_gpu.ragged_matmul import (
    ragged_matmul,
    ragged_matmul_glu,
    ragged_matmul_glu_grad,
)
from moe.kernels.mosaic_gpu.tiling import GLU_CONFIG, config_for, glu_config_for
from moe.routing import PERMUTATION_NAME, load_counts

EXPERT_AXIS = "expert"

Activation = Callable[[jax.Array, jax.Array], jax.Array]


class DispatchPlan(NamedTuple):
    """How rows are grouped by expert.

    order: [R] int32 row indices in expert order (stable; rows without an expert last).
    inverse: [R] int32 position of each row in that order (`order[inverse] == arange(R)`).
    group_sizes: [E] int32 rows per expert.
    """

    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def plan_dispatch(
    row_expert: jax.Array, num_experts: int, row_valid: jax.Array | None = None
) -> DispatchPlan:
    """Sort rows by expert. row_expert: [R] int, row_valid: [R] bool (None = all valid)."""
    key = row_expert.astype(jnp.int32)
    if row_valid is not None:
        key = jnp.where(row_valid, key, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    # order is a permutation: with unique indices XLA writes each element once, no atomics.
    positions = jnp.arange(order.shape[0], dtype=jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(positions, unique_indices=True)
    group_sizes = load_counts(key, num_experts).astype(jnp.int32)
    return DispatchPlan(order, inverse, group_sizes)


def expert_mlp(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    activation: Activation,
    *,
    backend: str = "auto",
    fuse_glu_epilogues: bool = False,
    rows_past_groups: bool = False,
) -> jax.Array:
    """Every expert's GLU MLP on its rows.

    Args:
        x_sorted: [R, W] rows grouped by expert.
        group_sizes: [E] rows per expert.
        w_in: [E, W, 2, M] gate (index 0) and up (index 1) projections.
        w_out: [E, M, W] down projections.
        activation: `act(gate, up)` -> float32.
        backend: grouped matmul backend.
        fuse_glu_epilogues: run `fused_expert_mlp` (the activation in the grouped matmuls'
            epilogues) where `fused_epilogues_apply`; elsewhere, or when False, the grouped
            matmul, `fused_glu`, grouped matmul path.
        rows_past_groups: whether rows at or past sum(group_sizes) may exist (expert
            parallelism's capacity slack). The Mosaic GPU kernels leave such rows unwritten, and
            JAX's weight-gradient kernel masks rows by multiplying, so a NaN left there would
            reach the weight gradients (through the GLU's backward too). With it, the first
            product's rows past the groups are selected to zero (one pass over [R, 2M]; the
            fused path is not taken).

    Returns:
        [R, W] in x_sorted.dtype; rows past the groups are unspecified (callers select them away).
    """
    num_experts, width, _, hidden = w_in.shape
    w_gate_up = w_in.reshape(num_experts, width, 2 * hidden)
    if (fuse_glu_epilogues and not rows_past_groups
            and fused_epilogues_apply(x_sorted, w_gate_up, w_out, backend)):
        return fused_expert_mlp(
            activation,
            x_sorted,
            group_sizes.astype(jnp.int32),
            w_gate_up.astype(x_sorted.dtype),
            w_out.astype(x_sorted.dtype),
        )
    gate_up = grouped_matmul(x_sorted, w_gate_up, group_sizes, backend=backend)
    if rows_past_groups:
        in_groups = jnp.arange(gate_up.shape[0]) < jnp.sum(group_sizes)
        gate_up = jnp.where(in_groups[:, None], gate_up, 0)
    hidden_act = fused_glu(activation, gate_up.reshape(-1, 2, hidden))
    return grouped_matmul(hidden_act, w_out, group_sizes, backend=backend)


def fused_epilogues_apply(x_sorted, w_gate_up, w_out, backend: str) -> bool:
    """Whether `expert_mlp` may take `fused_expert_mlp`: where its unfused path would run the
    Mosaic GPU grouped matmuls (Hopper, supported shapes and dtypes) and the Pallas GLU kernels
    (`moe.activations`' conditions: a GPU, arrays whole on the device), with M a multiple of the
    GLU kernels' 128-column tiles.

    x_sorted: [R, W], w_gate_up: [E, W, 2M], w_out: [E, M, W] (arrays or ShapeDtypeStructs).
    """
    rows, hidden = x_sorted.shape[0], w_out.shape[1]
    as_lhs_dtype = functools.partial(jax.ShapeDtypeStruct, dtype=x_sorted.dtype)
    return (
        backend in ("auto", "mosaic_gpu")
        and hidden % GLU_CONFIG.tile_n == 0
        and mosaic_gpu_supports(x_sorted, as_lhs_dtype(w_gate_up.shape))
        and mosaic_gpu_supports(as_lhs_dtype((rows, hidden)), as_lhs_dtype(w_out.shape))
        and glu_kernel_runs(as_lhs_dtype((rows, 2, hidden)))
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_expert_mlp(
    activation: Activation,
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate_up: jax.Array,
    w_out: jax.Array,
) -> jax.Array:
    """`expert_mlp` with the activation in the grouped matmuls' epilogues (Hopper kernels).

    The forward's first product writes gate_up (the backward's residual, as `fused_glu` keeps it)
    and h = activation(gate, up) in its epilogue (`ragged_matmul_glu`), and the second reads h.
    The backward's input gradient of the second product writes d(gate_up), the activation's VJP
    at the saved gate_up, instead of d_h (`ragged_matmul_glu_grad`). Unlike the unfused path, no
    GLU kernel runs: the forward does not re-read gate_up, the backward does not write and
    re-read d_h. The bf16 roundings are the unfused path's (gate_up, h, y; d_h, d(gate_up)).

    Args:
        activation: `act(gate, up)` -> float32, elementwise.
        x_sorted: [R, W] rows grouped by expert, bf16 or f16.
        group_sizes: [E] int32 rows per expert.
        w_gate_up: [E, W, 2M] gate columns [0, M), up columns [M, 2M), x_sorted.dtype.
        w_out: [E, M, W], x_sorted.dtype.

    Returns:
        [R, W] in x_sorted.dtype; rows at or past sum(group_sizes) are left unwritten (in the
        gradient of x_sorted too), as `grouped_matmul`'s "mosaic_gpu" backend leaves them.
    """
    return _fused_expert_mlp_forward(activation, x_sorted, group_sizes, w_gate_up, w_out)[0]


def _fused_expert_mlp_forward(activation, x_sorted, group_sizes, w_gate_up, w_out):
    width, hidden = x_sorted.shape[1], w_out.shape[1]
    gate_up, hidden_act = ragged_matmul_glu(
        x_sorted, w_gate_up, group_sizes, activation, config=glu_config_for(width)
    )
    y = ragged_matmul(hidden_act, w_out, group_sizes, config=config_for(hidden, width))
    return y, (x_sorted, group_sizes, w_gate_up, w_out, gate_up, hidden_act)


def _fused_expert_mlp_backward(activation, residuals, out_grad):
    x_sorted, group_sizes, w_gate_up, w_out, gate_up, hidden_act = residuals
    rows, width = x_sorted.shape
    out_grad = out_grad.astype(x_sorted.dtype)
    gate_up_grad = ragged_matmul_glu_grad(
        out_grad, w_out, group_sizes, gate_up, activation, transpose_rhs=True,
        config=glu_config_for(width),
    ).reshape(rows, w_gate_up.shape[2])
    x_grad = ragged_matmul(
        gate_up_grad, w_gate_up, group_sizes, transpose_rhs=True,
        config=config_for(w_gate_up.shape[2], width),
    )
    return (
        x_grad,
        None,
        grouped.weight_gradient(x_sorted, gate_up_grad, group_sizes),
        grouped.weight_gradient(hidden_act, out_grad, group_sizes),
    )


fused_expert_mlp.defvjp(_fused_expert_mlp_forward, _fused_expert_mlp_backward)


def combine(y_copies: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted sum of each token's expert outputs (float32 accumulation).

    y_copies: [T, k, W], weights: [T, k] -> [T, W] in y_copies.dtype. Written as a multiply and a
    sum (not an einsum, which XLA would lower to a batched matrix-vector product) so that it fuses
    with the gather that produces y_copies.
    """
    products = y_copies.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
    return jnp.sum(products, axis=1).astype(y_copies.dtype)


def dropless_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    activation: Activation,
    *,
    backend: str = "auto",
    fuse_glu_epilogues: bool = False,
) -> jax.Array:
    """Routed-expert output of every token, no token copy dropped.

    Args:
        x: [T, W] expert inputs.
        expert_ids: [T, k] int experts of each token.
        weights: [T, k] mixture weights (0 for copies that should not count).
        w_in: [E, W, 2, M], w_out: [E, M, W] expert weights (cast to x.dtype).
        activation: `act(gate, up)` -> float32.
        backend: grouped matmul backend.
        fuse_glu_epilogues: as in `expert_mlp`.

    Returns:
        [T, W] `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, in x.dtype.
    """
    _check_dispatch_args(x, expert_ids, weights, w_in, w_out)
    k = expert_ids.shape[1]
    plan = jax.tree.map(lambda a: checkpoint_name(a, PERMUTATION_NAME),
                        plan_dispatch(expert_ids.reshape(-1), w_in.shape[0]))
    x_sorted = checkpoint_name(gather_rows(x, plan.order // k, plan.inverse, k), PERMUTATION_NAME)
    y_sorted = expert_mlp(
        x_sorted,
        plan.group_sizes,
        w_in.astype(x.dtype),
        w_out.astype(x.dtype),
        activation,
        backend=backend,
        fuse_glu_epilogues=fuse_glu_epilogues,
    )
    return unsort_combine(y_sorted, weights, plan.order, plan.inverse)


def data_parallel_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    activation: Activation,
    *,
    backend: str = "auto",
    fuse_glu_epilogues: bool = False,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> jax.Array:
    """`dropless_moe` on each device's own tokens, for a mesh without an `expert` axis.

    Under plain `jit` the dispatch sorts the T·k token copies of the whole batch, a sort XLA's
    partitioner does not split: every device would gather every device's tokens and run all of
    them through the experts. Here (under `jax.shard_map`, tokens split over all mesh axes) each
    device sorts and runs only its T/P tokens; the expert weights enter whole on every device, as
    fsdp gathers any weight for its matmul, and their gradients are summed over the devices.

    Args:
        x, expert_ids, weights, w_in, w_out, activation, backend, fuse_glu_epilogues: as in
            `dropless_moe`; the token count T must divide by the mesh size.
        mesh: the mesh (None = the one set by `jax.set_mesh`).

    Returns:
        [T, W] equal to `dropless_moe`'s.
    """
    _check_dispatch_args(x, expert_ids, weights, w_in, w_out)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    _check_token_split(x.shape[0], mesh)
    tokens = P(mesh.axis_names)
    body = functools.partial(dropless_moe, activation=activation, backend=backend,
                             fuse_glu_epilogues=fuse_glu_epilogues)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(tokens, tokens, tokens, P(), P()), out_specs=tokens,
    )(x, expert_ids, weights, w_in.astype(x.dtype), w_out.astype(x.dtype))


def _check_token_split(num_tokens: int, mesh) -> None:
    """The token-sharded dispatches split the tokens over all mesh axes: they must divide."""
    if num_tokens % mesh.size:
        raise ValueError(
            f"the token count {num_tokens} must divide by the mesh size {mesh.size} "
            f"(tokens are split over all mesh axes {mesh.axis_names})."
        )


def expert_parallel_moe(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    activation: Activation,
    *,
    copy_mask: jax.Array | None = None,
    capacity_factor: float | None = None,
    backend: str = "auto",
    fuse_glu_epilogues: bool = False,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`dropless_moe` with experts sharded over the `expert` mesh axis (fixed-capacity all-to-all).

    Args:
        x, expert_ids, weights, w_in, w_out, activation, backend, fuse_glu_epilogues: as in
            `dropless_moe`; the token count must divide by the mesh size and E by the `expert`
            axis size.
        copy_mask: [T, k] bool, copies to send (None = all); the others contribute nothing and
            take no buffer room.
        capacity_factor: buffer rows per destination shard = ceil(capacity_factor · n·k / P) for
            n local tokens and P expert shards, rounded up to a multiple of 8; None = n·k, which
            never drops.
        mesh: the mesh (None = the one set by `jax.set_mesh`).

    Returns:
        y: [T, W] as `dropless_moe` (dropped copies contribute 0).
        dropped: [] float32 number of token copies dropped, over all shards.
    """
    _check_dispatch_args(x, expert_ids, weights, w_in, w_out)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if EXPERT_AXIS not in mesh.axis_names:
        raise ValueError(
            f"expert_parallel_moe needs a mesh with an {EXPERT_AXIS!r} axis, got axes "
            f"{mesh.axis_names}; build one with jax.make_mesh(..., ('{EXPERT_AXIS}',)) and "
            "jax.set_mesh, or use dropless_moe."
        )
    shards = mesh.shape[EXPERT_AXIS]
    num_experts = w_in.shape[0]
    if num_experts % shards:
        raise ValueError(
            f"num_experts={num_experts} must divide by the '{EXPERT_AXIS}' axis size {shards}."
        )
    _check_token_split(x.shape[0], mesh)
    local_copies = x.shape[0] // mesh.size * expert_ids.shape[1]
    wanted = (
        local_copies
        if capacity_factor is None
        else min(local_copies, math.ceil(capacity_factor * local_copies / shards))
    )
    # Whole row tiles, so that the received buffer suits the GPU grouped-matmul kernels.
    capacity = -(-wanted // ROW_MULTIPLE) * ROW_MULTIPLE
    if copy_mask is None:
        copy_mask = jnp.ones(expert_ids.shape, bool)
    tokens = P(mesh.axis_names)
    experts = P(EXPERT_AXIS)
    body = functools.partial(
        _expert_parallel_shard,
        activation=activation,
        capacity=capacity,
        backend=backend,
        fuse_glu_epilogues=fuse_glu_epilogues,
        all_axes=mesh.axis_names,
    )
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, tokens, experts, experts),
        out_specs=(tokens, P()),
    )(x, expert_ids, weights, copy_mask, w_in.astype(x.dtype), w_out.astype(x.dtype))


def _expert_parallel_shard(
    x, expert_ids, weights, copy_mask, w_in, w_out, *, activation, capacity, backend,
    fuse_glu_epilogues, all_axes
):
    """One shard's part of `expert_parallel_moe` (local tokens n, local experts E/P)."""
    shards = jax.lax.axis_size(EXPERT_AXIS)
    local_experts = w_in.shape[0]
    num_tokens, k = expert_ids.shape
    width = x.shape[1]

    # Copies in slot-major order (all first choices, then all second choices, ...), so a stable
    # sort by destination keeps first choices ahead and a full buffer drops later choices.
    ids = expert_ids.T.reshape(-1)
    valid = copy_mask.T.reshape(-1)
    destination = ids // local_experts
    by_destination = plan_dispatch(destination, shards, valid)
    starts = jnp.cumsum(by_destination.group_sizes) - by_destination.group_sizes

    # Send buffer slot (d, c) holds the c-th copy bound for shard d, if there is one.
    slot = jnp.arange(capacity)
    source_position = jnp.minimum(starts[:, None] + slot, ids.shape[0] - 1)
    source_copy = by_destination.order[source_position]
    slot_used = slot < by_destination.group_sizes[:, None]
    send_x = jnp.where(slot_used[..., None], x[source_copy % num_tokens], 0)
    send_expert = jnp.where(slot_used, ids[source_copy] % local_experts, local_experts)

    recv_x = jax.lax.all_to_all(send_x, EXPERT_AXIS, 0, 0)
    recv_expert = jax.lax.all_to_all(send_expert, EXPERT_AXIS, 0, 0).reshape(-1)
    rows = recv_x.reshape(shards * capacity, width)
    row_used = recv_expert < local_experts
    plan = plan_dispatch(recv_expert, local_experts, row_used)
    y_sorted = expert_mlp(
        gather_rows(rows, plan.order, plan.inverse, 1),
        plan.group_sizes,
        w_in,
        w_out,
        activation,
        backend=backend,
        fuse_glu_epilogues=fuse_glu_epilogues,
        rows_past_groups=True,
    )
    # Rows past the groups are padding the grouped matmul may leave unwritten: select, never
    # multiply, so that whatever they hold cannot leak.
    y_rows = jnp.where(row_used[:, None], gather_rows(y_sorted, plan.inverse, plan.order, 1), 0)
    back = jax.lax.all_to_all(y_rows.reshape(shards, capacity, width), EXPERT_AXIS, 0, 0)

    position = by_destination.inverse - starts[destination]
    kept = valid & (position < capacity)
    flat_slot = destination * capacity + jnp.minimum(position, capacity - 1)
    y_copies = jnp.where(kept[:, None], back.reshape(-1, width)[flat_slot], 0)
    y_copies = y_copies.reshape(k, num_tokens, width).transpose(1, 0, 2)
    dropped = jnp.sum(valid & ~kept).astype(jnp.float32)
    return combine(y_copies, weights), jax.lax.psum(dropped, all_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x, index, transpose_index, group):
    """`x[index]`, where `index` repeats each row of x `group` times at positions `transpose_index`.

    x: [S, W], index: [S·group], transpose_index: [S·group] with
    `index[transpose_index[s·group + j]] == s`. The gradient is then a gather and a sum over the
    group (`g[transpose_index].reshape(S, group, W).sum(1)`) instead of a scatter-add.
    """
    return x[index]


def _gather_rows_forward(x, index, transpose_index, group):
    return x[index], (index, transpose_index)


def _gather_rows_backward(group, residuals, out_grad):
    index, transpose_index = residuals
    rows = out_grad[transpose_index]
    x_grad = rows.reshape(-1, group, rows.shape[-1]).sum(axis=1, dtype=jnp.float32)
    return x_grad.astype(out_grad.dtype), None, None


gather_rows.defvjp(_gather_rows_forward, _gather_rows_backward)


@jax.custom_vjp
def unsort_combine(y_sorted, weights, order, inverse):
    """`combine` of expert outputs in token order: out[t] = sum_j w[t, j] y_sorted[inv[t·k + j]].

    y_sorted: [T·k, W] expert outputs in expert order, weights: [T, k], order/inverse: the
    `DispatchPlan` of the T·k copies. The gradient of y_sorted is gathered straight from the
    [T, W] output gradient (`dy_sorted[p] = w[order[p]] · g[order[p] // k]`), never through a
    materialised [T, k, W] cotangent.
    """
    num_tokens, k = weights.shape
    return combine(y_sorted[inverse].reshape(num_tokens, k, -1), weights)


def _unsort_combine_forward(y_sorted, weights, order, inverse):
    return unsort_combine(y_sorted, weights, order, inverse), (y_sorted, weights, order, inverse)


def _unsort_combine_backward(residuals, out_grad):
    y_sorted, weights, order, inverse = residuals
    num_tokens, k = weights.shape
    out_grad = out_grad.astype(jnp.float32)
    sorted_weights = weights.reshape(-1)[order].astype(jnp.float32)
    y_grad = out_grad[order // k] * sorted_weights[:, None]
    y_copies = y_sorted[inverse].reshape(num_tokens, k, -1).astype(jnp.float32)
    weights_grad = jnp.sum(y_copies * out_grad[:, None, :], axis=-1)
    return y_grad.astype(y_sorted.dtype), weights_grad.astype(weights.dtype), None, None


unsort_combine.defvjp(_unsort_combine_forward, _unsort_combine_backward)


def _check_dispatch_args(x, expert_ids, weights, w_in, w_out):
    if x.ndim != 2:
        raise ValueError(f"x must be [T, W], got shape {x.shape}.")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [T={x.shape[0]}, k], got {expert_ids.shape}.")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights must match expert_ids {expert_ids.shape}, got {weights.shape}.")
    if w_in.ndim != 4 or w_in.shape[1] != x.shape[1] or w_in.shape[2] != 2:
        raise ValueError(f"w_in must be [E, W={x.shape[1]}, 2, M], got {w_in.shape}.")
    expected_out = (w_in.shape[0], w_in.shape[3], x.shape[1])
    if w_out.shape != expected_out:
        raise ValueError(f"w_out must be [E, M, W] = {expected_out}, got {w_out.shape}.")
