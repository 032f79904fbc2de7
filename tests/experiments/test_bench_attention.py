"""`python -m experiments.bench_attention` on CPU: the smoke run times XLA on each layout and
checks it against the plain softmax formula; the oracle itself, the layouts, the FLOP count and
the capture of a failing contender."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_attention


def test_smoke_run_checks_xla_against_the_plain_formula(tmp_path):
    out = tmp_path / "attention.md"
    bench_attention.main(["--smoke", "--repeats", "1", "--warmup", "1", "--out", str(out)])
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| ") and "xla" in line]
    assert [int(row[0]) for row in rows] == list(bench_attention.DOCUMENTS_PER_ROW)
    for row in rows:
        cells = [cell.strip() for cell in row]
        assert float(cells[2]) > 0 and float(cells[3]) > 0  # fwd, fwd+bwd ms
        assert float(cells[6]) > 0 and float(cells[7]) > 0  # TFLOP/s
        # float32 XLA path against the independent oracle: rounding only.
        assert float(cells[8]) < 1e-5 and float(cells[9]) < 1e-5


def test_plain_attention_matches_a_per_query_loop():
    """The oracle against softmax written token by token in numpy float64, two documents."""
    q, k, v, _ = bench_attention.make_inputs(bench_attention.SMOKE)
    segment_ids = bench_attention.document_layout(bench_attention.SMOKE, 2)
    out = np.asarray(bench_attention.plain_attention(q, k, v, jnp.asarray(segment_ids)))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    expected = np.zeros(out.shape)
    for b, t in np.ndindex(*segment_ids.shape):
        keys = [s for s in range(t + 1) if segment_ids[b, s] == segment_ids[b, t]]
        scores = np.einsum("hd,shd->hs", q[b, t], k[b, keys]) / np.sqrt(q.shape[-1])
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        expected[b, t] = np.einsum("hs,shd->hd", weights, v[b, keys])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("documents", [1, 4, 16])
def test_document_layout_holds_that_many_documents_a_row(documents):
    segment_ids = bench_attention.document_layout(bench_attention.SMOKE, documents)
    assert segment_ids.shape == (bench_attention.SMOKE.batch, bench_attention.SMOKE.length)
    for row in segment_ids:
        np.testing.assert_array_equal(np.unique(row), np.arange(1, documents + 1))
        assert np.all(np.diff(row) >= 0)  # one run per id


def test_flops_count_the_causal_pairs_within_documents():
    segment_ids = np.array([[1, 1, 1, 2, 2, 1, 3, 3], [4] * 8])  # the third run of row 0 is new
    allowed = ((segment_ids[:, :, None] == segment_ids[:, None, :])
               & np.tril(np.ones((8, 8), bool)))
    allowed[0, 5, :5] = False  # the run [1] at t = 5 is its own document
    pairs = int(allowed.sum())
    assert pairs == (6 + 3 + 1 + 3) + 36
    flops = bench_attention.document_attention_flops(segment_ids, heads=3, qk_dim=5, v_dim=2)
    assert flops == 2 * (5 + 2) * 3 * pairs


def test_failing_contender_is_noted_and_the_others_still_run():
    # On this CPU the cuDNN contenders fail; their rows say why, XLA's still has its numbers.
    table = bench_attention.contenders(gpu=True, max_segments=[4])
    assert list(table) == ["xla", "cudnn", "cudnn_segments M=4", "packed call alone M=4"]
    setup = bench_attention.Setup(batch=1, length=32, heads=1, qk_dim=8, v_dim=8,
                                  dtype="bfloat16")
    results = bench_attention.run(setup, bench_attention.document_layouts(setup),
                                  {name: table[name] for name in ("xla", "cudnn_segments M=4")},
                                  repeats=1, warmup=1, on_progress=lambda results: None)
    for documents in bench_attention.DOCUMENTS_PER_ROW:
        assert results[(documents, "xla")].forward_ms > 0
        assert results[(documents, "xla")].gradient_error < 1e-2  # bf16 against float32
        note = results[(documents, "cudnn_segments M=4")].note
        assert note.startswith("ValueError") and "compute capability 9.0" in note


def test_gpu_option_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(["--gpu"])
    assert "--gpu needs a CUDA backend" in capsys.readouterr().err
