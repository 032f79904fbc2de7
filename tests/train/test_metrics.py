"""train.metrics: model FLOPs, the JSONL record and the plots."""

import math
import os

import pytest

from models.config import count_params, preset
from train.metrics import (
    MetricsWriter,
    attention_score_flops,
    peak_flops_per_device,
    plot_metrics,
    read_metrics,
    train_flops_per_token,
)


def test_flops_are_six_per_active_parameter_plus_sequence_terms():
    cfg = preset("1b")
    flops = train_flops_per_token(cfg, 4096)
    parts = ("kda", "attention", "moe", "rest")
    assert flops["total"] == pytest.approx(sum(flops[p] for p in parts))
    active = count_params(cfg)["active"]
    # Matmul FLOPs alone are 6 per active parameter; KDA and attention add sequence terms.
    assert 6 * active < flops["total"] < 1.5 * 6 * active
    assert flops["moe"] == 6 * count_params(cfg)["moe_active"]
    # Attention scores grow linearly with the context; everything else does not.
    longer = train_flops_per_token(cfg, 8192)
    assert longer["attention"] - flops["attention"] == pytest.approx(
        3 * (attention_score_flops(cfg, 8192) - attention_score_flops(cfg, 4096)))
    assert longer["kda"] == flops["kda"] and longer["moe"] == flops["moe"]


def test_no_peak_is_claimed_for_a_cpu():
    assert peak_flops_per_device() is None


def test_rows_round_trip_with_arrays_and_non_finite_values(tmp_path):
    import numpy as np

    path = str(tmp_path / "run" / "metrics.jsonl")
    writer = MetricsWriter(path)
    writer.write([{"step": 1, "loss": np.float32(2.5), "max_vio": np.array([0.1, 0.2])}])
    writer.write([{"step": 2, "loss": float("nan"), "grad_norm": math.inf},
                  {"step": 2, "val_bits_per_byte": 1.5}])
    rows = read_metrics(path)
    assert rows[0] == {"step": 1, "loss": 2.5, "max_vio": pytest.approx([0.1, 0.2])}
    assert math.isnan(rows[1]["loss"]) and rows[1]["grad_norm"] == math.inf
    assert rows[2]["val_bits_per_byte"] == 1.5


def test_plots_are_written(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    MetricsWriter(path).write(
        [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0 + s, "max_vio": [0.5 / s, 0.2]}
         for s in range(1, 6)]
        + [{"step": 3, "loss": math.nan, "grad_norm": math.inf, "max_vio": [0.0, 0.0]},
           {"step": 5, "val_bits_per_byte": 2.0}]
    )
    written = plot_metrics(path, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == [
        "grad_norm.png", "loss.png", "max_vio.png"]
    for file in written:
        assert os.path.getsize(file) > 1000
