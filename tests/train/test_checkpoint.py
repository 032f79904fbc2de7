"""Checkpoints: round trip of state and data iterator, an interrupted save, run-folder guards,
and (slow) a process killed during a save, resumed to the uninterrupted run's exact losses."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.small_run import SMALL_RUN, STAGES, small_run
from tests.train.toy_model import make_batch, split_state
from train.checkpoint import Checkpointer, abstract_like
from train.cli import apply_overrides
from train.data import DataConfig, make_train_iterator
from train.loop import TrainConfig, _prepare_run_dir, train
from train.metrics import read_metrics
from train.step import FAST_COMPILE_OPTIONS, make_train_step

DATA = DataConfig(seq_len=32, batch_size=2, packing_bins=4)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_same_state(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_same_batch(a, b):
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def trained():
    """A toy train state after one step, and a second one after two (both kept), and their
    graphdef. The MoE computes in bf16, so the state holds float32 parameters and moments and
    the expert weights' bf16 compute copies (`train.step`): every kind a checkpoint carries."""
    graphdef, state = split_state(moe_dtype=jnp.bfloat16)
    step = make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)
    first, _ = step(state, make_batch(0))
    second, _ = step(jax.tree.map(jnp.copy, first), make_batch(1))
    return first, second, graphdef


@pytest.mark.slow
def test_round_trip_restores_state_and_data_position(tmp_path, trained):
    first, second, _ = trained
    iterator = make_train_iterator(DATA)
    checkpointer = Checkpointer(str(tmp_path))
    next(iterator)
    checkpointer.save(1, first, iterator, metadata={"note": "one"})
    next(iterator)
    checkpointer.save(2, second, iterator)
    expected = [next(iterator) for _ in range(2)]
    checkpointer.wait()
    assert checkpointer.all_steps() == [1, 2]

    resumed = make_train_iterator(DATA)
    state, meta = Checkpointer(str(tmp_path)).restore(abstract_like(second), resumed)
    assert meta["step"] == 2
    assert_same_state(state, second)
    for batch, want in zip([next(resumed) for _ in range(2)], expected):
        assert_same_batch(batch, want)

    older = make_train_iterator(DATA)
    state, meta = Checkpointer(str(tmp_path)).restore(abstract_like(first), older, step=1)
    assert meta == {"step": 1, "note": "one"}
    assert_same_state(state, first)
    reference = make_train_iterator(DATA)
    next(reference)
    assert_same_batch(next(older), next(reference))


def test_round_trip_keeps_the_expert_weights_compute_copies(tmp_path, trained):
    """A bf16 MoE's state holds its expert weights' bf16 compute copies (`train.step`); they are
    saved and restored with the rest, in bf16, bit for bit."""
    state, _, graphdef = trained
    iterator = make_train_iterator(DATA)
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, state, iterator)
    checkpointer.wait()
    restored, _ = Checkpointer(str(tmp_path)).restore(abstract_like(state), iterator)
    assert_same_state(restored, state)
    copies = nnx.merge(graphdef, restored).compute_copies
    assert len(copies) == 2 and all(copy[...].dtype == jnp.bfloat16 for copy in copies.values())


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, trained):
    first, second, _ = trained
    iterator = make_train_iterator(DATA)
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, first, iterator)
    checkpointer.close()
    # What a process killed while writing step 2 leaves behind: an unfinished temporary folder.
    partial = tmp_path / "2.orbax-checkpoint-tmp" / "state"
    partial.mkdir(parents=True)
    (partial / "half_written").write_bytes(b"\0" * 100)

    checkpointer = Checkpointer(str(tmp_path))
    assert checkpointer.latest_step() == 1
    state, meta = checkpointer.restore(abstract_like(first), make_train_iterator(DATA))
    assert meta["step"] == 1
    assert_same_state(state, first)
    # Saving step 2 again replaces the leftover.
    checkpointer.save(2, second, iterator)
    checkpointer.wait()
    assert checkpointer.latest_step() == 2
    assert not (tmp_path / "2.orbax-checkpoint-tmp").exists()


def test_restore_without_a_checkpoint_is_refused(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer(str(tmp_path)).restore(abstract_like(trained[0]), make_train_iterator(DATA))


def test_run_folder_guards(tmp_path):
    config = TrainConfig(data=DATA, steps=2)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        _prepare_run_dir(config, str(tmp_path), resume=True)
    _prepare_run_dir(config, str(tmp_path), resume=False)
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(ValueError, match="--resume"):
        _prepare_run_dir(config, str(tmp_path), resume=False)
    changed = apply_overrides(config, ["optim.learning_rate=0.5"])
    with pytest.raises(ValueError, match=r"differs .*\['optim.learning_rate'\]"):
        _prepare_run_dir(changed, str(tmp_path), resume=True)
    # The progress bar is not part of what is computed.
    _prepare_run_dir(apply_overrides(config, ["progress=false"]), str(tmp_path), resume=True)


# Run in a child process: training that blocks forever while committing checkpoint 2 (its files
# are written, the folder not yet renamed), after telling the parent through a marker file.
KILLED_RUN = textwrap.dedent("""
    import faulthandler, json, sys, time
    from orbax.checkpoint._src.path import atomicity

    faulthandler.dump_traceback_later(540, exit=True)  # a hang shows where, in stderr
    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self.get_final().name == "2":
            open(sys.argv[2], "w").close()
            time.sleep(3600)
        return await commit(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    from tests.train.small_run import small_run
    from train.loop import train
    config, stages = small_run(json.loads(sys.argv[3]), json.loads(sys.argv[4]))
    train(config, sys.argv[1], stages=stages)
""")


@pytest.mark.slow
def test_killed_during_save_then_resumed_matches_the_uninterrupted_run(tmp_path):
    config, stages = small_run(SMALL_RUN, STAGES)
    uninterrupted = train(config, str(tmp_path / "a"), stages=stages)

    run_dir, marker = tmp_path / "b", tmp_path / "saving"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(run_dir), str(marker), json.dumps(SMALL_RUN),
         json.dumps(STAGES)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child never reached the save of step 2"
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    left = sorted(os.listdir(run_dir / "checkpoints"))
    assert "1" in left and "2" not in left, left  # step 2 was not committed

    resumed = train(config, str(run_dir), resume=True, stages=stages)
    losses = {}
    for name, result in (("a", uninterrupted), ("b", resumed)):
        rows = read_metrics(os.path.join(result.run_dir, "metrics.jsonl"))
        losses[name] = [(row["step"], row["loss"], row["grad_norm"]) for row in rows
                        if "loss" in row]
    assert [step for step, _, _ in losses["b"]] == [1, 2]
    assert losses["b"] == losses["a"]  # exactly, bit for bit
    assert resumed.summary["val_bits_per_byte"] == uninterrupted.summary["val_bits_per_byte"]
    assert_same_state(resumed.trainer.state, uninterrupted.trainer.state)
