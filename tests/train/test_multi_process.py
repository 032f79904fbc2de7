"""Training in two processes through jax.distributed (on CPU: gloo collectives between them)
computes what one process computes on the same global mesh and batch, and its checkpoints
restore into one process and into two.

The two processes run `multi_process_child` (2 CPU devices each, a data=2 x fsdp=2 mesh over
both); the reference runs here on 4 of the suite's 8 devices, the same mesh shape, while they
run. The children's second trainer (the resume) takes its programs from a persistent
compilation cache.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import portpicker
import pytest

from tests.train.multi_process_child import multi_process_config
from train.distributed import PROCESSES_VARIABLE, initialize
from train.loop import METRICS_FILE, train

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Cross-process all-reduces (gloo) may add the four devices' partial gradients in another order
# than one process's collectives: float32 rounding of the summed gradients, carried through
# three Adam steps. The measured gap is far smaller; a wrong shard (a batch row fed twice, a
# parameter shard restored in the wrong place) moves the loss by more than 1e-3.
RTOL = 1e-5


def _launch(run_dir: str, cache: str, *extra: str) -> list[subprocess.Popen]:
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
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2",
             "--process-id", str(rank), *extra],
            cwd=REPOSITORY, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]


def _finish(processes: list[subprocess.Popen]) -> None:
    for rank, process in enumerate(processes):
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"process {rank} failed:\n{output[-4000:]}"


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


def test_one_process_without_settings_stays_one_process():
    assert initialize() is False
    assert initialize(num_processes=1) is False
    assert not jax.distributed.is_initialized()


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoints_restore_in_one_and_two(tmp_path):
    cache, two, one, reference = (str(tmp_path / name) for name in
                                  ("cache", "two", "one", "reference"))
    config = multi_process_config()
    # Two processes: steps 1-2, a checkpoint after each, then a fresh trainer in each process
    # restores checkpoint 2 and trains step 3. The uninterrupted reference meanwhile, here.
    processes = _launch(two, cache, "--until-step", "2")
    try:
        expected = _losses(train(config, reference).run_dir)
    finally:
        _finish(processes)
    losses = _losses(two)
    assert sorted(losses) == [1, 2, 3]
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                               [expected[s] for s in (1, 2, 3)], rtol=RTOL)
    with open(os.path.join(two, "summary.json")) as f:
        assert json.load(f)["steps"] == 3
    # The two processes' checkpoint 2 restored in one process: step 3 as in the reference.
    shutil.copytree(two, one)
    shutil.rmtree(os.path.join(one, "checkpoints", "3"))
    resumed = train(config, one, resume=True)
    assert resumed.summary["steps"] == 3
    np.testing.assert_allclose(_losses(one)[3], expected[3], rtol=RTOL)
