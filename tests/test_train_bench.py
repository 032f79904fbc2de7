"""experiments.bench_train runs at its CPU smoke size, reports every part of the step and XLA's
memory plan, and names the options that shrink a step that does not fit."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from experiments import bench_train
from models.lm import REMAT


def test_synthetic_batch_packs_the_documents():
    batch = bench_train.synthetic_batch(bench_train.SMOKE)
    assert batch["tokens"].shape == (bench_train.SMOKE.batch, bench_train.SMOKE.seq_len)
    assert (batch["segment_ids"].max(axis=1) == bench_train.DOCUMENTS_PER_ROW).all()
    starts = batch["positions"] == 0
    assert (starts.sum(axis=1) == bench_train.DOCUMENTS_PER_ROW).all()
    # No target crosses a document boundary.
    assert batch["loss_mask"].sum() == batch["tokens"].size - (
        bench_train.SMOKE.batch * bench_train.DOCUMENTS_PER_ROW)


def test_gpu_setup_recomputes_with_a_known_policy():
    assert bench_train.GPU.remat in REMAT and bench_train.GPU.remat != "none"


def _compiled_copy(num_floats: int) -> jax.stages.Compiled:
    """A program whose argument and output are one float32 vector each (no donation)."""
    spec = jax.ShapeDtypeStruct((num_floats,), jnp.float32)
    return jax.jit(lambda x: x * 2.0).lower(spec).compile()


def test_memory_analysis_adds_up_to_the_peak():
    memory = bench_train.memory_analysis(_compiled_copy(1 << 20))
    assert memory["argument"] == pytest.approx(4 / 1024)  # 4 MiB in GiB
    assert memory["output"] == pytest.approx(4 / 1024)
    assert memory["peak"] == pytest.approx(
        memory["argument"] + memory["output"] - memory["alias"] + memory["temp"])


def test_preflight_stops_a_step_over_the_device_limit(monkeypatch, capsys):
    compiled = _compiled_copy(1 << 20)
    monkeypatch.setattr(bench_train, "device_memory_limit", lambda: 1.0)
    memory = bench_train.preflight(compiled, 1.5, bench_train.GPU)
    assert "peak" in capsys.readouterr().out and memory["peak"] < 1.0

    monkeypatch.setattr(bench_train, "device_memory_limit", lambda: 1e-3)
    with pytest.raises(RuntimeError, match="--remat full") as raised:
        bench_train.preflight(compiled, 1.5, bench_train.GPU)
    assert f"--batch {bench_train.GPU.batch // 2}" in str(raised.value)


def test_shrink_hint_names_only_options_that_help():
    smallest = dataclasses.replace(bench_train.GPU, remat="full", batch=1)
    assert "--remat" not in bench_train.shrink_hint(dataclasses.replace(smallest, batch=4))
    assert "--batch" not in bench_train.shrink_hint(dataclasses.replace(smallest, remat="dots"))
    assert "smallest" in bench_train.shrink_hint(smallest)


def test_out_of_memory_error_says_what_to_change():
    memory = {"peak": 108.0}
    with pytest.raises(RuntimeError, match=r"108\.0 GiB.*--remat full"):
        with bench_train.explained_out_of_memory(bench_train.GPU, memory):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                             "allocate 66.41GiB")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        with bench_train.explained_out_of_memory(bench_train.GPU, memory):
            raise jax.errors.JaxRuntimeError("INTERNAL: something else")


@pytest.mark.slow
def test_smoke_benchmark_reports_throughput_memory_and_breakdown(tmp_path, capsys):
    out = tmp_path / "bench.md"
    # The GPU setup's recomputation policy, at the smoke size.
    result = bench_train.main(["--smoke", "--steps", "2", "--remat", bench_train.GPU.remat,
                               "--out", str(out)])
    assert "preflight: step compiled" in capsys.readouterr().out
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1
    assert result["setup"]["remat"] == bench_train.GPU.remat
    assert result["compile_seconds"] > 0
    assert 0 < result["memory_gib"]["argument"] <= result["memory_gib"]["peak"]
    assert set(result["breakdown"]) == {"kda", "attention", "moe", "rest"}
    parts = sum(part["seconds_per_step"] for part in result["breakdown"].values())
    assert parts == pytest.approx(result["step_seconds"])
    text = out.read_text()
    assert "| kda | 3 |" in text and "XLA memory plan per device" in text
    assert json.loads(out.with_suffix(".json").read_text())["setup"]["preset"] == "tiny"
