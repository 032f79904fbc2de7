"""`python -m experiments.bench_moe` at its CPU smoke size: the table, the parts and the profile."""

import pytest

from experiments import bench_moe


@pytest.mark.slow
def test_bench_moe_smoke_writes_its_table_and_profile(tmp_path):
    out = tmp_path / "moe_smoke.md"
    results = bench_moe.main(["--smoke", "--profile", "--iters", "1", "--out", str(out)])
    assert results["moe"]["tflops"] > 0 and results["dense"]["tflops"] > 0
    table = out.read_text()
    assert "MoE / dense achieved TFLOP/s" in table
    assert bench_moe.matched_dense_hidden(bench_moe.GPU_SHAPE) == 4864
    parts = [row["part"] for row in results["parts"]]
    assert len(parts) == 8 and "activation SiTU-GLU" in parts
    assert all(row["forward_ms"] > 0 and row["forward_backward_ms"] > 0 for row in results["parts"])
    ops = results["ops"]["rows"]
    assert ops and all(row["ms"] >= 0 and row["calls"] > 0 for row in ops)
    # The trace's op names are found in the compiled module, so the rows carry their HLO.
    assert sum(bool(row["hlo"]) for row in ops) >= len(ops) // 2
    assert "| un-sort and combine |" in table and "Device ops of the MoE layer" in table
