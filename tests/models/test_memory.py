"""The memory planner (`models.memory`) against XLA's memory analysis of the real training step.

Each case builds the `train.loop.Trainer` of a `tiny` configuration abstract (shapes and
shardings only; the unrolled cases keep three of its layers, `THREE_LAYERS`) and compiles its
step for a batch [B, T] on one CPU device or on a mesh of the eight virtual ones
(`tests/conftest.py`); nothing runs. Four steps are compiled
(`COMPILED_CASES`), each once for every test that reads it. XLA reports per device the
arguments (the donated train state and the batch), the outputs, the part of them aliased to the
arguments, and the temporaries. Tolerances, from the measurements tabled at `COMPILED_CASES`,
`TOTAL_CASES` and `test_temporaries_per_row_are_xlas`:

- arguments: parameters + AdamW moments + expert compute copies + router biases + batch equal
  XLA's to within `COUNTER_BYTES` (the optimizer's and the step's int32 counters, which the
  planner leaves out): exact, so a missing or doubled state term fails. XLA's arguments are the
  per-device shards of the state and of the batch arrays the step reads, so two more cases
  (bfloat16 compute copies in scanned groups; seq with fsdp and expert) are checked against
  those shards without a compile (`STATE_CASES`).
- temporaries per row: at a fixed T, XLA's extra temporaries for three rows per device over one
  (fsdp2 x expert2 x tensor2, B 3 and 4) against the planner's: 0.95 measured (band 0.8-1.25).
  The per-row part is what the planner estimates (activations, router statistics, logits); a
  planner off in the rows per device (3x here) falls outside the band. (On one device XLA:CPU's
  fallbacks of the GPU kernels, the dropless MoE's ragged grouped matmul among them, hold more
  per row than the kernels the planner models; not compared here.) The rest of
  XLA:CPU's temporaries is not compared here: it runs the XLA fallbacks of the GPU kernels
  (attention with its [T, T] scores, the chunked KDA), fuses less than XLA:GPU and computes
  bfloat16 elementwise ops in float32, so its fixed part is larger than the GPU step's; the
  planner's total (GPU kernels) is only checked to stay below XLA:CPU's peak.
- total with XLA's cores: planned with `kernels=False` (the chunked KDA op's and dense
  attention's residuals traced at the device's shapes, in place of the GPU kernels'), the total
  is within 15% of XLA:CPU's peak on one device (unrolled) and with seq=2 (scanned)
  (`TOTAL_CASES`; the unrolled seq=2 step has the same context-parallel terms).
  Not yet on the other scanned steps (XLA's loops hold 19-30% more than planned:
  7.2 MiB more for the one-device step scanned than unrolled, which the planner counts alike)
  nor on most meshes that combine seq with data, fsdp or expert: there XLA:CPU's peak for the
  same tokens per device moves with the mesh (seq2 x fsdp2 x expert2: 9.5 MiB, seq2 x fsdp4: 8.9
  MiB, one row of 64 tokens each; without seq, expert4: 17.8 MiB, fsdp4: 16.2 MiB for a row of
  128), which the planner's per-token accounting does not follow; the ratios are tabled in
  docs/memory_planner.md (fsdp4 0.91, not asserted: each asserted mesh is a compile).
- context parallelism's own terms (the gathered MLA latents and keys, KDA's second run, maps
  and halo) are derived by hand for `tiny` (`test_context_parallel_parts_are_derived`).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import pytest

from core.sharding import batch_sharding
from kda.layer import count_kda_params
from models.attention import count_mla_params
from models import memory
from models.config import count_params, preset
from models.memory import BATCH_BYTES_PER_TOKEN, _parse_mesh, plan_memory, print_memory_plan
from train.data import DataConfig
from moe.config import count_moe_params
from train.loop import MeshConfig, TrainConfig, Trainer

MIB = 2**20
COUNTER_BYTES = 64
# The arrays of the step's batch (`train.packing.finalize_batch`), [B, T] each.
BATCH_DTYPES = {"tokens": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32,
                "segment_ids": jnp.int32, "positions": jnp.int32}
MESH_8 = (("fsdp", 2), ("expert", 2), ("tensor", 2))
MESH_CP = (("seq", 2), ("fsdp", 2), ("expert", 2))


def abstract_step(overrides: tuple, mesh: tuple, batch_size: int, seq_len: int):
    """The abstract `Trainer` (shapes and shardings only) of `preset("tiny",
    **dict(overrides))` on the mesh `dict(mesh)`, and its step's batch [B, T]."""
    config = TrainConfig(model=preset("tiny", **dict(overrides)),
                         data=DataConfig(seq_len=seq_len, batch_size=batch_size),
                         mesh=MeshConfig(**{"data": 1, **dict(mesh)}), progress=False,
                         fast_compile=True)
    trainer = Trainer.create(config, abstract=True)
    sharding = batch_sharding(trainer.mesh, (batch_size, seq_len))
    batch = {name: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=sharding)
             for name, dtype in BATCH_DTYPES.items()}
    return trainer, batch


