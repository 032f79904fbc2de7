"""Checkpoints of a training run: the whole train state, the data iterator and run metadata,
each verified against checksums when it is read back.

    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"))
    checkpointer.save(step, state, data_iterator, metadata={"config": ...})
    state, metadata = checkpointer.restore(abstract_state, data_iterator)   # latest step
    resumed = checkpointer.restore_newest_intact(abstract_state, make_iterator)  # skips damage

One checkpoint is an orbax `Composite` of three items: `state` (the split `TrainState`: model
parameters, router biases, optimizer moments and counters, any RNG streams), `data` (the grain
iterator's position, `iterator.get_state()` as JSON, taken when `save` is called so that the
asynchronous write cannot see a later position), and `meta` (step, config, anything JSON, and
the checksums below).

Saves are asynchronous: `save` returns once the arrays are copied off the device, and the files
are written in the background. orbax writes each step into `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` only when every item is complete, so a process killed during a save
leaves the previous checkpoints restorable; the unfinished folder is ignored and replaced when
the step is saved again. A background write that fails (a full disk, a permission change) is
raised by the next `save`, `wait` or `close` as one `CheckpointError` naming the step folder and
the OS error; the earlier checkpoints are left as they were.

Integrity: `save` records two 32-bit checksums of every array of the state (`state_checksums`,
computed on the device by one jitted function: each array's bits as uint32 words, their
wrapping sum and a position-mixed wrapping sum, so a sharded array never leaves its devices) and
the sha256 of the data iterator's state (`data_sha256`) in the `meta` item. `restore` recomputes
both after reading and compares. Any failure to read a checkpoint (orbax, TensorStore or JSON
errors, a missing or empty file, a checksum mismatch) raises `CheckpointError`, a ValueError
whose one-line message names the step, its folder and the cause (the array's path for a
mismatch). Array files are zstd-compressed and most damage fails decompression, but damage
inside a block that zstd stored uncompressed reads back silently changed: only the checksums see
it. Checkpoints written without checksums restore unverified.

`restore_newest_intact` (what `train(..., resume=True)` uses) tries the steps newest first and
moves each damaged one newer than the checkpoint it restores aside to `<step>.damaged` (orbax
ignores the name; nothing is deleted, and the step can be saved again); when every checkpoint is
damaged it raises a `CheckpointError` naming each.

Importing this module changes two things in orbax, so that a failure reads as one error rather
than a wall of tracebacks: orbax's event-loop runner (`asyncio_utils._run_sync_via_new_loop`)
lets the sibling tasks of a failed read or write finish before it closes the loop (orbax's own
closes it under them, and each prints a traceback: thousands of lines for one damaged file),
and a filter on the `absl` logger cuts orbax's error records to one line each, one per cause.
Neither changes a save or restore that succeeds.
"""

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint._src import asyncio_utils as _orbax_asyncio

# Reserved keys of the `meta` item.
STATE_CHECKSUMS = "state_checksums"
DATA_SHA256 = "data_sha256"
# Where a damaged step folder is moved by `restore_newest_intact` (orbax skips such names).
DAMAGED_SUFFIX = ".damaged"
# Files every complete checkpoint holds (relative to its step folder); used only to name what
# is missing or empty when orbax fails to read one.
_EXPECTED_FILES = ("state/_METADATA", "data/metadata", "meta/metadata")
# Odd 32-bit constants of the position mixing (Knuth's golden-ratio and MurmurHash3's fmix).
_GOLDEN, _FMIX = 0x9E3779B1, 0x85EBCA6B
# How long a failed save waits for orbax's other writer threads to end.
_WRITER_JOIN_SECONDS = 60.0
# Longest cause quoted in a CheckpointError (orbax causes can embed whole TensorStore specs).
_MAX_CAUSE = 300


class CheckpointError(ValueError):
    """A checkpoint that cannot be read back as it was saved, or could not be written.

    step, path: the checkpoint's step and folder; reason: the one-line cause.
    """

    def __init__(self, step: int, path: str, reason: str):
        super().__init__(f"checkpoint step {step} ({path}): {reason}")
        self.step, self.path, self.reason = step, path, reason


@dataclasses.dataclass
class Resumed:
    """What `Checkpointer.restore_newest_intact` returns.

    step, state, data_iterator, metadata: the restored checkpoint (the iterator at its position).
    damaged: (error, moved_to) for each newer checkpoint that could not be restored and was moved
        aside, newest first.
    """

    step: int
    state: nnx.State
    data_iterator: grain.DatasetIterator
    metadata: dict
    damaged: list[tuple[CheckpointError, str]]


# -- checksums -------------------------------------------------------------------------------


