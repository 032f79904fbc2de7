"""Faults in a run folder's files: non-finite metrics, a torn last line of metrics.jsonl, and
unreadable config.json / metrics.jsonl / data_manifest.json (errors must name the file)."""

import math
import os
import re
import types

import pytest

from experiments import quickstart
from tests.train.small_run import SMALL_RUN, small_run
from train.loop import CHECKPOINT_DIR, METRICS_FILE, train
from train import metrics


def test_non_finite_numbers_read_back_as_floats(tmp_path):
    path = str(tmp_path / METRICS_FILE)
    metrics.MetricsWriter(path).write([{"step": 1, "loss": math.nan, "grad_norm": math.inf,
                                "max_vio": [-math.inf, 0.5]}])
    (row,) = metrics.read_metrics(path)
    assert isinstance(row["loss"], float) and math.isnan(row["loss"])
    assert row["grad_norm"] == math.inf and row["max_vio"] == [-math.inf, 0.5]


def test_the_quickstart_summary_reports_a_nan_validation(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")

    def diverged_train(config, run_dir, resume, **options):
        """What `train` summarises from a run whose final validation was NaN."""
        path = os.path.join(run_dir, METRICS_FILE)
        metrics.MetricsWriter(path).write([{"step": 1, "loss": math.nan, "skipped_steps": 1},
                                   {"step": 1, "val_bits_per_byte": math.nan}])
        rows = metrics.read_metrics(path)
        summary = dict(steps=1, tokens_seen=32, corpus="c", corpus_sha256="0" * 64,
                       val_bits_per_byte=rows[-1]["val_bits_per_byte"],
                       val_unigram_bits_per_byte=4.5, skipped_steps=rows[0]["skipped_steps"],
                       tokens_per_second=None, first_step_seconds=None)
        return types.SimpleNamespace(summary=summary, model=None)

    monkeypatch.setattr(quickstart, "train", diverged_train)
    summary = quickstart.main(["--out", out, "--sample-bytes", "0"])
    assert math.isnan(summary["val_bits_per_byte"])
    printed = capsys.readouterr().out
    assert "validation bits per byte:      nan" in printed
    assert "not finite" in printed and "skipped non-finite steps:      1" in printed


@pytest.mark.slow
def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_resume_proceeds(tmp_path):
    config, stages = small_run(SMALL_RUN, [(32, 2, 2)])
    run_dir = str(tmp_path / "run")
    train(config, run_dir, until_step=1, stages=stages)
    path = os.path.join(run_dir, METRICS_FILE)
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 5.4')  # a kill during the write of step 2's row
    with pytest.warns(UserWarning, match="metrics.jsonl: dropping line"):
        result = train(config, run_dir, resume=True, stages=stages)
    assert result.summary["steps"] == 2
    assert [row["step"] for row in metrics.read_metrics(path) if "loss" in row] == [1, 2]


def fake_resumable(run_dir) -> None:
    """A run folder that `--resume` accepts up to reading config.json (a checkpoint folder)."""
    os.makedirs(os.path.join(run_dir, CHECKPOINT_DIR, "1"))


@pytest.mark.parametrize("contents, where", [
    (b'{\n  "steps": 3,\n  "seed": \n}', "line 4, column 1: invalid JSON"),
    (b'{\n  "corpus": "\xff"\n}', "line 2, column 14: not UTF-8 text"),
])
def test_an_unreadable_config_json_names_the_file_and_line(tmp_path, contents, where):
    run_dir = str(tmp_path / "run")
    fake_resumable(run_dir)
    config_path = os.path.join(run_dir, "config.json")
    with open(config_path, "wb") as f:
        f.write(contents)
    config, stages = small_run(SMALL_RUN, [(32, 2, 2)])
    with pytest.raises(ValueError, match=re.escape(f"{config_path}, {where}")):
        train(config, run_dir, resume=True, stages=stages)


def test_an_invalid_metrics_line_names_the_file_and_line(tmp_path):
    path = str(tmp_path / METRICS_FILE)
    with open(path, "w") as f:
        f.write('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": \n{"step": 3, "loss": 5.3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2, column 21: invalid JSON")):
        metrics.read_metrics(path)
    with open(path, "w") as f:
        f.write('{"step": 1, "loss": 5.5}\n[2, 5.4]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2: expected a JSON object")):
        metrics.read_metrics(path)


def test_an_invalid_manifest_names_the_file_and_line(tmp_path):
    path = str(tmp_path / "data_manifest.json")
    with open(path, "w") as f:
        f.write('{\n  "corpus": "stdlib",\n  "corpus_sha256": "ab\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 3, column 23: invalid JSON")):
        metrics.read_json(path)