@functools.cache
def xla_memory(overrides: tuple, mesh: tuple, batch_size: int, seq_len: int) -> dict[str, int]:
    """XLA's per-device memory analysis of the compiled training step of `abstract_step`'s
    trainer, in bytes (cached: compiles are the cost; the step is compiled, never run)."""
    trainer, batch = abstract_step(overrides, mesh, batch_size, seq_len)
    with jax.set_mesh(trainer.mesh):
        stats = trainer.train_step.lower(trainer.state, batch).compile().memory_analysis()
    return {name: getattr(stats, f"{name}_size_in_bytes")
            for name in ("argument", "output", "alias", "temp")}


def planned(overrides: tuple, mesh: tuple, batch_size: int, seq_len: int, kernels=True):
    return plan_memory(preset("tiny", **dict(overrides)), dict(mesh), batch_size=batch_size,
                       seq_len=seq_len, kernels=kernels)


def xla_peak(memory: dict[str, int]) -> int:
    """XLA's peak per device: arguments, outputs not written into them, and temporaries."""
    return memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]


# The compiled steps, (preset overrides, mesh, B, T); each compile serves every test that names
# its case. Measured, MiB per device (planner / XLA:CPU):
#   case                                    arguments         total / peak
#   unrolled, 1 device, 4 x 128          2.932 / 2.932     18.42 / 44.33
#   unrolled, fsdp2 expert2 tensor2, 3   0.426 / 0.426      8.51 / 11.95  (3 rows each)
#   unrolled, fsdp2 expert2 tensor2, 4   0.422 / 0.422      3.39 / 7.07   (1 row each)
#   scanned, seq2, 2 x 128               2.042 / 2.042      8.87 / 26.49
# The unrolled steps compile three layers, every kind: KDA with the dense FFN, then KDA and Gated
# MLA with the MoE. The scanned step keeps `tiny`'s four, whose two middle KDA layers scan.
THREE_LAYERS = (("num_layers", 3), ("kda_layers", (1, 2)), ("full_attn_layers", (3,)))
ONE_DEVICE = (THREE_LAYERS, (), 4, 128)
INDIVISIBLE = (THREE_LAYERS, MESH_8, 3, 128)
ONE_ROW = (THREE_LAYERS, MESH_8, 4, 128)
SCANNED_SEQ2 = ((("scan_layers", True),), (("seq", 2),), 2, 128)
COMPILED_CASES = [
    pytest.param(*ONE_DEVICE, id="unrolled-1-device"),
    pytest.param(*INDIVISIBLE, id="indivisible-batch-8-devices", marks=pytest.mark.slow),
    pytest.param(*ONE_ROW, id="one-row-8-devices", marks=pytest.mark.slow),
    # The batch's tokens split over seq as `core.sharding.batch_sharding` splits them, and the
    # scanned groups' stacked parameters.
    pytest.param(*SCANNED_SEQ2, id="scanned-seq2", marks=pytest.mark.slow),
]


def assert_arguments_are(plan, measured: int):
    """The planned arguments equal `measured` (bytes per device) but for the step's counters."""
    assert 0 <= measured - plan.arguments <= COUNTER_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("overrides, mesh, batch_size, seq_len", COMPILED_CASES)
def test_planned_arguments_are_xlas(overrides, mesh, batch_size, seq_len):
    plan = planned(overrides, mesh, batch_size, seq_len)
    xla = xla_memory(overrides, mesh, batch_size, seq_len)
    peak = xla_peak(xla)
    print(f"{dict(overrides)} {dict(mesh)} {batch_size}x{seq_len}: arguments "
          f"{plan.arguments / MIB:.4f} / {xla['argument'] / MIB:.4f} MiB, total "
          f"{plan.total / MIB:.2f} / peak {peak / MIB:.2f} MiB")
    assert_arguments_are(plan, xla["argument"])
    # The new state is written into the donated old one.
    assert xla["alias"] >= plan.arguments - plan.batch - COUNTER_BYTES
    assert plan.total <= peak
    assert plan.compute_copies == 0  # float32 compute: the experts read their weights as stored


