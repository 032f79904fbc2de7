"""Damaged checkpoints, a lost config.json and data changed under a run.

A checkpoint that does not read back as saved (bytes overwritten or cut off, a file missing or
empty, arrays or the data position swapped for another step's) is named with its step and cause,
moved aside to `<step>.damaged`, and `--resume` continues from the newest intact one; with none
intact the error names each. A missing config.json comes back from the checkpoint's metadata.
Rewritten data files are refused on resume, naming the file, unless the change is allowed.

The tests share one finished two-step run (checkpoints 1 and 2) and damage copies of it; most
resume with until_step=1, which restores and verifies without compiling a training step.
"""

import dataclasses
import os
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.small_run import SMALL_RUN, small_run, write_corpus
from train.checkpoint import CheckpointError, Checkpointer, state_checksums
from train.data import file_sha256, make_train_iterator
from train.loop import CHECKPOINT_DIR, MANIFEST_FILE, METRICS_FILE, Trainer, train
from train.metrics import read_json, read_metrics

# The tests that restore a real run (the shared run trains once) are slow.
slow = pytest.mark.slow


@dataclasses.dataclass
class Run:
    config: object
    stages: list
    run_dir: str
    data: list[str]  # the data files: docs.jsonl, notes.txt


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Run:
    """A finished two-step run on two data files, with checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("finished")
    data = write_corpus(root)
    config, stages = small_run([*SMALL_RUN, "data.paths=" + ",".join(data)], [(32, 2, 2)])
    run_dir = str(root / "run")
    train(config, run_dir, stages=stages)
    return Run(config, stages, run_dir, data)


def copy_of(run: Run, tmp_path) -> str:
    """A copy of the finished run's folder to damage."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(run.run_dir, run_dir)
    return run_dir


def resume(run: Run, run_dir: str, **options):
    return train(run.config, run_dir, resume=True, stages=run.stages, **options)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CHECKPOINT_DIR, str(step))


def largest_array_file(folder: str) -> str:
    """The biggest file of a checkpoint's state item (an OCDBT data file holding many arrays)."""
    files = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(folder, "state"))
             for name in names]
    return max(files, key=os.path.getsize)


def overwrite_4k(folder: str) -> None:
    path = largest_array_file(folder)
    with open(path, "r+b") as f:  # a quarter in: usually inside an incompressible raw block
        f.seek(os.path.getsize(path) // 4)
        f.write(np.random.default_rng(0).bytes(4096))


def truncate(folder: str) -> None:
    path = largest_array_file(folder)
    os.truncate(path, os.path.getsize(path) // 2)


def delete_tree_metadata(folder: str) -> None:
    os.remove(os.path.join(folder, "state", "_METADATA"))


def empty_data_position(folder: str) -> None:
    open(os.path.join(folder, "data", "metadata"), "w").close()


def arrays_of_step_1(folder: str) -> None:
    """Valid arrays with the wrong values: step 1's state item in step 2's folder."""
    shutil.rmtree(os.path.join(folder, "state"))
    shutil.copytree(os.path.join(os.path.dirname(folder), "1", "state"),
                    os.path.join(folder, "state"))


def data_position_of_step_1(folder: str) -> None:
    shutil.copy(os.path.join(os.path.dirname(folder), "1", "data", "metadata"),
                os.path.join(folder, "data", "metadata"))


def fallback_warning(run_dir: str, cause: str) -> str:
    """The warning's pattern for checkpoint 2 damaged with `cause` (a pattern) and 1 intact."""
    return (re.escape(f"checkpoint step 2 ({step_dir(run_dir, 2)}): ") + cause
            + ".*" + re.escape(f"(moved aside to {step_dir(run_dir, 2)}.damaged). Resuming "
                               "from step 1, the newest intact checkpoint."))


@slow
@pytest.mark.parametrize("damage, cause", [
    # Overwritten bytes fail zstd decompression, or, inside a raw block, read back changed and
    # fail the checksum: which one depends on where the 4 KiB land in this run's files.
    (overwrite_4k, r"(state: 1 array\(s\) differ from what was saved \(checksum mismatch\): \S+"
                   r"|[A-Z_]+: Error reading \"\S+\" in OCDBT database)"),
    # (A truncated file: test_resume_after_a_fallback_matches_the_uninterrupted_run.)
    (delete_tree_metadata, r"state/_METADATA is missing"),
    (empty_data_position, r"data/metadata is empty"),
    (arrays_of_step_1, r"state: \d+ array\(s\) differ from what was saved \(checksum mismatch\): "
                       r"model\.\S+"),
    (data_position_of_step_1, r"data: the iterator position differs from what was saved"),
])
def test_resume_falls_back_from_a_damaged_checkpoint(finished, tmp_path, damage, cause):
    run_dir = copy_of(finished, tmp_path)
    damage(step_dir(run_dir, 2))
    with pytest.warns(UserWarning, match=fallback_warning(run_dir, cause)):
        result = resume(finished, run_dir, until_step=1)
    assert result.summary["steps"] == 1
    left = sorted(os.listdir(os.path.join(run_dir, CHECKPOINT_DIR)))
    assert left == ["1", "2.damaged"], left  # moved aside, nothing deleted
    # Rows after the step resumed from are dropped, as after a kill.
    assert {row["step"] for row in read_metrics(os.path.join(run_dir, METRICS_FILE))} == {1}


@slow
def test_a_damaged_checkpoint_is_one_line_naming_step_and_folder(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    truncate(step_dir(run_dir, 2))
    target = Trainer.create(finished.config, abstract=True).state  # shapes and shardings only
    iterator = make_train_iterator(finished.stages[0].data)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint step 2 "
                                                        f"({step_dir(run_dir, 2)}): ")) as caught:
        Checkpointer(os.path.join(run_dir, CHECKPOINT_DIR)).restore(target, iterator, step=2)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 600
    assert caught.value.step == 2 and caught.value.path == step_dir(run_dir, 2)


@slow
def test_every_checkpoint_damaged_names_each_and_moves_none(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    truncate(step_dir(run_dir, 2))
    delete_tree_metadata(step_dir(run_dir, 1))
    message = (r"none of the 2 checkpoints can be restored: step 2: .*Error reading.*; "
               r"step 1: state/_METADATA is missing")
    with pytest.raises(CheckpointError, match=message):
        resume(finished, run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, CHECKPOINT_DIR))) == ["1", "2"]


