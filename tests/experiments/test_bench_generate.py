"""`python -m experiments.bench_generate --smoke` on CPU: every TTFT and decode cell in the table
(a cell that does not fit the device is skipped and says so), the floor from the bytes a step
reads, the latent cache's bytes per token against a standard KV cache of the same heads."""

import json

import jax
import pytest
from flax import nnx

from experiments import bench_generate
from models.config import preset


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(results, markdown) of a smoke run in which the pool of batch 2 at context 64 is refused
    as if the device were full."""
    out = tmp_path_factory.mktemp("bench") / "generate.md"
    fits = bench_generate.fits
    limit = 40_000  # bytes: more than batch 2's caches at context 32 (35 KB), less than at 64

    def small_device(num_bytes, margin):
        return num_bytes <= limit, f"needs {num_bytes} bytes"

    bench_generate.fits = small_device
    try:
        results = bench_generate.main(["--smoke", "--repeats", "2", "--warmup", "1", "--out",
                                       str(out)])
    finally:
        bench_generate.fits = fits
    return results, out.read_text(), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
def test_every_cell_is_timed_or_says_why_not(smoke):
    results, markdown, saved = smoke
    assert [row["context"] for row in results["ttft"]] == [32, 64]
    assert all(row["ttft_ms"] > 0 for row in results["ttft"])
    cells = {(c["batch"], c["context"]): c for c in results["decode"]}
    assert set(cells) == {(1, 32), (1, 64), (2, 32), (2, 64)}
    assert cells[(2, 64)]["skipped"].startswith("needs ")
    assert "| 2 | 64 | skipped: does not fit (needs " in markdown
    for key in [(1, 32), (1, 64), (2, 32)]:
        cell = cells[key]
        assert cell["step_ms"] > 0 and cell["tokens_per_s"] == pytest.approx(
            key[0] / cell["step_ms"] * 1e3)
        assert cell["floor_ratio"] == pytest.approx(cell["step_ms"] / cell["floor_ms"])
        bandwidth = results["bandwidth_gb_per_s"]  # the floor: bytes read once at the bandwidth
        assert cell["floor_ms"] == pytest.approx(sum(cell["bytes_read_gb"].values()) / bandwidth
                                                 * 1e3)
        # The floor's bytes: every row's pages (40 numbers a token, float32, one MLA layer).
        assert cell["bytes_read_gb"]["mla_pages"] == pytest.approx(key[0] * key[1] * 160 / 1e9)
        assert f"| {key[0]} | {key[1]} | {cell['step_ms']:.2f} |" in markdown
    assert saved["decode"] == json.loads(json.dumps(results["decode"]))


def test_latent_cache_bytes_against_a_standard_kv_cache(smoke):
    cache = smoke[0]["cache"]
    mla = preset("tiny").mla  # 2 heads, keys of 16 + 8, values of 16, latent 32 + 8
    assert cache["measured_bytes"] == (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert cache["ours"]["standard_numbers"] == 2 * (16 + 8) + 2 * 16
    k3 = cache["k3"]  # the 576-number claim: 512 + 64 against 96 heads x (192 + 128)
    assert k3["latent_numbers"] == 576 and k3["standard_numbers"] == 96 * 320
    assert "| k3 (config) | 576 | 30720 | 1152 | 61440 | 53.3x |" in smoke[1]


def test_weights_read_count_the_expected_share_of_routed_experts():
    model = bench_generate.build_model(bench_generate.SMOKE)
    moe = model.cfg.moe
    experts = sum(weight[...].nbytes for layer, _ in model.moe_sites()
                  for weight in layer.kernel_weights().values())
    everything = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
    table = model.embed.embedding[...]
    for batch in (1, 3):
        share = 1 - (1 - moe.top_k / moe.num_experts) ** batch
        expected = (everything - table.nbytes + batch * table[0].nbytes
                    - (1 - share) * experts)
        assert bench_generate.weight_bytes_read(model, batch) == pytest.approx(expected)


@pytest.mark.slow
def test_long_mode_times_one_sequence_at_its_longer_contexts():
    results = bench_generate.main(["--smoke", "--long", "--repeats", "1", "--warmup", "0"])
    longer = tuple(2 * c for c in bench_generate.SMOKE.contexts)
    assert tuple(row["context"] for row in results["ttft"]) == longer
    assert {(c["batch"], c["context"]) for c in results["decode"]} == {(1, c) for c in longer}
    assert all(c["step_ms"] > 0 for c in results["decode"])
