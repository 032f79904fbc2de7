"""The MoE experiment entry points at tiny sizes: the balance comparison and the GPU benchmark."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import balance, bench_moe
from moe.config import MoEConfig
from moe.routing import split_bf16_matmul


@pytest.mark.slow
def test_balance_experiment_writes_plot_table_and_log(tmp_path):
    argv = ["--steps", "3", "--batch", "2", "--seq-len", "16", "--out", str(tmp_path)]
    rows = balance.main(argv + ["--methods", "qb", "none"])
    assert [row["method"] for row in rows] == ["qb", "none"]
    assert all(len(row["final_max_vio"]) == balance.ModelShape().layers for row in rows)
    assert (tmp_path / "balance_maxvio.png").stat().st_size > 0
    table = (tmp_path / "balance_table.md").read_text()
    assert "| qb |" in table and "| none |" in table
    assert (tmp_path / "balance_log.json").exists()


def test_balance_model_is_causal():
    shape = balance.ModelShape(
        d_model=16, num_experts=4, latent_dim=8, expert_hidden=8, shared_hidden=0
    )
    cfg = MoEConfig(
        num_experts=4, top_k=2, expert_hidden=8, latent_dim=8, latent_norm=True, gmm_backend="xla"
    )
    model = balance.TinyMoELM(shape, cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(12).reshape(1, 12) % 7
    logits, _ = model(tokens)
    changed, _ = model(tokens.at[0, 8].set(3))
    np.testing.assert_allclose(logits[0, :8], changed[0, :8], rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits[0, 8:], changed[0, 8:])


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


def test_split_bf16_matmul_is_float32_accurate():
    x = jax.random.normal(jax.random.key(0), (64, 96))
    w = jax.random.normal(jax.random.key(1), (96, 8))
    exact = jnp.einsum("td,de->te", x, w, precision="highest")
    assert float(jnp.max(jnp.abs(split_bf16_matmul(x, w) - exact))) < 1e-3
    x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    single_pass = jnp.einsum("td,de->te", x16, w16, preferred_element_type=jnp.float32)
    assert float(jnp.max(jnp.abs(single_pass - exact))) > 1e-2