@slow
def test_resume_after_a_fallback_matches_the_uninterrupted_run(finished, tmp_path):
    """A truncated array file falls back to checkpoint 1; step 2 is trained again from it and
    saved next to 2.damaged; the losses are the uninterrupted run's, bit for bit (the old step 2
    row was dropped, not repeated), and the new checkpoint 2 restores intact."""
    run_dir = copy_of(finished, tmp_path)
    truncate(step_dir(run_dir, 2))
    cause = r"[A-Z_]+: Error reading \"\S+\" in OCDBT database at local file .*2/state/"
    with pytest.warns(UserWarning, match=fallback_warning(run_dir, cause)):
        resume(finished, run_dir)

    def losses(folder):
        return [(row["step"], row["loss"], row["grad_norm"])
                for row in read_metrics(os.path.join(folder, METRICS_FILE)) if "loss" in row]

    assert losses(run_dir) == losses(finished.run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, CHECKPOINT_DIR))) == ["1", "2", "2.damaged"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume(finished, run_dir).summary["steps"] == 2
    assert not [w for w in caught if "damaged" in str(w.message)]  # the new step 2 is intact


@slow
def test_a_missing_config_json_comes_back_from_the_checkpoint(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    config_path = os.path.join(run_dir, "config.json")
    original = read_json(config_path)
    os.remove(config_path)
    message = re.escape(f"{config_path} was missing; rewrote it from the config stored in "
                        "checkpoint step 2")
    with pytest.warns(UserWarning, match=message):
        result = resume(finished, run_dir)
    assert result.summary["steps"] == 2
    assert read_json(config_path) == original


@slow
def test_rewritten_data_is_refused_on_resume_unless_allowed(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    docs, notes = finished.data
    manifest_path = os.path.join(run_dir, MANIFEST_FILE)
    saved = read_json(manifest_path)
    old = file_sha256(notes)
    with open(notes, "rb") as f:
        original = f.read()
    try:
        with open(notes, "w") as f:
            f.write("entirely different notes\n" * 20)
        new = file_sha256(notes)
        message = re.escape(f"the training data changed since {run_dir!r} was started: "
                            f"{notes} (sha256 {old[:12]} -> {new[:12]})") + ".*--allow-data-change"
        with pytest.raises(ValueError, match=message) as caught:
            resume(finished, run_dir)
        assert "docs.jsonl" not in str(caught.value)  # only the changed file is named
        assert read_json(manifest_path) == saved  # the record is left as it was

        with pytest.warns(UserWarning, match="continuing on the new data"):
            resume(finished, run_dir, allow_data_change=True)
        manifest = read_json(manifest_path)
        assert manifest["files"] == {docs: saved["files"][docs], notes: new}
        (previous,) = manifest["history"]
        assert previous["files"][notes] == old and previous["replaced_at_step"] == 2
        assert previous["corpus_sha256"] == saved["corpus_sha256"]
    finally:
        with open(notes, "wb") as f:  # the other tests share the data files
            f.write(original)


def test_checksums_see_a_flipped_bit_and_a_swap_in_every_dtype():
    """Each leaf's checksum pair changes when one bit flips or two elements trade places, for
    the dtypes a train state holds (float32, bfloat16, int32, uint32, bool, PRNG keys)."""
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    state = {
        "f32": jnp.asarray(values), "bf16": jnp.asarray(values, jnp.bfloat16),
        "i32": jnp.arange(24, dtype=jnp.int32), "u32": jnp.arange(24, dtype=jnp.uint32),
        "flag": jnp.arange(24) % 3 == 0, "key": jax.random.split(jax.random.key(0), 4),
    }
    base = state_checksums(state)
    assert set(base) == set(state)

    for name, x in state.items():
        raw = np.array(jax.random.key_data(x) if name == "key" else x)
        swapped = raw.copy().reshape(-1)
        swapped[[0, 1]] = swapped[[1, 0]]  # two different values
        bits = raw.copy()
        bits.view(np.uint8).reshape(-1)[5] ^= 1
        for changed in (swapped.reshape(raw.shape), bits):
            leaf = (jax.random.wrap_key_data(jnp.asarray(changed)) if name == "key"
                    else jnp.asarray(changed, x.dtype))
            assert state_checksums({**state, name: leaf})[name] != base[name], name


def test_checksums_of_a_sharded_array_match_its_unsharded_copy():
    """The checksum runs where the shards are (an iota per axis, no reshape) and gives the value
    of the same array on one device."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) * 0.37
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("a", "b")))
    assert len(sharded.addressable_shards) == 8
    one_device = jax.device_put(x, jax.devices()[0])
    assert state_checksums({"x": sharded}) == state_checksums({"x": one_device})
