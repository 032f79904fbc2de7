"""`python -m experiments.quickstart` end to end at a tiny size (a few steps), and its resume."""

import json
import os

import pytest

from experiments import quickstart

TINY = [
    "--set", "model.num_layers=2", "--set", "model.kda_layers=1",
    "--set", "model.full_attn_layers=2", "--set", "data.seq_len=32",
    "--set", "data.batch_size=2", "--set", "data.packing_bins=4", "--set", "steps=3",
    "--set", "eval_every=2", "--set", "eval_batches=1", "--set", "checkpoint_every=2",
    "--set", "fast_compile=true", "--set", "progress=false", "--set", "mesh.data=1",
]


@pytest.mark.slow
def test_quickstart_trains_evaluates_samples_and_saves(tmp_path, capsys):
    out = str(tmp_path / "run")
    summary = quickstart.main(["--out", out, *TINY, "--sample-bytes", "4"])
    printed = capsys.readouterr().out
    assert "validation bits per byte:" in printed and "order-0 entropy of validation" in printed
    assert "sample (temperature 0.8)" in printed
    assert summary["steps"] == 3 and summary["skipped_steps"] == 0
    assert 0 < summary["val_bits_per_byte"] < 20
    assert summary["val_unigram_bits_per_byte"] == pytest.approx(4.475, abs=0.5)
    for name in ("metrics.jsonl", "summary.json", "config.json", "data_manifest.json",
                 "loss.png", "max_vio.png", "grad_norm.png"):
        assert os.path.exists(os.path.join(out, name)), name
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "val_bits_per_byte" in row] == [2, 3]

    # Starting over in the same folder is refused; --resume of a finished run changes nothing.
    with pytest.raises(SystemExit):
        quickstart.main(["--out", out, *TINY])
    assert "--resume" in capsys.readouterr().err
    again = quickstart.main(["--out", out, "--resume", *TINY, "--sample-bytes", "0"])
    assert again["val_bits_per_byte"] == summary["val_bits_per_byte"]
