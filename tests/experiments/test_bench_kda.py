"""`python -m experiments.bench_kda` on CPU: it times our implementations, checks their outputs
against the chunked op (or, without it, the first other KDA contender) and writes the table; each
row's output also against a float64 token-by-token recurrence written out here; bad shapes are
refused."""

import numpy as np
import pytest

from experiments import bench_kda
from experiments.harness import relative_error

SHAPE = "1x80x2x16"


def token_by_token(inputs) -> np.ndarray:
    """The oracle, in numpy float64: per head, with L2-normalised q and k and q scaled by
    D^-0.5, S <- S exp(g_t); S <- S + beta_t k_t (v_t - k_t^T S)^T; o_t = S^T q_t."""
    q, k, v, g, beta = (np.asarray(inputs[name], np.float64) for name in ("q", "k", "v", "g",
                                                                           "beta"))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * q.shape[-1] ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    batch, length, heads, dim = q.shape
    out = np.zeros((batch, length, heads, v.shape[-1]))
    for b, h in np.ndindex(batch, heads):
        state = np.zeros((dim, v.shape[-1]))
        for t in range(length):
            state *= np.exp(g[b, t, h])[:, None]
            state += beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - k[b, t, h] @ state)
            out[b, t, h] = state.T @ q[b, t, h]
    return out


def table_rows(out, shape=SHAPE) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in out.read_text().splitlines() if line.startswith(f"| {shape} ")]


@pytest.mark.slow
def test_cpu_benchmark_writes_a_table_with_errors(tmp_path):
    out = tmp_path / "kda.md"
    bench_kda.main(["--shapes", SHAPE, "--repeats", "1", "--out", str(out)])
    rows = table_rows(out)
    assert [row[1] for row in rows] == ["reference", "chunked"]
    assert float(rows[0][6]) < 1e-5  # the token-by-token scan against the chunked op
    assert float(rows[1][6]) == 0.0  # the anchor itself
    assert all(row[8] == "–" for row in rows)  # no --device-time


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_each_cpu_row_matches_the_float64_oracle(impl):
    """The output a row's error is computed from, against `token_by_token` on the same inputs:
    a wrong implementation fails here even where it agrees with the anchor."""
    inputs = bench_kda.make_inputs(bench_kda.Shape.parse(SHAPE), np.float32)
    contender = bench_kda.contenders(gpu=False, impls=[impl])[impl](inputs)
    assert relative_error(contender.output, token_by_token(inputs)) < 1e-5


@pytest.mark.slow
def test_device_time_sums_the_traced_ops_of_each_call(tmp_path):
    out = tmp_path / "kda.md"
    bench_kda.main(["--shapes", SHAPE, "--impls", "reference", "chunked", "--repeats", "1",
                    "--device-time", "--out", str(out)])
    rows = {row[1]: row for row in table_rows(out)}
    device = {name: [float(x) for x in row[8].split("/")] for name, row in rows.items()}
    for forward_ms, forward_backward_ms in device.values():
        assert 0 < forward_ms < forward_backward_ms
    # The ratios are the chunked baseline's device time over the row's.
    ratios = [float(x) for x in rows["reference"][9].split("/")]
    expected = [c / r for c, r in zip(device["chunked"], device["reference"])]
    assert ratios == pytest.approx(expected, rel=0.05, abs=0.01)
    assert [float(x) for x in rows["chunked"][9].split("/")] == [1.0, 1.0]


@pytest.mark.parametrize("names, anchor", [
    (["reference", "chunked", "mosaic_gpu", "recurrence: chunked scan", "jla mosaic_gpu"],
     "chunked"),
    (["mosaic_gpu", "recurrence: mosaic_gpu", "jla mosaic_gpu", "fla chunk_kda"], "mosaic_gpu"),
    (["reference", "cuDNN attention", "jla mosaic_gpu"], "jla mosaic_gpu"),
    (["reference"], None),
])
def test_errors_are_against_the_chunked_op_else_the_first_kda_row(names, anchor):
    assert bench_kda.error_anchor(names) == anchor


