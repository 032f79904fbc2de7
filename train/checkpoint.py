"""Checkpoints of a training run: the whole train state, the data iterator and run metadata.

    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    checkpointer.save(step, state, data_iterator, metadata={"config": ...})
    state, metadata = checkpointer.restore(abstract_state, data_iterator)   # latest step

One checkpoint is an orbax `Composite` of three items: `state` (the split `TrainState`: model
parameters, router biases, optimizer moments and counters, any RNG streams), `data` (the grain
iterator's position, `iterator.get_state()` as JSON, taken when `save` is called so that the
asynchronous write cannot see a later position), and `meta` (step, config, anything JSON).

Saves are asynchronous: `save` returns once the arrays are copied off the device, and the files
are written in the background. orbax writes each step into `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` only when every item is complete, so a process killed during a save
leaves the previous checkpoints restorable; the unfinished folder is ignored and replaced when
the step is saved again.
"""

import os

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:
    """An orbax CheckpointManager for (train state, data iterator, metadata) checkpoints.

    directory: where the step folders go (created if missing).
    max_to_keep: how many of the latest checkpoints to keep.
    """

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1, got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: nnx.State,
        data_iterator: grain.DatasetIterator,
        *,
        metadata: dict | None = None,
    ) -> None:
        """Starts saving checkpoint `step` (returns before the files are written)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_iterator.get_state()),
                meta=ocp.args.JsonSave({"step": step, **(metadata or {})}),
            ),
        )

    def restore(
        self,
        abstract_state: nnx.State,
        data_iterator: grain.DatasetIterator,
        step: int | None = None,
    ) -> tuple[nnx.State, dict]:
        """Loads checkpoint `step` (default: the latest) into arrays shaped and placed like
        `abstract_state` (leaves `jax.ShapeDtypeStruct`, with a `sharding` to place them), moves
        `data_iterator` to the saved position, and returns (state, metadata).

        Raises FileNotFoundError when there is no complete checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        data_iterator.set_state(restored["data"])
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        """Blocks until the background writes have finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending writes and releases the manager."""
        self._manager.close()


def abstract_like(state: nnx.State, shardings=None) -> nnx.State:
    """Shape/dtype (and sharding) placeholders of `state`, the restore target.

    shardings: a matching tree of `jax.sharding.Sharding` (`core.sharding.state_shardings`), or
        None to keep each array's current sharding.
    """
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            state,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
