"""`python -m experiments.bench_kda` on CPU: it times our implementations, checks their outputs
against the chunked op and writes the table; bad shapes are refused."""

import pytest

from experiments import bench_kda


def test_cpu_benchmark_writes_a_table_with_errors(tmp_path):
    out = tmp_path / "kda.md"
    bench_kda.main(["--shapes", "1x80x2x16", "--repeats", "1", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1x80x2x16")]
    assert [row.split("|")[2].strip() for row in rows] == ["reference", "chunked"]
    reference_error = float(rows[0].split("|")[7])
    assert reference_error < 1e-5  # float32 reference against the chunked op
    assert all(row.split("|")[9].strip() == "–" for row in rows)  # no --device-time


def test_device_time_sums_the_traced_ops_of_each_call(tmp_path):
    out = tmp_path / "kda.md"
    bench_kda.main(["--shapes", "1x80x2x16", "--impls", "chunked", "--repeats", "1",
                    "--device-time", "--out", str(out)])
    [row] = [line for line in out.read_text().splitlines() if line.startswith("| 1x80x2x16")]
    forward_ms, forward_backward_ms = (float(x) for x in row.split("|")[9].split("/"))
    assert 0 < forward_ms < forward_backward_ms
    assert [float(x) for x in row.split("|")[10].split("/")] == [1.0, 1.0]  # its own baseline


def test_malformed_shapes_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_kda.main(["--shapes", "1x80x2"])
    assert "BxTxHxD" in capsys.readouterr().err


def test_profile_lists_device_ops_of_each_implementation(tmp_path):
    out = tmp_path / "kda.md"
    bench_kda.main(["--shapes", "1x80x2x16", "--impls", "chunked", "--repeats", "1", "--profile",
                    "--out", str(out)])
    text = out.read_text()
    for pass_name in ("forward", "forward+backward"):
        assert f"## Where the {pass_name} time goes at 1x80x2x16" in text
        assert f"Device ops of chunked's {pass_name} (trace" in text
    # Either op rows with a positive time, or the stated fallback; never silence.
    assert "| op | calls/step |" in text or "cost analysis of the compiled step" in text