def test_run_without_the_chunked_op_still_checks_outputs_agree(capsys):
    """--impls mosaic_gpu --peers jla fla (the GPU runs' usual choice) has no chunked row: the
    peers' errors are measured against our kernel's output instead. Each row's getting ready is
    announced, as fla's autotuning makes it minutes long."""
    outputs = {"mosaic_gpu": np.ones(8), "recurrence: mosaic_gpu": None,
               "jla mosaic_gpu": np.full(8, 1.01), "fla chunk_kda": np.full(8, 0.98)}
    table = {name: (lambda inputs, output=output: bench_kda.Contender(
        lambda: None, lambda: None, lambda _: None, output, bench_kda.Timing()))
             for name, output in outputs.items()}
    results = bench_kda.run([bench_kda.Shape.parse("1x64x1x16")], table, np.float32, 1,
                            lambda results: None)
    errors = {name: results[("1x64x1x16", name)].error for name in outputs}
    assert errors == pytest.approx({"mosaic_gpu": 0.0, "recurrence: mosaic_gpu": None,
                                    "jla mosaic_gpu": 0.01, "fla chunk_kda": 0.02})
    printed = capsys.readouterr().out
    for name in outputs:
        assert f"1x64x1x16 {name}: getting ready" in printed
        assert f"1x64x1x16 {name}: ready in " in printed


def test_contenders_are_timed_in_turns(monkeypatch):
    """Each contender's calls are timed in `rounds` turns over all of them, each turn after one
    untimed call and starting one contender further on, and the medians come from those timed
    calls alone."""
    clock = iter(range(10**6))
    monkeypatch.setattr(bench_kda.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(bench_kda, "WARMUP_SECONDS", 0.0)
    calls = []

    def contender(name, with_backward):
        return bench_kda.Contender(lambda: calls.append((name, "forward")),
                                   (lambda: calls.append((name, "backward"))) if with_backward
                                   else None, lambda _: None, None, bench_kda.Timing())

    contenders = {"a": contender("a", True), "b": contender("b", False)}
    bench_kda.time_contenders(contenders, repeats=4, rounds=2)
    warm_up = [("a", "forward"), ("a", "backward"), ("b", "forward")]
    a_turn = [("a", "forward")] * 3 + [("a", "backward")] * 3
    b_turn = [("b", "forward")] * 3
    assert calls == warm_up + a_turn + b_turn + b_turn + a_turn
    # A fake clock that ticks once a reading: every timed call reads it twice, 1 tick apart.
    assert contenders["a"].timing.forward_ms == contenders["b"].timing.forward_ms == 1e3
    assert contenders["b"].timing.forward_backward_ms is None


@pytest.mark.slow
def test_a_resumed_run_times_only_the_shapes_not_yet_timed(tmp_path, monkeypatch):
    """--resume keeps the rows of the shapes an earlier run with the same --out timed (its JSON
    beside the table) and times the others; a run without it times every shape again."""
    out = tmp_path / "kda.md"
    common = ["--impls", "chunked", "--repeats", "1", "--out", str(out)]

    def rows(shape):
        return [line for line in out.read_text().splitlines() if line.startswith(f"| {shape} ")]

    bench_kda.main(["--shapes", "1x80x2x16", *common])
    first = rows("1x80x2x16")
    made = []
    make_inputs = bench_kda.make_inputs
    monkeypatch.setattr(bench_kda, "make_inputs",
                        lambda shape, *args: made.append(str(shape)) or make_inputs(shape, *args))
    bench_kda.main(["--shapes", "1x80x2x16", "1x96x2x16", "--resume", *common])
    assert made == ["1x96x2x16"]
    assert rows("1x80x2x16") == first
    [row] = rows("1x96x2x16")
    assert float(row.split("|")[3]) > 0  # timed
    bench_kda.main(["--shapes", "1x80x2x16", *common])
    assert made == ["1x96x2x16", "1x80x2x16"]


def test_resumed_run_with_other_contenders_keeps_earlier_rows(tmp_path):
    """A shape kept by --resume shows the rows it was timed with, also those of contenders this
    run leaves out (they read "not run" at the shapes timed now), and the preamble names what each
    shape's errors were measured against."""
    out = tmp_path / "kda.md"
    common = ["--repeats", "1", "--out", str(out)]
    bench_kda.main(["--shapes", "1x80x2x16", "--impls", "reference", "chunked", *common])
    bench_kda.main(["--shapes", "1x80x2x16", "1x96x2x16", "--impls", "reference", "--resume",
                    *common])
    text = out.read_text()
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")
            for line in text.splitlines() if line.startswith("| 1x")}
    assert list(rows) == [("1x80x2x16", "reference"), ("1x80x2x16", "chunked"),
                          ("1x96x2x16", "reference"), ("1x96x2x16", "chunked")]
    assert float(rows[("1x80x2x16", "reference")][7]) < 1e-5  # against the kept chunked row
    assert rows[("1x96x2x16", "chunked")][11].strip() == "not run"
    assert rows[("1x96x2x16", "reference")][7].strip() == "–"  # nothing to measure it against
    assert ("against our chunked op at 1x80x2x16; nothing (no whole-KDA contender besides the "
            "reference ran) at 1x96x2x16." in text)


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
