"""The operating system says no: a run folder that cannot be written (read-only, a file, under
/dev/null) and a disk that fills up during a checkpoint write. Each ends the command line with
one `error: ...` line naming the path and the cause, exit status 2, and no traceback (unless
--debug); the checkpoint before a failed write stays intact and resumable."""

import os
import re
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest

from experiments import quickstart as experiments_quickstart
from tests.train.small_run import SMALL_RUN, write_corpus
from train.loop import CHECKPOINT_DIR, train
from train.optim import OptimConfig

pytestmark = pytest.mark.slow  # each test starts a Python with JAX (the last one also trains)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def quickstart_args(tmp_path, out: str, *options: str) -> list[str]:
    """The quickstart's arguments for a small run (two steps of 2 x 32 bytes) on two small data
    files."""
    data = write_corpus(tmp_path)
    # The small run's optimizer too (the quickstart's own differs): its programs are the other
    # tests' small runs', which the suite's persistent compilation cache then holds.
    optim = OptimConfig()
    settings = [*SMALL_RUN, "data.seq_len=32", "data.batch_size=2",
                f"optim.learning_rate={optim.learning_rate}",
                f"optim.warmup_steps={optim.warmup_steps}",
                f"optim.decay_fraction={optim.decay_fraction}"]
    return ["--out", out, "--sample-bytes", "0", "--data", *data,
            *[item for setting in settings for item in ("--set", setting)], *options]


def quickstart(tmp_path, out: str, *options: str, code: str | None = None):
    """Runs `python -m experiments.quickstart` (or `code`, given the same arguments) on
    `quickstart_args`; returns the finished process."""
    command = ["-c", code] if code else ["-m", "experiments.quickstart"]
    return subprocess.run(
        [sys.executable, *command, *quickstart_args(tmp_path, out, *options)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )


def assert_one_error_line(process, pattern: str) -> None:
    """Exit status 2, and stderr is the single line `error: <pattern>`."""
    assert process.returncode == 2, process.stderr[-3000:]
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr[-3000:]
    assert re.fullmatch("error: " + pattern, lines[0]), lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_is_one_line(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        out = str(parent / "run")
        process = quickstart(tmp_path, out)
    finally:
        parent.chmod(stat.S_IRWXU)
    assert_one_error_line(process, re.escape(f"cannot use {out!r} as the run folder: "
                                             "Permission denied") + ".*")


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    out = tmp_path / "taken"
    out.write_text("not a folder\n")
    process = quickstart(tmp_path, str(out))
    assert_one_error_line(process, re.escape(f"cannot use {str(out)!r} as the run folder: it is "
                                             "a file, not a folder; choose another --out") + ".*")


def test_an_out_under_dev_null_is_one_line_and_debug_shows_the_traceback(tmp_path):
    process = quickstart(tmp_path, "/dev/null/x")
    assert_one_error_line(process, re.escape("cannot use '/dev/null/x' as the run folder: "
                                             "'/dev/null' is not a folder") + ".*")
    debugged = quickstart(tmp_path, "/dev/null/x", "--debug")
    assert debugged.returncode != 0
    assert "Traceback (most recent call last)" in debugged.stderr
    assert "NotADirectoryError: cannot use '/dev/null/x'" in debugged.stderr


# The quickstart with a disk that is full when checkpoint 2's metadata file is written (in
# orbax's background thread), as OSError(ENOSPC) from the file write.
FULL_DISK = textwrap.dedent("""
    import errno, os, sys
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    write = handler.JsonCheckpointHandler._save_fn

    async def full_disk(self, item, directory):
        if isinstance(item, dict) and item.get("step") == 2 and "config" in item:  # meta
            path = str(directory / "metadata")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return await write(self, item, directory)

    handler.JsonCheckpointHandler._save_fn = full_disk
    from experiments import quickstart
    quickstart.main(sys.argv[1:])
""")


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    process = quickstart(tmp_path, out, code=FULL_DISK)
    assert process.returncode == 2, process.stderr[-3000:]
    assert "Traceback" not in process.stderr, process.stderr[-3000:]
    lines = process.stderr.strip().splitlines()
    step_2 = os.path.join(out, CHECKPOINT_DIR, "2")
    assert re.fullmatch(re.escape(f"error: checkpoint step 2 ({step_2}): could not be written: "
                                  "[Errno 28] No space left on device: ") + ".*", lines[-1])
    # orbax's own report of the failure, cut to one line, is all else (printed when it happened).
    assert len(lines) <= 2 and all("No space left on device" in line for line in lines), lines
    left = sorted(os.listdir(os.path.join(out, CHECKPOINT_DIR)))
    assert "1" in left and "2" not in left, left

    # Checkpoint 1 restores intact (its checksums are verified), without a warning.
    _, config = experiments_quickstart.parse_args(quickstart_args(tmp_path, out))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = train(config, out, resume=True, until_step=1)
    assert result.summary["steps"] == 1
