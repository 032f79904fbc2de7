"""Training in two processes through jax.distributed (on CPU: gloo collectives between them)
computes what one process computes on the same global mesh and batch, each process loading only
its own shard of the data; its checkpoints (every shard's data position) restore
into one process and into two, and a process killed while saving leaves the last complete
checkpoint restorable.

The two processes run `multi_process_child` (2 CPU devices each, a data=2 x fsdp=2 mesh over
both); the reference runs here on 4 of the suite's 8 devices, the same mesh shape, while they
run. The children's second trainer (the resume) takes its programs from a persistent
compilation cache.
"""

import importlib
import json
import os
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import portpicker
import pytest

from tests.train.multi_process_child import multi_process_config, write_corpus
from train.distributed import PROCESSES_VARIABLE, initialize, print_primary
from train.loop import CHECKPOINT_DIR, METRICS_FILE, train

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Cross-process all-reduces (gloo) may add the devices' partial sums in another order than one
# process's collectives: float32 rounding. Measured: the step-1 loss one float32 ulp apart (8e-8
# relative), the later steps equal. A wrong shard (process 1 feeding process 0's batch rows)
# moves the losses by 1% to 4%.
RTOL = 1e-6


def _launch(run_dir: str, cache: str, corpus: str, *extra: str) -> list[subprocess.Popen]:
    """Starts the two processes of a run in `run_dir`."""
    port = portpicker.pick_unused_port()
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.train.multi_process_child", "--out", run_dir,
             "--corpus", corpus,
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2",
             "--process-id", str(rank), *extra],
            cwd=REPOSITORY, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]


def _losses(run_dir: str) -> dict[int, float]:
    """{step: training loss} of the run's metrics, each step logged once (by process 0)."""
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f]
    losses = [(row["step"], row["loss"]) for row in rows if "loss" in row]
    assert len({step for step, _ in losses}) == len(losses), f"steps logged twice: {losses}"
    return dict(losses)


@pytest.mark.parametrize("settings, environment, message", [
    (dict(num_processes=2, process_id=0), {}, "--coordinator-address HOST:PORT"),
    (dict(coordinator_address="localhost:1234", num_processes=2), {}, "--process-id in [0, 2)"),
    (dict(coordinator_address="localhost:1234", process_id=1), {}, "--num-processes N"),
    (dict(coordinator_address="localhost:1234", num_processes=2, process_id=2), {},
     r"--process-id=2 must lie in [0, --num-processes=2)"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), {}, "HOST:PORT"),
    (dict(coordinator_address="localhost:1234", process_id=0), {PROCESSES_VARIABLE: "two"},
     "JAX_NUM_PROCESSES='two' is not an integer"),
    # Every setting right, but this process already uses its devices (the suite's CPU backend).
    (dict(coordinator_address="localhost:1234", num_processes=2, process_id=0), {},
     "before JAX uses any device"),
])
def test_a_bad_multi_process_setting_names_the_option_and_the_fix(settings, environment, message,
                                                                  monkeypatch):
    jax.devices()
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        initialize(**settings)


@pytest.mark.parametrize("experiment", ["quickstart", "context_extension", "vision_quickstart"])
def test_an_experiment_joins_first_and_refuses_a_run_without_its_coordinator_in_one_line(
        experiment, tmp_path, capsys, monkeypatch):
    """The experiment's multi-process options reach `join_processes`, which refuses before the
    experiment prints or builds anything."""
    main = importlib.import_module(f"experiments.{experiment}").main
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--num-processes", "2", "--process-id", "1"])
    assert exit_info.value.code == 2
    expected = ("error: --num-processes=2 needs the coordinator's address: pass "
                "--coordinator-address HOST:PORT")
    captured = capsys.readouterr()
    assert expected in captured.err and captured.out == ""


@pytest.mark.parametrize("process", [0, 1])
def test_only_process_0_prints_the_report(process, capsys, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: process)
    print_primary("report", end="!")
    assert capsys.readouterr().out == ("report!" if process == 0 else "")


def test_one_process_without_settings_stays_one_process():
    assert initialize() is False
    assert initialize(num_processes=1) is False
    assert not jax.distributed.is_initialized()


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoints_restore_in_one_and_two(tmp_path):
    cache, two, reference, corpus = (
        str(tmp_path / name) for name in ("cache", "two", "reference", "corpus"))
    write_corpus(corpus)
    config = multi_process_config(corpus)
    # Two processes: steps 1-2, a checkpoint after each; then a fresh trainer in each process
    # restores checkpoint 2 and trains step 3, and process 1 dies while saving checkpoint 3.
    # The uninterrupted reference meanwhile, here.
    processes = _launch(two, cache, corpus, "--until-step", "2", "--die-saving", "3")
    try:
        expected = _losses(train(config, reference).run_dir)
        output, _ = processes[1].communicate(timeout=300)
        assert processes[1].returncode == -signal.SIGKILL, output[-4000:]
    finally:
        processes[0].kill()  # left waiting for process 1, as a job scheduler would end it
        processes[0].communicate()
    losses = _losses(two)
    assert sorted(losses) == [1, 2, 3]
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                               [expected[s] for s in (1, 2, 3)], rtol=RTOL)
    # Checkpoint 3 never completed: the newest complete one is 2, saved by the two processes.
    checkpoints = os.listdir(os.path.join(two, CHECKPOINT_DIR))
    assert sorted(name for name in checkpoints if name.isdigit()) == ["1", "2"]
    assert any(name.startswith("3") for name in checkpoints), checkpoints
    # Restored in one process, it trains step 3 as the reference did.
    resumed = train(config, two, resume=True)
    assert resumed.summary["steps"] == 3
    np.testing.assert_allclose(_losses(two)[3], expected[3], rtol=RTOL)
