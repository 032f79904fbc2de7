"""experiments.bench_train runs at its CPU smoke size and reports every part of the step."""

import json

import pytest

from experiments import bench_train


def test_synthetic_batch_packs_the_documents():
    batch = bench_train.synthetic_batch(bench_train.SMOKE)
    assert batch["tokens"].shape == (bench_train.SMOKE.batch, bench_train.SMOKE.seq_len)
    assert (batch["segment_ids"].max(axis=1) == bench_train.DOCUMENTS_PER_ROW).all()
    starts = batch["positions"] == 0
    assert (starts.sum(axis=1) == bench_train.DOCUMENTS_PER_ROW).all()
    # No target crosses a document boundary.
    assert batch["loss_mask"].sum() == batch["tokens"].size - (
        bench_train.SMOKE.batch * bench_train.DOCUMENTS_PER_ROW)


@pytest.mark.slow
def test_smoke_benchmark_reports_throughput_and_breakdown(tmp_path):
    out = tmp_path / "bench.md"
    result = bench_train.main(["--smoke", "--steps", "2", "--out", str(out)])
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1
    assert set(result["breakdown"]) == {"kda", "attention", "moe", "rest"}
    parts = sum(part["seconds_per_step"] for part in result["breakdown"].values())
    assert parts == pytest.approx(result["step_seconds"])
    assert "| kda | 3 |" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text())["setup"]["preset"] == "tiny"
