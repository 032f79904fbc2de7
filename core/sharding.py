"""Sharding by logical axis names: one rules table, a mesh helper, parameter placement.

Every parameter carries logical axis names (`logical(init, ("embed", "mlp"))`, never placed
eagerly, so every module builds with or without a mesh); activations are constrained with the
same vocabulary (`constrain`). `LOGICAL_AXIS_RULES` is the single place where those names meet
the mesh axes:

    mesh axes (outermost first): data, fsdp, expert, seq, tensor

    batch  -> data, fsdp, expert     tokens are split over every data-like axis
    seq    -> seq                    context parallelism: each sequence's tokens in contiguous
                                     shards over the seq axis (`core.context_parallel`)
    embed  -> fsdp, expert, seq      parameters at rest are split ZeRO-3 style over the fsdp,
                                     expert and seq axes (expert ranks are data ranks outside the
                                     MoE; seq ranks hold one sequence's shards and the same
                                     parameters, so they share the parameter state too)
    latent -> fsdp, expert, seq      low-rank / latent widths, when embed is not in the array
    heads, mlp, vocab -> tensor      Megatron-style tensor parallelism
    expert -> expert                 expert parallelism
    kv -> not split

An expert weight [expert, latent, mlp] is thus split over expert, fsdp and tensor; a dense weight
[embed, heads] over fsdp x expert x seq and tensor; an activation [batch, seq, embed] over the
batch axes and seq (embed finds its axes taken).

Resolution follows Flax's convention: a mesh axis already used by an earlier dimension of the
same array is skipped, and so is an axis that does not divide the dimension (that dimension is
then replicated over it). Axes of size 1 are dropped so specs stay readable.
"""

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# seq sits inside the data-like axes, so that tokens [B, T] split over (batch, seq) are, flattened
# to [B T], split over the axes in mesh order, as expert parallelism splits them; tensor stays
# innermost (NVLink on GPUs).
MESH_AXES = ("data", "fsdp", "expert", "seq", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", ("seq",)),
    ("embed", ("fsdp", "expert", "seq")),
    ("latent", ("fsdp", "expert", "seq")),
    ("heads", ("tensor",)),
    ("kv", ()),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("expert", ("expert",)),
)
_RULES = dict(LOGICAL_AXIS_RULES)


def logical(init: Callable, axes: tuple[str | None, ...]) -> Callable:
    """`init` whose parameter carries the logical axis names `axes`. Placement on a mesh is left
    to `init_sharded` / `state_shardings` (never eager), so modules build with or without one."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def logical_param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An `nnx.Param` holding `value` with the logical axis names `axes` (see `logical`)."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)

AnyMesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _mesh_sizes(data: int, fsdp: int, expert: int, seq: int, tensor: int,
                num_devices: int) -> dict:
    sizes = dict(data=data, fsdp=fsdp, expert=expert, seq=seq, tensor=tensor)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1 or any(size < 1 and size != -1 for size in sizes.values()):
        raise ValueError(
            f"mesh axis sizes must be positive, with at most one -1 ('the rest'); got {sizes}"
        )
    if free:
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if num_devices % fixed:
            raise ValueError(
                f"{num_devices} devices do not divide by the fixed axes {sizes} (product {fixed})"
            )
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh axes {sizes} hold {math.prod(sizes.values())} devices, but {num_devices} are "
            "given; make the product match (or set one axis to -1)"
        )
    return sizes


def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    expert: int = 1,
    seq: int = 1,
    tensor: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> jax.sharding.Mesh:
    """A (data, fsdp, expert, seq, tensor) mesh over `devices` (default: all), Auto axis types.

    One axis may be -1: it takes the devices the others leave. Tensor is innermost, so on GPUs it
    stays inside a node (NVLink); data is outermost.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = _mesh_sizes(data, fsdp, expert, seq, tensor, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    return jax.sharding.Mesh(
        np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(shape)
    )


def abstract_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, seq: int = 1, tensor: int = 1):
    """A device-free mesh of the given axis sizes, for planning runs larger than this machine."""
    sizes = _mesh_sizes(data, fsdp, expert, seq, tensor, data * fsdp * expert * seq * tensor)
    return jax.sharding.AbstractMesh(
        tuple(sizes[name] for name in MESH_AXES), MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
    )


def logical_to_mesh(
    names: Sequence[str | None], shape: Sequence[int], mesh: AnyMesh
) -> PartitionSpec:
    """The PartitionSpec of an array [shape] whose dimensions have logical `names`."""
    if len(names) != len(shape):
        raise ValueError(f"logical axis names {tuple(names)} do not match shape {tuple(shape)}")
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        if name is not None and name not in _RULES:
            raise ValueError(
                f"unknown logical axis {name!r}; the vocabulary is {sorted(_RULES)} "
                "(core.sharding.LOGICAL_AXIS_RULES)"
            )
        chosen, split = [], 1
        for axis in _RULES.get(name, ()):
            size = sizes.get(axis, 1)
            if size > 1 and axis not in used and dim % (split * size) == 0:
                chosen.append(axis)
                split *= size
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names is not None else (None,) * len(variable.shape)


def state_shardings(state: nnx.State, mesh: AnyMesh) -> nnx.State:
    """The NamedSharding of every variable of `state` (abstract or concrete), same structure.

    Variables without logical names (RNG state, counters) are replicated.
    """

    def sharding(variable: nnx.Variable):
        spec = logical_to_mesh(_logical_names(variable), variable.shape, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(build: Callable[[], nnx.Module], mesh: jax.sharding.Mesh) -> nnx.Module:
    """Builds `build()` with every parameter created directly in its shard (no host copy)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.state(build()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def shard_module(module: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Places an existing module's variables on `mesh`, in place; returns the module."""
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, state_shardings(state, mesh)))
    return module


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains activation x to its logical layout under the mesh set by `jax.set_mesh`.

    A no-op without a mesh, so models run unchanged on one device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(names, x.shape, mesh))


def arrays_are_whole_on_each_device() -> bool:
    """No mesh, a one-device mesh, or inside `shard_map` over all of its axes.

    A `pallas_call` has no partitioning rule: on arrays that `jit` shards over a mesh, XLA would
    gather them whole onto every device, so kernels run only where this holds and the XLA
    computation is used elsewhere.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1 or set(mesh.manual_axes) == set(mesh.axis_names)


def batch_sharding(mesh: AnyMesh, shape: Sequence[int]) -> NamedSharding:
    """Sharding of an input batch [B, ...] (tokens, segment ids [B, T]): B over the batch axes and,
    for arrays of two dimensions or more, T over seq."""
    names = ("batch", "seq", *(None,) * (len(shape) - 2))[:len(shape)]
    return NamedSharding(mesh, logical_to_mesh(names, shape, mesh))


def describe_mesh(mesh: AnyMesh | Mapping[str, int]) -> str:
    """'data=2 fsdp=4 expert=1 seq=1 tensor=1 (8 devices)'."""
    sizes = dict(mesh if isinstance(mesh, Mapping) else mesh.shape)
    body = " ".join(f"{name}={sizes.get(name, 1)}" for name in MESH_AXES)
    return f"{body} ({math.prod(sizes.values())} devices)"