# Arguments are what the step receives: per device, the shards of the train state and of the
# batch arrays it reads (XLA drops the unread positions), as the cases above measure them against
# XLA's analysis. These two cases are read from the abstract state itself, without a compile:
# bfloat16 compute (the experts' compute copies) in scanned groups, and seq with fsdp and expert
# (the tokens over seq, the rows over fsdp x expert).
STATE_CASES = [
    pytest.param((("scan_layers", True), ("dtype", "bfloat16")), (), 4, 128,
                 id="scanned-bf16-1-device"),
    pytest.param((), MESH_CP, 4, 128, id="seq2-fsdp2-expert2"),
]


@pytest.mark.parametrize("overrides, mesh, batch_size, seq_len", STATE_CASES)
def test_planned_arguments_are_the_states_shards(overrides, mesh, batch_size, seq_len):
    plan = planned(overrides, mesh, batch_size, seq_len)
    trainer, batch = abstract_step(overrides, mesh, batch_size, seq_len)
    del batch["positions"]
    shards = [(leaf.sharding.shard_shape(leaf.shape), leaf.dtype)
              for leaf in jax.tree.leaves((trainer.state, batch))]
    assert_arguments_are(plan, sum(math.prod(shape) * jnp.dtype(dtype).itemsize
                                   for shape, dtype in shards))
    assert (plan.compute_copies > 0) == (dict(overrides).get("dtype") == "bfloat16")


