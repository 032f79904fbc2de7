"""`python -m experiments.bench_moe` at its CPU smoke size: the table, the parts and the profile;
and its check of the Mosaic GPU grouped GEMMs against XLA's ragged_dot, run on a simulated Hopper
(the kernels in interpret mode), which reports a perturbed kernel."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments import bench_moe
from moe import grouped_matmul
from moe.experts import StableLatentMoE
from moe.kernels.mosaic_gpu.simulation import interpreted_on_cpu


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


# Widths that fit the Mosaic GPU kernels' 128-wide tiles, 128 rows of expert copies.
KERNEL_SIZED = bench_moe.BenchShape(128, 4, 2, 128, 128, batch=1, seq_len=64, hidden_multiple=8)


@pytest.mark.slow  # about 1.5 min: the layer's grouped GEMMs interpreted, twice
def test_xla_check_reports_a_perturbed_mosaic_gpu_kernel(monkeypatch):
    """`compare_with_xla_backend` with the layer's grouped GEMMs on the Mosaic GPU kernels
    (interpret mode) and its twin's on XLA: the two agree to rounding, and a kernel whose product
    is 3% off makes the check fail, so the comparison is not of a backend with itself."""
    monkeypatch.setattr(grouped_matmul, "_on_hopper", lambda: True)
    shape = KERNEL_SIZED
    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    layer = StableLatentMoE(shape.d_model, bench_moe.moe_config(shape), rngs=nnx.Rngs(1), **bf16)
    x_key, cotangent_key = jax.random.split(jax.random.key(0))
    x = jax.random.normal(x_key, (shape.batch, shape.seq_len, shape.d_model), jnp.bfloat16)
    cotangent = jax.random.normal(cotangent_key, x.shape, jnp.bfloat16)
    step, params = bench_moe.gradient_step(layer)
    assert "mosaic" in str(jax.make_jaxpr(step)(params, x, cotangent))  # the kernels, not XLA
    kernel = grouped_matmul._mosaic_grouped_matmul
    with interpreted_on_cpu(num_sms=2):
        agreed = bench_moe.compare_with_xla_backend(layer, x, cotangent)
        monkeypatch.setattr(grouped_matmul, "_mosaic_grouped_matmul",
                            lambda *operands: kernel(*operands) * 1.03)
        perturbed = bench_moe.compare_with_xla_backend(layer, x, cotangent)
    assert agreed <= bench_moe.XLA_AGREEMENT_TOLERANCE
    assert perturbed > bench_moe.XLA_AGREEMENT_TOLERANCE
