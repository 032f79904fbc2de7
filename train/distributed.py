"""Multi-process runs through JAX's own runtime, `jax.distributed`: one process per host (or per
GPU), every process running the same program, one global mesh over all processes' devices, and
XLA's collectives between them (NCCL on GPUs, ICI/DCN on TPUs, gloo on CPUs).

    initialize(coordinator_address="10.0.0.1:8476", num_processes=4, process_id=rank)
    initialize()            # from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
    initialize(auto=True)   # JAX's cluster detection: SLURM, Open MPI, Kubernetes, Cloud TPU

Without any of these the run is one process. Experiments whose parser has the multi-process
options (`train.cli.make_parser(..., multi_process=True)`, as experiments.quickstart,
context_extension and vision_quickstart) take the same settings as --coordinator-address,
--num-processes, --process-id and --distributed-auto; `train.loop.train` calls `initialize()`
itself, so a script launched with the environment variables set joins without code of its own,
provided it touches no device before. See docs/multi_host.md for launch recipes.

What changes with several processes (`train.loop`): the mesh spans `jax.devices()`, all
processes' devices; every process loads only its rows of each training batch, from its own
`DataConfig.shards` (`train.data.make_train_iterator`), and the processes' rows make the global
batch (`process_rows_array`); batches every process reads whole (validation, images, RL) hand
its devices only their shards (`global_batch_array`); orbax saves and restores checkpoints from
all processes into one shared folder; metrics, plots, the summary, the run folder's files and
the progress bar come from process 0 (`is_primary`).
"""

import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

ADDRESS_VARIABLE = "JAX_COORDINATOR_ADDRESS"
PROCESSES_VARIABLE = "JAX_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "JAX_PROCESS_ID"


def _setting(value, variable: str, flag: str, kind=str):
    """`value`, else the environment variable `variable` read as `kind`, else None."""
    if value is not None:
        return value
    text = os.environ.get(variable)
    if text is None or text == "":
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not an integer; set it (or {flag}) to one, "
                         "or unset it") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Joins this process to a multi-process run (`jax.distributed.initialize`) when one is
    asked for; returns whether the run has several processes.

    coordinator_address: "host:port" of process 0's coordinator service (any free port; every
        process passes the same address).
    num_processes, process_id: the run's process count and this process's rank in [0, count).
    Each falls back to its environment variable (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID). auto: let JAX detect the three on a managed cluster (SLURM, Open MPI,
    Kubernetes, Cloud TPU); settings given here still win.

    A second call is a no-op. Must run before JAX touches a device. Raises ValueError naming the
    missing or invalid setting and the flag or variable that sets it.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    address = _setting(coordinator_address, ADDRESS_VARIABLE, "--coordinator-address")
    count = _setting(num_processes, PROCESSES_VARIABLE, "--num-processes", int)
    rank = _setting(process_id, PROCESS_ID_VARIABLE, "--process-id", int)
    if not auto and count is None and rank is None:
        return False  # one process (a lone coordinator address is JAX's own default, unused)
    if not auto:
        if count is None:
            raise ValueError(f"--process-id={rank} was given without the process count; pass "
                             f"--num-processes N (or set {PROCESSES_VARIABLE})")
        if count < 1:
            raise ValueError(f"--num-processes must be at least 1, got {count}")
        if count == 1 and rank in (None, 0):
            return False
        if rank is None:
            raise ValueError(f"--num-processes={count} needs this process's rank: pass "
                             f"--process-id in [0, {count}) (or set {PROCESS_ID_VARIABLE}), a "
                             "different one in each process")
        if not 0 <= rank < count:
            raise ValueError(f"--process-id={rank} must lie in [0, --num-processes={count})")
        if address is None:
            raise ValueError(f"--num-processes={count} needs the coordinator's address: pass "
                             f"--coordinator-address HOST:PORT (process 0's host and a free "
                             f"port, the same in every process) or set {ADDRESS_VARIABLE}")
    if address is not None and not address.rpartition(":")[2].isdigit():
        raise ValueError(f"--coordinator-address={address!r} must be HOST:PORT (process 0's "
                         "host and a free port), e.g. 10.0.0.1:8476")
    from jax._src import xla_bridge  # no public query of whether a backend exists yet

    if xla_bridge.backends_are_initialized():
        raise ValueError("a multi-process run must join jax.distributed before JAX uses any "
                         "device, but this process already has: call "
                         "train.distributed.initialize() first thing in the program")
    jax.distributed.initialize(address, count, rank)
    return jax.process_count() > 1


def is_primary() -> bool:
    """Whether this process writes the run's files, metrics and progress bar (process 0)."""
    return jax.process_index() == 0


def print_primary(*args, **kwargs) -> None:
    """`print` on process 0 only: an experiment's report, once however many processes run it."""
    if is_primary():
        print(*args, **kwargs)


def sync(name: str) -> None:
    """Waits until every process has reached the point `name` (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def global_batch_array(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of `value`, the whole batch on this host (the same in every process),
    placed by `sharding`: each process transfers only the shards of its own devices."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(np.shape(value), sharding, lambda index: value[index])


def process_rows_array(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array [P * R, ...] whose rows [p * R, (p + 1) * R) are `value` [R, ...] of
    process p, placed by `sharding` (which must keep each process's devices within its own
    rows, as a batch axis split over processes in device order does)."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    rows = np.shape(value)[0]
    global_shape = (rows * jax.process_count(), *np.shape(value)[1:])
    first = jax.process_index() * rows
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        start, stop, _ = index[0].indices(global_shape[0])
        if start < first or stop > first + rows:
            raise ValueError(
                f"process {jax.process_index()} loads rows [{first}, {first + rows}) of the "
                f"batch, but its devices hold rows [{start}, {stop}) under {sharding}; split the "
                "batch over mesh axes whose devices are grouped by process (the data axis "
                "outermost)"
            )
    return jax.make_array_from_process_local_data(sharding, value, global_shape)


def gather_json(value) -> list:
    """`value` (anything JSON can write) of every process, in process order; every process
    must call it at the same point of the program."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size]))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(row[:size].tobytes()) for row, size in zip(gathered, sizes, strict=True)]


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of `x` as numpy in every process (gathered across processes when its shards
    live on other processes' devices)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