# The planner with XLA's token mixer cores (`kernels=False`), as XLA:CPU runs them, against XLA's
# peak. Measured, MiB per device, plan / XLA:CPU peak (ratio):
#   unrolled, 1 device, 4 x 128               39.68 / 44.33   0.895
#   scanned, seq2, 2 x 128                    23.95 / 26.49   0.904
# The other steps and meshes, outside 15% or not compiled here, are tabled in
# docs/memory_planner.md (see the module docstring).
TOTAL_CASES = [
    pytest.param(*ONE_DEVICE, id="unrolled-1-device"),
    pytest.param(*SCANNED_SEQ2, id="scanned-seq2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("overrides, mesh, batch_size, seq_len", TOTAL_CASES)
def test_planned_total_with_xla_cores_is_xlas_peak(overrides, mesh, batch_size, seq_len):
    plan = planned(overrides, mesh, batch_size, seq_len, kernels=False)
    peak = xla_peak(xla_memory(overrides, mesh, batch_size, seq_len))
    print(f"{dict(mesh)} {batch_size}x{seq_len}: total {plan.total / MIB:.2f} / peak "
          f"{peak / MIB:.2f} MiB ({plan.total / peak:.3f})")
    assert 0.85 * peak <= plan.total <= 1.15 * peak


@pytest.mark.slow
def test_temporaries_per_row_are_xlas():
    """The same step at B = 4 (one row a device) and B = 3 (three: neither fsdp nor expert
    divides them). Measured, MiB per device, temporaries planner / XLA:CPU: 2.97 / 6.65 and
    8.08 / 11.52, the differences' ratio 0.95."""
    plans = [planned(*case) for case in (ONE_ROW, INDIVISIBLE)]
    temps = [xla_memory(*case)["temp"] for case in (ONE_ROW, INDIVISIBLE)]
    assert [plan.rows_per_device for plan in plans] == [1, 3]
    planned_extra = plans[1].temporaries - plans[0].temporaries
    xla_extra = temps[1] - temps[0]
    print(f"temporaries {[round(p.temporaries / MIB, 3) for p in plans]} / "
          f"{[round(t / MIB, 3) for t in temps]} MiB")
    assert 0.8 * planned_extra <= xla_extra <= 1.25 * planned_extra


def test_plan_parts_follow_the_sharding_rules():
    """One device against a mesh of eight: state split as `core.sharding` splits it, rows split
    only where the batch axes divide the batch."""
    cfg = preset("tiny")
    counts = count_params(cfg)
    single = plan_memory(cfg, {}, batch_size=2, seq_len=16)
    assert single.num_params == counts["total"] + counts["embedding"]
    assert single.params == single.num_params * 4 and single.optimizer == 2 * single.params
    assert single.gradients == single.params and single.gathered_weights == 0
    assert single.compute_copies == 0  # float32 compute: the experts read their weights as stored
    assert single.batch == 2 * 16 * BATCH_BYTES_PER_TOKEN
    mesh = dict(fsdp=2, expert=2, tensor=2)
    split = plan_memory(cfg, mesh, batch_size=4, seq_len=16)
    assert single.params / 8 <= split.params < single.params / 2
    assert split.rows_per_device == 1 and split.gathered_weights > 0
    # 3 rows: neither fsdp nor expert divides them, so every device holds all three.
    whole = plan_memory(cfg, mesh, batch_size=3, seq_len=16)
    assert whole.rows_per_device == 3
    assert whole.activations == pytest.approx(3 * split.activations)
    assert whole.router_stats == pytest.approx(3 * split.router_stats)
    bf16 = plan_memory(preset("tiny", dtype="bfloat16"), {}, batch_size=2, seq_len=16)
    moe_layers = cfg.num_layers - cfg.first_k_dense
    moe = cfg.moe
    expert_weights = moe_layers * moe.num_experts * 3 * moe.routed_width(cfg.d_model) * (
        moe.expert_hidden)
    assert bf16.compute_copies == 2 * expert_weights


@pytest.mark.parametrize("devices, mesh", [(1024, "fsdp=64,expert=16"),
                                           (4096, "data=4,fsdp=64,expert=16")])
def test_k3_memory_plan_on_large_meshes(capsys, devices, mesh):
    """The K3 plan at one row of 8192 tokens per device, its parts derived by hand."""
    cfg = preset("k3", scan_layers=True, remat="full")
    plan = print_memory_plan(cfg, _parse_mesh(mesh), batch_size=devices, seq_len=8192)
    assert f"({devices} devices)" in capsys.readouterr().out
    model_parallel = devices // plan.mesh["data"]  # data replicas hold the same shards
    # Float32 parameters split over fsdp x expert, plus norms and AttnRes vectors too small to
    # split, which stay whole (a little).
    ideal = plan.num_params * 4 / model_parallel
    assert ideal <= plan.params < 1.1 * ideal
    assert plan.optimizer == 2 * plan.params and plan.gradients == plan.params
    # bf16 copies of every expert weight: 92 MoE layers x 896 experts x (3584 x 2 x 3072 in,
    # 3072 x 3584 out); 896 experts split over expert=16, 3584 latent over fsdp=64.
    moe = cfg.moe
    expert_weights = 92 * moe.num_experts * 3 * moe.latent_dim * moe.expert_hidden
    assert plan.compute_copies == 2 * expert_weights / model_parallel
    # One row per device: batch axes data x fsdp x expert = devices.
    tokens = 8192
    assert plan.rows_per_device == 1 and plan.batch == tokens * BATCH_BYTES_PER_TOKEN
    # Router statistics of 92 layers: float32 scores [896], int32 ids and bool mask [16], and a
    # bool token mask per token.
    assert plan.router_stats == 92 * tokens * (4 * 896 + 5 * 16 + 1)
    # The largest layer's weights gathered whole over fsdp and expert, the experts' split over
    # the expert axis kept: a bf16 weight and a float32 gradient each. (Its few vectors that stay
    # replicated at rest, such as KDA's A_log, dt_bias and conv taps, are not gathered: 0.1%.)
    d = cfg.d_model
    experts_per_layer = expert_weights / 92
    layer = (max(count_kda_params(d, cfg.kda), count_mla_params(d, cfg.mla))
             + count_moe_params(d, moe)["total"] - experts_per_layer * (1 - 1 / 16)
             + 2 * d + 2 * 2 * d)  # two RMSNorm gains, two AttnRes reads (gain, query)
    assert plan.gathered_weights == pytest.approx(6 * layer, rel=1e-3)
    assert plan.total == pytest.approx(plan.arguments + plan.temporaries)
    assert plan.total < 141e9  # fits an H200 with these settings
    assert math.prod(plan.mesh.values()) == devices


def test_long_context_settings_move_memory_as_planned():
    """Offloading, the chunked loss and the chunked KDA and MoE each take out of the device's
    activations what they promise (no compile: the planner's own accounting)."""
    rows, seq_len = 2, 1024
    full = preset("tiny", remat="full")
    plan = lambda cfg, **kw: plan_memory(  # noqa: E731
        cfg, {}, batch_size=rows, seq_len=seq_len, **kw)
    on_device = plan(full)
    offloaded = plan(dataclasses.replace(full, remat="offload"))
    layer_inputs = rows * seq_len * full.num_layers * full.d_model * full.compute_dtype.itemsize
    assert on_device.host_offload == 0 and offloaded.host_offload == layer_inputs
    assert on_device.activations - offloaded.activations == pytest.approx(layer_inputs)
    chunked_loss = plan(full, loss_chunk_tokens=128)
    logits = rows * (seq_len - 128) * 2 * 4 * full.vocab_size  # float32 logits and gradient
    assert on_device.activations - chunked_loss.activations == pytest.approx(logits)
    segmented = dataclasses.replace(
        full, kda=dataclasses.replace(full.kda, segment_tokens=128),
        moe=dataclasses.replace(full.moe, token_chunk=128))
    # The largest recomputed layer was a KDA + MoE layer whole; now it is the first, KDA in
    # 128-token segments and its dense FFN whole (neither MLA nor the dense FFN is chunked).
    floats = lambda part, kind: sum(part(full, kind, 1))  # noqa: E731
    kda, mla = (floats(memory._mixer_activation_floats, kind) for kind in ("kda", "mla"))
    dense, moe = (floats(memory._ffn_activation_floats, kind) for kind in ("dense", "moe"))
    assert full.ffn_kinds == ("dense", "moe", "moe", "moe") and full.mixer_kinds[0] == "kda"
    before, after = seq_len * (kda + moe), 128 * kda + seq_len * dense
    assert after > seq_len * mla + 128 * moe  # the MLA layer, now the second largest
    assert on_device.activations - plan(segmented).activations == pytest.approx(
        rows * (before - after) * full.compute_dtype.itemsize)


def test_context_parallel_parts_are_derived():
    """A seq axis of 2: the batch, router statistics and per-token activations of T / 2 tokens a
    row, the state split over seq as over fsdp (the rules table splits embed and latent over
    both), and each layer's exchange, derived by hand for `tiny` (f32, no remat: everything
    kept)."""
    cfg = preset("tiny")
    rows, length, local = 2, 128, 64
    split = plan_memory(cfg, {"seq": 2}, batch_size=rows, seq_len=length)
    alone = plan_memory(cfg, {}, batch_size=rows, seq_len=local)  # the same tokens a device
    assert split.rows_per_device == rows and split.batch == alone.batch
    assert split.batch == rows * local * BATCH_BYTES_PER_TOKEN
    assert split.router_stats == alone.router_stats
    # Two rows of 64 tokens a device on fsdp=2 too, each parameter split the same way.
    fsdp = plan_memory(cfg, {"fsdp": 2}, batch_size=2 * rows, seq_len=local)
    assert split.arguments == fsdp.arguments < alone.arguments
    assert split.gathered_weights == fsdp.gathered_weights > alone.gathered_weights
    mla, kda = cfg.mla, cfg.kda
    assert cfg.mixer_kinds == ("kda", "kda", "kda", "mla") and cfg.remat == "none"
    # Gated MLA: the other shard's 64 latents [c_kv ; k_r] (32 + 8), their W_kvb keys and values
    # (2 heads x (16 + 16)), keys with k_r on every head (2 x 24) and values padded to 24 (2 x 24);
    # every shard's int32 ids [128] and the bool mask [64, 128].
    gathered = local * (40 + 2 * (16 + 16) + 2 * (24 + 24)) * 4 + 128 * 4 + local * 128
    # KDA: the second run's output R [64, 2 heads, 32] and float32 chunk states (a 32 x 32 state
    # per head and 64 tokens), both shards' maps [2 heads, 32, 64] and entering states
    # [2 heads, 32, 32], and the previous shard's last 3 conv inputs [3, 192].
    exchanged = (local * (2 * 32 + 2 * 32 * 32 / 64) + 2 * 2 * (32 * 64 + 32 * 32)
                 + 3 * kda.qkv_dim) * 4
    assert (mla.latent_dim, mla.qk_head_dim, kda.qkv_dim, kda.conv_size) == (40, 24, 192, 4)
    assert split.activations - alone.activations == pytest.approx(
        rows * (gathered + 3 * exchanged))
    with pytest.raises(ValueError, match="seq mesh axis of 2 devices must split seq_len=127"):
        plan_memory(cfg, {"seq": 2}, batch_size=rows, seq_len=127)
    with pytest.raises(SystemExit):  # the command line says so in one line
        memory.main(["--preset", "tiny", "--mesh", "seq=2", "--seq", "127"])


def test_fitting_plans_double_the_seq_axis_until_the_plan_fits():
    cfg = preset("tiny")
    plans = memory.fitting_plans(cfg, 8, 1024, expert=2, device_bytes=20 * MIB)
    assert [plan.mesh["seq"] for plan in plans] == [2**i for i in range(len(plans))]
    assert [plan.total <= 20 * MIB for plan in plans] == [False] * (len(plans) - 1) + [True]
    assert all(plan.mesh["fsdp"] * plan.mesh["seq"] * 2 == 8 for plan in plans)
    assert all(plan.batch_size * plan.mesh["seq"] == 8 for plan in plans)
