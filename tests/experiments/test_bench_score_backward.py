"""`python -m experiments.bench_score_backward --smoke` on CPU: the score-tile backward kernel in
interpret mode, timed with two and with four warpgroups a chunk."""

import pytest

from experiments import bench_score_backward


@pytest.mark.slow  # about 10 s: one kernel in interpret mode
def test_benchmark_smoke_runs_and_prints_each_variant(capsys):
    bench_score_backward.main(["--smoke", "--shape", "1x128x1x64"])
    printed = capsys.readouterr().out
    assert "2 warpgroups a chunk:" in printed and " ms (relative to two warpgroups" in printed
