"""experiments.bench_train runs at its CPU smoke size, reports every part of the step and XLA's
memory plan, and names the options that shrink a step that does not fit."""

import dataclasses
import json

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from experiments import bench_train
from kda import api as kda_api
from kda import kda_attention
from kda import layer as kda_layer
from models import attention
from models.lm import REMAT
from moe.grouped_matmul import grouped_matmul

# The smoke size's model cut to two layers, one of each kind (KDA with a dense FFN, Gated MLA with
# the MoE): every part of the step, half the compile time.
TWO_LAYERS = ("model.num_layers=2", "model.kda_layers=1", "model.full_attn_layers=2")
TWO_LAYER_FLAGS = [flag for setting in TWO_LAYERS for flag in ("--set", setting)]
TWO_LAYER_SMOKE = dataclasses.replace(bench_train.SMOKE, settings=TWO_LAYERS)
# The tests that compile a step use the GPU setup's recomputation policy: on CPU (float32, where no
# GPU kernel or stand-in runs) one step program then serves the smoke run, `--cpu-plan` and both
# steps of `--versus`, compiled once (the persistent cache). Remat "none" trains everywhere else.
GPU_REMAT = ("--remat", bench_train.GPU.remat)
GPU_REMAT_SMOKE = dataclasses.replace(TWO_LAYER_SMOKE, remat=bench_train.GPU.remat)


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
    times = dict(compile_seconds=1.5, lowering_seconds=0.5)
    monkeypatch.setattr(bench_train, "device_memory_limit", lambda: 1.0)
    memory = bench_train.preflight(compiled, times, bench_train.GPU)
    printed = capsys.readouterr().out
    assert "compiled in 1.5 s (0.5 s of it tracing and lowering)" in printed
    assert "peak" in printed and memory["peak"] < 1.0

    monkeypatch.setattr(bench_train, "device_memory_limit", lambda: 1e-3)
    with pytest.raises(RuntimeError, match="--remat full") as raised:
        bench_train.preflight(compiled, times, bench_train.GPU)
    assert f"--batch {bench_train.GPU.batch // 2}" in str(raised.value)


def test_settings_override_the_run_and_bad_ones_are_refused(capsys):
    setup = dataclasses.replace(bench_train.SMOKE, settings=("model.mla.implementation=xla",
                                                             "optim.clip_norm=0.5"))
    config = bench_train.train_config(setup, "adamw")
    assert config.model.mla.implementation == "xla" and config.optim.clip_norm == 0.5
    with pytest.raises(SystemExit):
        bench_train.main(["--smoke", "--set", "model.mla.no_such_field=1"])
    assert "no_such_field" in capsys.readouterr().err


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
def test_smoke_run_reports_throughput_memory_breakdown_and_profile(tmp_path, capsys,
                                                                    monkeypatch):
    out = tmp_path / "bench.md"
    # The GPU setup's recomputation policy, at the smoke size.
    reported = []
    write_result = bench_train.write_result

    def record(result, command, path):  # what the table held after each update
        write_result(result, command, path)
        reported.append(out.read_text())

    monkeypatch.setattr(bench_train, "write_result", record)
    result = bench_train.main(["--smoke", "--steps", "2", *GPU_REMAT, "--profile", "--out",
                               str(out), *TWO_LAYER_FLAGS])
    assert "stopped before the step was timed" in reported[0]
    assert "before every layer was timed" in reported[1] and "| rest |" in reported[-1]
    assert "preflight: step compiled" in capsys.readouterr().out
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1
    assert result["setup"]["remat"] == bench_train.GPU.remat
    assert not result["setup"]["scan_layers"]  # every layer compiled on its own unless --scanned
    assert 0 < result["lowering_seconds"] < result["compile_seconds"]
    assert 0 < result["memory_gib"]["argument"] <= result["memory_gib"]["peak"]
    assert set(result["breakdown"]) == {"kda", "attention", "moe", "rest"}
    parts = sum(part["seconds_per_step"] for part in result["breakdown"].values())
    assert parts == pytest.approx(result["step_seconds"])
    text = out.read_text()
    assert "| kda | 1 |" in text and "XLA memory plan per device" in text
    assert result["ops"]["rows"] and "Where the step's device time goes" in text
    scopes = result["ops"]["scopes"]
    assert all(scopes[part] > 0 for part in ("kda", "attention", "moe", "optimizer")), scopes
    assert sum(scopes.values()) == pytest.approx(result["ops"]["total_ms"])
    assert text.index("In-step device time by part") < text.index("Top device ops")
    kda_passes = result["ops"]["passes"]["kda"]
    assert kda_passes["forward"] > 0 and kda_passes["backward"] > 0, kda_passes
    assert sum(kda_passes.values()) == pytest.approx(scopes["kda"])
    assert f"| kda | {kda_passes['forward']:.3f} | " in text
    assert f" | {scopes['kda']:.3f} | " in text
    kda_rows = result["ops"]["scope_rows"]["kda"]
    assert 0 < len(kda_rows) <= bench_train.PROFILED_OPS_PER_PART
    assert sum(row["ms"] for row in kda_rows) <= scopes["kda"] + 1e-9
    assert f"`kda` ({scopes['kda']:.3f} ms per step)" in text
    assert json.loads(out.with_suffix(".json").read_text())["setup"]["preset"] == "tiny"