def _words(x: jax.Array) -> jax.Array | None:
    """The bits of `x` as uint32 words: one per element of an 8-, 16- or 32-bit dtype (zero
    extended), two per element of a 64-bit one (a trailing axis); None for other dtypes."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
        return None
    try:
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    except (TypeError, ValueError):  # sub-byte or complex dtypes: left unchecked
        return None


def _array_checksum(x: jax.Array) -> jax.Array | None:
    """uint32 [2]: the wrapping sum of `x`'s words, and the wrapping sum of each word mixed with
    its row-major position (so that moved or swapped words change it too)."""
    words = _words(x)
    if words is None:
        return None
    # Row-major element index, built from one iota per axis (no reshape: a sharded array stays
    # in its shards), wrapping past 2**32 words.
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    mixed = (words ^ (index * jnp.uint32(_GOLDEN))) * jnp.uint32(_FMIX)
    mixed = mixed ^ (mixed >> 16)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


_tree_checksums = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))


def _path_name(path) -> str:
    """A state leaf's path as orbax names it in its files: "model.embed.embedding.value"."""
    parts = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def state_checksums(state: nnx.State) -> dict[str, str]:
    """{leaf path: "xxxxxxxx-xxxxxxxx"}: the two hex checksums of each array of `state`, computed
    on its devices (one read of the state, no host copy; leaves of other dtypes are left out)."""
    sums = jax.device_get(_tree_checksums(state))
    return {
        _path_name(path): "-".join(f"{int(value):08x}" for value in np.asarray(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(sums)[0]
    }


def _json_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# -- one-line causes of orbax's failures -----------------------------------------------------


def _innermost(error: BaseException) -> BaseException:
    """The deepest exception of `error`'s cause chain: orbax wraps TensorStore's precise message
    ("Error reading <array> in OCDBT database at <folder>: ...") in generic ones."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    return error


def _one_line(error: BaseException) -> str:
    """The innermost cause of `error` on one line, led by the OS error when TensorStore reports
    one ("[Errno 28] No space left on device (RESOURCE_EXHAUSTED: Error writing ...)"), cut to
    `_MAX_CAUSE` characters."""
    inner = _innermost(error)
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = lines[0] if lines else type(inner).__name__
    if isinstance(inner, json.JSONDecodeError):
        text = f"invalid JSON ({text})"
    text = text if len(text) <= _MAX_CAUSE else text[:_MAX_CAUSE] + "..."
    code = re.search(r"os_error_code='(\d+)'", str(inner))
    if code and not isinstance(inner, OSError):
        number = int(code.group(1))
        text = f"[Errno {number}] {os.strerror(number)} ({text})"
    return text


def _missing_files(step_dir: str) -> list[str]:
    """The expected files of a checkpoint folder that are missing or empty, as phrases."""
    problems = []
    for name in _EXPECTED_FILES:
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) == 0:
            problems.append(f"{name} is empty")
    return problems


def _unreadable(step_dir: str, error: BaseException) -> str:
    """Why orbax could not read the checkpoint in `step_dir`, in one line."""
    problems = _missing_files(step_dir)
    cause = _one_line(error)
    return "; ".join(problems + [f"orbax: {cause}"]) if problems else cause


# -- orbax's event loops ---------------------------------------------------------------------


def _run_sync_draining(coro):
    """orbax's `_run_sync_via_new_loop` (run `coro` on a fresh event loop, then close it), except
    that when `coro` fails, the tasks it started are run to completion before the loop closes.

    orbax gathers one task per array read or write; when one fails, orbax's version closes the
    loop under the others, and each of them later prints a traceback ("Event loop is closed",
    "Task exception was never retrieved", exceptions ignored in coroutines): hundreds to
    thousands of lines around the one error that matters. On success nothing differs.
    """
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(coro)
        except Exception:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


if hasattr(_orbax_asyncio, "_run_sync_via_new_loop"):
    _orbax_asyncio._run_sync_via_new_loop = _run_sync_draining


class _OneLineOrbaxErrors(logging.Filter):
    """Cuts orbax's error log records to one line each, and one record per cause (per OS error).

    orbax logs a failed background write from several threads, each record with its traceback
    (tens of lines); the Checkpointer raises the failure itself, with the traceback chained, as
    a CheckpointError. What stays is the first record of each cause, as one line with the cause
    appended, printed when the failure happens rather than at the next save.
    """

    _MAX_REMEMBERED = 64

    def __init__(self):
        super().__init__()
        self._causes: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.exc_info and "orbax" in record.pathname.replace(os.sep, "/").split("/")):
            return True
        error = record.exc_info[1]
        cause = _one_line(error) if error is not None else ""
        # One record per OS error (a full disk fails every file being written), else per cause.
        key = (re.match(r"\[Errno \d+\]", cause) or [cause])[0]
        if key in self._causes:
            return False
        self._causes = [*self._causes[-self._MAX_REMEMBERED + 1:], key]
        message = record.getMessage()
        if error is not None and str(error) and str(error) in message:
            message = message.replace(str(error), "")  # it comes back below, as `cause`
        message = " ".join(message.split()).rstrip(":. ")
        record.msg = f"{message}: {cause}" if cause else message
        record.args, record.exc_info, record.exc_text = None, None, None
        return True

    def forget(self) -> None:
        """Lets the next failure's causes be logged again (once one has been raised)."""
        self._causes = []


_ORBAX_LOG_FILTER = _OneLineOrbaxErrors()
logging.getLogger("absl").addFilter(_ORBAX_LOG_FILTER)


# -- the checkpointer ------------------------------------------------------------------------


class Checkpointer:
    """An orbax CheckpointManager for (train state, data iterator, metadata) checkpoints,
    verified by checksums on restore (see the module docstring).

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
        self._writing: int | None = None  # the step whose background write may still fail
        self._closed = False

    def step_dir(self, step: int) -> str:
        """The folder of checkpoint `step`."""
        return os.path.join(self.directory, str(step))

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
        """Starts saving checkpoint `step` (returns before the files are written).

        Raises CheckpointError if the previous save's background write failed, or if this one
        cannot be started (e.g. the folder cannot be created).
        """
        self._finish_write()
        data_state = data_iterator.get_state()
        meta = {**(metadata or {}), "step": step, STATE_CHECKSUMS: state_checksums(state),
                DATA_SHA256: _json_sha256(data_state)}
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_state),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        except Exception as error:
            raise self._write_error(step, error) from error
        self._writing = step

    def _write_error(self, step: int, error: BaseException) -> CheckpointError:
        _ORBAX_LOG_FILTER.forget()
        return CheckpointError(
            step, self.step_dir(step),
            f"could not be written: {_one_line(error)}; the earlier checkpoints are untouched",
        )

    def _finish_write(self) -> None:
        """Waits for the background write; raises its failure as a CheckpointError."""
        step, self._writing = self._writing, None
        if step is None:
            self._manager.wait_until_finished()
            return
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            self._shut_down()
            raise self._write_error(step, error) from error

    def _shut_down(self) -> None:
        """Closes the manager after a failed write and waits for orbax's other writer threads of
        that save, so that they end now rather than fail again, with more log records, when the
        interpreter exits under them."""
        self._closed = True
        try:
            self._manager.close()
        except Exception:  # the failure being reported is the one that matters
            pass
        deadline = time.monotonic() + _WRITER_JOIN_SECONDS
        for thread in threading.enumerate():
            if type(thread).__module__.startswith("orbax.") and thread.is_alive():
                thread.join(max(deadline - time.monotonic(), 0.0))

    def restore(
        self,
        abstract_state: nnx.State,
        data_iterator: grain.DatasetIterator,
        step: int | None = None,
    ) -> tuple[nnx.State, dict]:
        """Loads checkpoint `step` (default: the latest) into arrays shaped and placed like
        `abstract_state` (leaves `jax.ShapeDtypeStruct`, with a `sharding` to place them),
        checks it against its checksums, moves `data_iterator` to the saved position, and
        returns (state, metadata): the step and what `save` was given as metadata.

        Raises FileNotFoundError when there is no complete checkpoint, and CheckpointError
        (naming the step, its folder and the cause) when this one cannot be read back as saved;
        the iterator is left where it was then.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        path = self.step_dir(step)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except MemoryError:
            raise
        except Exception as error:  # orbax, TensorStore and JSON errors alike
            raise CheckpointError(step, path, _unreadable(path, error)) from error
        state, data_state, meta = restored["state"], restored["data"], restored["meta"]
        _verify(step, path, state, data_state, meta)
        try:
            data_iterator.set_state(data_state)
        except Exception as error:
            raise CheckpointError(step, path, f"data: the iterator position does not apply "
                                              f"({_one_line(error)})") from error
        return state, {k: v for k, v in meta.items() if k not in (STATE_CHECKSUMS, DATA_SHA256)}

    def restore_model(self, abstract_model: nnx.State, step: int | None = None) -> nnx.State:
        """Loads only the model's variables (parameters, router biases) of checkpoint `step`
        (default: the latest), without the optimizer moments or the data iterator, into arrays
        shaped and placed like `abstract_model` (leaves `jax.ShapeDtypeStruct` with a sharding:
        any mesh, whatever mesh the run trained on), and checks them against their checksums.

        Raises FileNotFoundError when there is no complete checkpoint, and CheckpointError when
        this one cannot be read back as saved.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        path = self.step_dir(step)
        # The tree as orbax wrote it: nested dicts named by each leaf's path under "model".
        paths_and_leaves, structure = jax.tree_util.tree_flatten_with_path(abstract_model)
        names = [("model", *_path_name(path).split(".")) for path, _ in paths_and_leaves]
        target: dict = {}
        for name, (_, leaf) in zip(names, paths_and_leaves):
            node = target
            for part in name[:-1]:
                node = node.setdefault(part, {})
            node[name[-1]] = leaf
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=x.sharding), target)
        # The state was saved as a standard pytree; orbax's PyTree handler reads the same files
        # and can restore a part of the tree.
        reader = ocp.CheckpointManager(self.directory, item_handlers={
            "state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
        try:
            restored = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=restore_args,
                                             partial_restore=True),
                meta=ocp.args.JsonRestore()))
        except Exception as error:  # orbax, TensorStore and JSON errors alike
            raise CheckpointError(step, path, _unreadable(path, error)) from error
        finally:
            reader.close()
        model = restored["state"]["model"]
        _check_state(step, path, {"model": model}, (restored["meta"] or {}).get(STATE_CHECKSUMS),
                     part="model ")
        leaves = []
        for name in names:
            node = restored["state"]
            for part in name:
                node = node[part]
            leaves.append(node)
        return jax.tree.unflatten(structure, leaves)

    def restore_newest_intact(
        self,
        abstract_state: nnx.State,
        make_iterator: Callable[[int], grain.DatasetIterator],
    ) -> Resumed:
        """Restores the newest checkpoint that reads back intact (`restore`), with a fresh
        iterator from `make_iterator(step)` moved to its position; each newer, damaged one is
        moved aside to `<step>.damaged` (see `set_aside`) and listed in `Resumed.damaged`.

        Raises FileNotFoundError when there is no checkpoint, and CheckpointError naming every
        step and its cause when none is intact (then nothing is moved).
        """
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        errors = []
        for step in steps:
            iterator = make_iterator(step)
            try:
                state, meta = self.restore(abstract_state, iterator, step=step)
            except CheckpointError as error:
                errors.append(error)
                continue
            damaged = [(error, self.set_aside(error.step)) for error in errors]
            return Resumed(step, state, iterator, meta, damaged)
        raise CheckpointError(
            steps[0], self.directory,
            f"none of the {len(steps)} checkpoints can be restored: "
            + "; ".join(f"step {error.step}: {error.reason}" for error in errors),
        )

    def metadata(self, step: int) -> dict:
        """The `meta` item of checkpoint `step` alone (step, config, checksums), unverified.

        Raises CheckpointError when it cannot be read.
        """
        path = self.step_dir(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as error:
            raise CheckpointError(step, path, _unreadable(path, error)) from error
        return meta["meta"]

    def set_aside(self, step: int) -> str:
        """Renames checkpoint `step`'s folder to `<step>.damaged` (`.damaged.2`, ... if taken),
        which orbax ignores, so the step can be saved again; returns the new path."""
        source = self.step_dir(step)
        target, number = source + DAMAGED_SUFFIX, 1
        while os.path.exists(target):
            number += 1
            target = f"{source}{DAMAGED_SUFFIX}.{number}"
        os.rename(source, target)
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until the background writes have finished; raises a failed one as a
        CheckpointError."""
        self._finish_write()

    def close(self) -> None:
        """Finishes pending writes (raising a failed one as a CheckpointError) and releases
        the manager."""
        try:
            self._finish_write()
        finally:
            if not self._closed:
                self._closed = True
                self._manager.close()


def _check_state(step: int, path: str, state, expected: dict | None, part: str = "") -> None:
    """Raises CheckpointError naming the arrays of `state` whose checksums differ from the saved
    `expected` ones (None: saved without checksums, unchecked). part: "" when `state` is the
    whole saved state (an array missing on either side differs too), else a word naming the
    part restored ("model "), whose arrays alone are compared."""
    if expected is None:
        return
    actual = state_checksums(state)
    names = set(actual) if part else set(expected) | set(actual)
    differ = sorted(name for name in names if expected.get(name) != actual.get(name))
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3
                                         else "")
        raise CheckpointError(step, path, f"state: {len(differ)} {part}array(s) differ from what "
                                          f"was saved (checksum mismatch): {shown}")


def _verify(step: int, path: str, state: nnx.State, data_state, meta) -> None:
    """Raises CheckpointError where the restored state or iterator position differs from the
    checksums saved with it (checkpoints saved without checksums pass unchecked)."""
    if not isinstance(meta, dict):
        raise CheckpointError(step, path,
                              f"meta: expected a JSON object, got {type(meta).__name__}")
    _check_state(step, path, state, meta.get(STATE_CHECKSUMS))
    if DATA_SHA256 in meta and _json_sha256(data_state) != meta[DATA_SHA256]:
        raise CheckpointError(step, path, "data: the iterator position differs from what was "
                                          "saved (sha256 mismatch)")


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