def _callback_outputs(jaxpr) -> list[list[tuple]]:
    """(shape, dtype) of the results of every pure_callback in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pure_callback":
            found.append([(v.aval.shape, v.aval.dtype) for v in eqn.outvars])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _callback_outputs(sub)
    return found


def test_stand_in_writes_only_what_the_kernel_writes():
    def fwd_rule(x, ids):  # keeps an operand and its output, writes one more residual
        out = jnp.zeros((4,), jnp.bfloat16)
        return out, (x, out, jnp.zeros((3, 8), jnp.float32), ids)

    stand_in = bench_train.opaque_stand_in(fwd_rule)
    x, ids = jnp.ones((8,), jnp.float32), jnp.ones((8,), jnp.int32)
    forward = jax.make_jaxpr(lambda x, ids: jax.vjp(stand_in, x, ids))(x, ids)
    assert _callback_outputs(forward.jaxpr) == [[((4,), jnp.bfloat16), ((3, 8), jnp.float32)]]

    loss = lambda x: jnp.sum(stand_in(x, ids).astype(jnp.float32))  # noqa: E731
    grad = jax.make_jaxpr(jax.grad(loss))(x)
    # The backward writes the float operand's cotangent only (none for the int ids).
    assert [((8,), jnp.float32)] in _callback_outputs(grad.jaxpr)
    assert jax.eval_shape(jax.grad(loss), x).shape == x.shape


def test_gpu_kernel_stand_ins_replace_the_kernels_only_within():
    bf16 = jnp.bfloat16
    q = jnp.ones((1, 64, 1, 64), bf16)
    g = -jnp.ones((1, 64, 1, 64), jnp.float32)
    beta = jnp.ones((1, 64, 1), jnp.float32)
    segment_ids = jnp.ones((1, 64), jnp.int32)

    def kda_op(q):
        return kda_attention(q, q, q, g, beta, segment_ids=segment_ids, use_qk_l2norm=True,
                             gate_lower_bound=-5.0)[0]

    def attention_op(q):
        return attention.causal_document_attention(q, q, q[..., :32], scale=0.1,
                                                   segment_ids=segment_ids, max_segments=16)

    def expert_op(lhs):
        return grouped_matmul(lhs, jnp.ones((2, 128, 128), bf16), jnp.array([3, 5]))

    def conv_op(x):
        return kda_layer.conv_silu_parts(x, jnp.ones((4, 192), bf16), segment_ids,
                                         (64, 64, 64))[0]

    ops = [(kda_op, q), (attention_op, q), (expert_op, jnp.ones((8, 128), bf16)),
           (conv_op, jnp.ones((1, 64, 192), bf16))]
    before = list(kda_api._KERNELS)
    shapes = [jax.eval_shape(op, x).shape for op, x in ops]
    with bench_train.gpu_kernel_stand_ins():
        assert [jax.eval_shape(op, x).shape for op, x in ops] == shapes
        for op, x in ops:
            assert _callback_outputs(jax.make_jaxpr(jax.grad(
                lambda x: jnp.sum(op(x).astype(jnp.float32))))(x).jaxpr)
        # Where the GPU kernels would not run (float32 here), neither does a stand-in.
        assert not _callback_outputs(jax.make_jaxpr(attention_op)(q.astype(jnp.float32)).jaxpr)
    assert kda_api._KERNELS == before
    for op, x in ops:
        assert not _callback_outputs(jax.make_jaxpr(op)(x).jaxpr)


def test_a_partial_result_is_reported_as_far_as_it_got():
    result = {"setup": dataclasses.asdict(bench_train.SMOKE), "optimizer": "adamw",
              "params": {"total": 10**6, "active": 10**5, "embedding": 10**4}, "device": "cpu",
              "jax": jax.__version__, "flax": "0", "date": "today"}
    assert "stopped before the step was timed" in bench_train.markdown(result, "cmd")
    result.update(compile_seconds=3.0, lowering_seconds=1.0,
                  memory_gib={"argument": 1.0, "output": 1.0, "alias": 1.0, "temp": 2.0,
                              "peak": 3.0},
                  step_seconds=0.5, waited_step_seconds=0.6, tokens_per_second=256.0,
                  model_tflops_per_second=1.0,
                  mfu=0.001, breakdown={"kda": bench_train._part(3, 0.2, 0.5, 1e12)})
    text = bench_train.markdown(result, "cmd")
    assert "| 500.0 ms | 600.0 ms | 256 |" in text and "| kda | 3 | 200.0 | 40% |" in text
    assert "Compile 3 s (1 s of it tracing and lowering)." in text
    assert "before every layer was timed" in text


@pytest.mark.slow
def test_cpu_plan_compiles_the_step_of_an_abstract_state(capsys):
    """`--cpu-plan` builds the trainer abstract (shapes and shardings as the real one, nothing
    allocated) and compiles its step with the GPU kernels stood in."""
    config = bench_train.train_config(GPU_REMAT_SMOKE, "adamw")
    abstract = bench_train.Trainer.create(config, abstract=True).state
    concrete = bench_train.Trainer.create(config).state
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), abstract) == jax.tree.map(
        lambda x: (x.shape, x.dtype, x.sharding), concrete)
    result = bench_train.cpu_plan(GPU_REMAT_SMOKE, "adamw")
    assert 0 < result["memory_gib"]["argument"] <= result["memory_gib"]["peak"]
    assert "GPU kernels stood in" in capsys.readouterr().out


def test_long_cpu_plan_plans_each_length(monkeypatch):
    planned = []
    monkeypatch.setattr(bench_train, "cpu_plan",
                        lambda setup, optimizer: planned.append(setup.seq_len) or {})
    bench_train.main(["--smoke", "--long", "--cpu-plan", "--lengths", "256", "512"])
    assert planned == [256, 512]


@pytest.mark.slow
def test_versus_times_the_step_again_with_the_override_in_one_process(tmp_path, capsys):
    """`--versus KEY=VALUE`: the step as set, then built again with the override added and
    timed after it; both rows in the table. (`--no-layers`: the breakdown is skipped.)"""
    out = tmp_path / "bench.md"
    result = bench_train.main(["--smoke", "--steps", "1", "--no-layers", "--versus",
                               "model.mla.implementation=xla", "--out", str(out), *GPU_REMAT,
                               *TWO_LAYER_FLAGS])
    versus = result["versus"]
    assert versus["settings"] == ["model.mla.implementation=xla"]
    assert versus["step_seconds"] > 0 and versus["memory_gib"]["peak"] > 0
    assert result["breakdown"] == {}
    printed = capsys.readouterr().out
    assert printed.count("preflight: step compiled") == 2
    assert "versus: the same step with --set model.mla.implementation=xla" in printed
    text = out.read_text()
    assert "| as above |" in text and "| with the settings |" in text
    assert "Breakdown" not in text and "before every layer" not in text
    with pytest.raises(SystemExit):
        bench_train.main(["--smoke", "--versus", "model.kda.no_such_field=1"])
    assert "--versus" in capsys.readouterr().err


def test_long_rows_record_what_fits_and_where_the_rest_goes(monkeypatch, tmp_path, capsys):
    """`--long` steps each length it can and records, for one over the device, the planner's
    breakdown instead of stopping (the steps stood in: the table's logic, not XLA, is tested)."""
    def compiled_trainer(config, setup):
        if setup.seq_len > 256:
            raise RuntimeError(f"the step at 1 x {setup.seq_len} tokens needs 9.0 GiB, more than "
                               "the 1.0 GiB the device allocator has")
        assert config.loss_chunk_tokens == 128 and config.model.moe.token_chunk == 128
        memory = {"argument": 0.1, "output": 0.1, "alias": 0.1, "temp": 0.4, "peak": 0.5}
        return None, None, None, {"compile_seconds": 2.0, "lowering_seconds": 1.0,
                                  "memory_gib": memory}

    monkeypatch.setattr(bench_train, "compiled_trainer", compiled_trainer)
    monkeypatch.setattr(bench_train, "step_runner", lambda *args: None)
    monkeypatch.setattr(bench_train, "timed_step", lambda step, setup, flops: {
        "step_seconds": 0.25, "tokens_per_second": setup.tokens / 0.25, "mfu": 0.01})
    out = tmp_path / "long.md"
    result = bench_train.main(["--smoke", "--long", "--lengths", "256", "512", "--out", str(out)])
    fits, over = result["rows"]
    assert fits["tokens_per_second"] == 1024 and "note" not in fits
    assert "needs 9.0 GiB" in over["note"] and "step_seconds" not in over
    assert 0 < fits["planned_gib"] < over["planned_gib"]
    assert fits["planned_host_gib"] > 0  # offload: the layer inputs wait in host memory
    text = out.read_text()
    assert "| 256 | " in text and "| 0.25 | 1,024 | 1.0 |" in text
    assert "| 512 | " in text and "needs 9.0 GiB" in text
    assert "Where the memory goes at 512 tokens" in text
    assert "Where the memory goes at 256 tokens" not in text
    assert "host (offload)" in text and "activations" in text
    assert json.loads(out.with_suffix(".json").read_text())["rows"][1]["seq_len"] == 512
    with pytest.raises(SystemExit):
        bench_train.main(["--smoke", "--lengths", "256"])
    assert "add --long" in capsys.readouterr().err
