"""Per-device memory of a training step, planned without allocating anything.

    plan = print_memory_plan(preset("k3"), {"fsdp": 64, "expert": 16}, batch_size=1024,
                             seq_len=8192)

or from the shell:

    python -m models.memory --preset k3 --mesh fsdp=64,expert=16 --batch 1024 --seq 8192
    python -m models.memory --table --loss-chunk 8192   # 8K..1M on 1024, 4096 H200s, seq as needed

The step's arguments are exact (but for a few scalar counters): float32 parameters, AdamW
moments, the compute-dtype copies of the MoE expert weights (`train.step.TrainState`), router
biases and the batch arrays the step reads, each array split as `core.sharding` splits it (a
dimension that an axis does not divide stays replicated over that axis: a batch axis that does
not divide the rows holds copies of them). The parameter tree comes from `jax.eval_shape` of
the real model.

Temporaries are an estimate: the float32 gradients; the activations the backward pass keeps
per token and layer under the config's remat policy (flash attention assumed: no [T, T] scores),
the AttnRes snapshots and the float32 logits (of `loss_chunk_tokens` positions at a time when the
loss runs in chunks); every MoE layer's router statistics, held from the forward until the
router-bias update; and, on a mesh, the largest layer's weights gathered whole over the fsdp and
expert axes for its matmuls, with their unreduced gradients. Under `full` and `offload` one layer
is recomputed at a time, over KDA's `segment_tokens` and the MoE's `token_chunk` positions at
once where those are set; `offload` keeps the layer inputs in pinned host memory (`host_offload`,
reported apart from the device's total).

Context parallelism (a `seq` axis of P devices, `core.context_parallel`) splits each row's T
tokens into shards of T / P: every per-token activation above is counted for T / P positions, and
each layer adds what crosses the shards (`context_parallel_floats`): a Gated MLA layer holds every
shard's latents [T, C + R] and the keys and values up-projected from them [T, H, ...] with the
[T / P, T] document mask (the whole sequence's keys on each device); a KDA layer holds the second
run of its op (the state map), the gathered maps of every shard and the states entering them, and
the short convolution's halo.

The token mixers' cores are planned as the GPU kernels run them (flash attention, the Pallas KDA
op); `kernels=False` plans XLA's implementations instead (what a CPU runs: the chunked KDA op and
dense attention with its [T / P, T] scores), their residuals traced at the device's shapes. XLA's
real peak adds fusion temporaries and collective buffers; `tests/models/test_memory.py` checks
the plan against XLA's memory analysis of the compiled step and states the tolerances.
"""

import argparse
import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from core.sharding import MESH_AXES, abstract_mesh, describe_mesh, logical_to_mesh
from kda.api import kda_attention
from kda.chunked import CHUNK_SIZE
from models.attn_res import num_seal_slots
from models.config import PRESETS, REMAT_POLICIES, ModelConfig, count_params, format_count, preset
from models.lm import HybridLM
from moe.experts import StableLatentMoE

GIB = 2**30
# An H200's memory as JAX sees it (141 GB on the box; `benchmarks/train_notes.md`).
H200_BYTES = 139 * GIB
# The arrays of the trainer's batch (`train.packing.finalize_batch`) that the step reads, per
# token: tokens, targets and segment ids (int32) and the loss mask (float32). (Its positions are
# not read, so the jitted step drops them.)
BATCH_BYTES_PER_TOKEN = 4 * 4
# Logical axes that fsdp splits at rest and a layer gathers whole for its matmuls.
GATHERED_AXES = frozenset({"embed", "latent"})


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one training step (the module docstring says what is estimated).

    Arguments of the step: params, optimizer, compute_copies, other_state (router biases),
    batch. Temporaries: gradients, activations, router_stats, gathered_weights.
    """

    mesh: Mapping[str, int]
    batch_size: int
    seq_len: int
    rows_per_device: int
    remat: str
    num_params: int
    params: float
    optimizer: float
    compute_copies: float
    other_state: float
    batch: float
    gradients: float
    activations: float
    router_stats: float
    gathered_weights: float
    host_offload: float  # pinned host memory, not the device's: the layer inputs under `offload`
    largest: tuple[tuple[str, float], ...]  # the biggest per-device parameter shards

    @property
    def arguments(self) -> float:
        return self.params + self.optimizer + self.compute_copies + self.other_state + self.batch

    @property
    def temporaries(self) -> float:
        return self.gradients + self.activations + self.router_stats + self.gathered_weights

    @property
    def total(self) -> float:
        return self.arguments + self.temporaries

    def report(self, device_bytes: float = H200_BYTES) -> str:
        devices = math.prod(self.mesh.values())
        tokens = self.batch_size * self.seq_len
        rows = ("every row on every device" if self.rows_per_device == self.batch_size else
                f"{self.rows_per_device} row{'s' if self.rows_per_device > 1 else ''} per device")
        if self.mesh["seq"] > 1:
            rows += f", {self.seq_len // self.mesh['seq']} tokens of each"
        parts = [("parameters", self.params), ("optimizer", self.optimizer),
                 ("compute copies", self.compute_copies), ("router biases", self.other_state),
                 ("batch", self.batch), ("gradients", self.gradients),
                 ("activations", self.activations), ("router stats", self.router_stats),
                 ("gathered weights", self.gathered_weights)]
        lines = [
            f"mesh {describe_mesh(self.mesh)}; batch {self.batch_size} x {self.seq_len} tokens "
            f"({format_count(tokens)} per step, {rows}); remat {self.remat}; "
            f"{format_count(self.num_params)} parameters",
            "per device:",
            *(f"  {name:17}{bytes_ / GIB:10.2f} GiB" for name, bytes_ in parts),
            f"  {'arguments':17}{self.arguments / GIB:10.2f} GiB  (exact)",
            f"  {'temporaries':17}{self.temporaries / GIB:10.2f} GiB  (estimate)",
            f"  {'total':17}{self.total / GIB:10.2f} GiB of {device_bytes / GIB:.1f} GiB "
            f"({100 * self.total / device_bytes:.0f}%)"
            + ("" if self.total <= device_bytes else "  DOES NOT FIT"),
            *([f"  {'host (offload)':17}{self.host_offload / GIB:10.2f} GiB  (pinned host "
               "memory, not counted above)"] if self.host_offload else []),
            f"all {devices} devices: {devices * self.total / 2**40:.1f} TiB",
            "largest parameter shards per device:",
        ]
        lines += [f"  {bytes_ / GIB:8.3f} GiB  {path}" for path, bytes_ in self.largest]
        return "\n".join(lines)


def _shard_factor(spec, sizes: Mapping[str, int]) -> int:
    factor = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            factor *= sizes[axis]
    return factor


def rows_per_device(batch_size: int, mesh: jax.sharding.AbstractMesh) -> int:
    """Rows of a [batch_size, T] batch on each device, as `core.sharding.batch_sharding` splits
    it: over the batch axes that divide it, the others holding copies."""
    spec = logical_to_mesh(("batch",), (batch_size,), mesh)
    return batch_size // _shard_factor(spec, dict(mesh.shape))


def _mixer_kernel_floats(cfg: ModelConfig, mixer: str, tensor: int) -> float:
    """Numbers per token (in units of the compute dtype) that a token mixer's GPU kernels write
    and `dots_kernels` keeps: KDA's preparation operands (W, q and k factors, Aqk), its saved
    residuals (float32 G, Akk, T as a hi/lo pair), the recurrence's (bf16 chunk states, V_new) and
    its output; cuDNN attention's output and float32 softmax statistics. (The MoE's grouped GEMM
    outputs are matmul outputs, already counted.)"""
    if mixer == "kda":
        kda = cfg.kda
        keys = kda.num_value_heads * kda.head_dim
        per_head = 4 * CHUNK_SIZE + kda.head_dim ** 2 / CHUNK_SIZE  # Aqk, Akk, T; states
        return (7 * keys + kda.num_value_heads * per_head) / tensor
    mla = cfg.mla
    return mla.num_heads * (mla.v_head_dim + 2) / tensor


def _kda_op_floats(cfg: ModelConfig, tensor: int) -> float:
    """Numbers per token that the KDA op's GPU kernels keep for the backward pass (in units of the
    compute dtype): the float32 chunk states, one K x V state per chunk of 64 tokens."""
    kda = cfg.kda
    f32 = 4 / cfg.compute_dtype.itemsize
    return f32 * kda.num_value_heads * kda.head_dim * kda.head_dim / CHUNK_SIZE / tensor


def _mixer_activation_floats(cfg: ModelConfig, mixer: str, tensor: int):
    """Numbers kept per token by one token mixer (its RMSNorm and AttnRes read included):
    (matmul outputs, everything else). Widths that tensor parallelism splits (heads) are divided
    by the tensor axis size."""
    d = cfg.d_model
    kda, mla = cfg.kda, cfg.mla
    if mixer == "kda":
        keys = kda.num_value_heads * kda.head_dim
        matmul = (kda.qkv_dim + keys + kda.num_value_heads + keys) / tensor + kda.head_dim + d
        # conv and SiLU outputs, float32 log-decays, attention output, its norm and gating, and
        # what the KDA op keeps.
        other = (2 * kda.qkv_dim + 2 * keys + 3 * keys) / tensor + _kda_op_floats(cfg, tensor)
    else:
        heads = mla.num_heads
        queries = (mla.q_lora_rank or 0)
        matmul = (queries + mla.latent_dim + d
                  + heads * (mla.qk_head_dim + mla.qk_nope_head_dim + 2 * mla.v_head_dim) / tensor)
        other = queries + mla.kv_lora_rank + heads * (2 * mla.v_head_dim + 2) / tensor
    # An AttnRes read and an RMSNorm (inputs kept in float32 for the backward pass).
    return matmul, other + 2 * 2 * d


def _ffn_activation_floats(cfg: ModelConfig, ffn: str, tensor: int):
    """`_mixer_activation_floats` for one FFN (dense GLU or Stable LatentMoE)."""
    d, moe = cfg.d_model, cfg.moe
    if ffn == "dense":
        matmul = 2 * cfg.dense_hidden / tensor + d
        other = cfg.dense_hidden / tensor
    else:
        width = moe.routed_width(d)
        copies = moe.slots_per_token
        matmul = (2 * moe.num_experts  # float32 router logits
                  + (width if moe.latent_dim else 0)
                  + copies * (2 * moe.expert_hidden / tensor + width)
                  + 2 * moe.shared_hidden / tensor + 2 * d)
        other = (2 * moe.num_experts + copies * (width + moe.expert_hidden / tensor)
                 + 2 * width + moe.shared_hidden / tensor)
    return matmul, other + 2 * 2 * d


def context_parallel_floats(cfg: ModelConfig, mixer: str, tensor: int, shards: int,
                            seq_len: int):
    """What a token mixer holds per row beyond its own T / P tokens under context parallelism
    over P = `shards` devices (1: nothing), in units of the compute dtype: (matmul outputs,
    everything else).

    Gated MLA (`models.attention.gathered_latent_attention`): the other shards' T - T / P latents
    [c_kv ; k_r], their keys and values up-projected by W_kvb (a matmul), the keys with the
    rotary part broadcast to every head and the values padded to the query width (cuDNN's one
    head size), every shard's segment ids (int32) and the bool mask [T / P, T].
    KDA (`kda.context_parallel`): the op's second run on this shard's tokens (zero values of
    width K from the identity: its output R [T / P, HV, K] and float32 chunk states), every
    shard's state map [P, HV, K, K + V] and entering state [P, HV, K, V] in float32, and the
    short convolution's halo (the previous shard's last conv_size - 1 inputs).
    """
    if shards == 1:
        return 0.0, 0.0
    local = seq_len // shards
    if mixer == "mla":
        mla = cfg.mla
        heads = mla.num_heads / tensor
        keys = seq_len - local
        matmul = keys * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        other = keys * (mla.latent_dim + heads * (mla.qk_head_dim
                                                  + max(mla.qk_head_dim, mla.v_head_dim)))
        return matmul, other + (4 * seq_len + local * seq_len) / cfg.compute_dtype.itemsize
    kda = cfg.kda
    heads, width = kda.num_value_heads / tensor, kda.head_dim
    f32 = 4 / cfg.compute_dtype.itemsize
    second_run = local * (heads * width + _kda_op_floats(cfg, tensor))
    maps = shards * heads * (width * (width + width) + width * width) * f32
    halo = (kda.conv_size - 1) * kda.qkv_dim / tensor
    return 0.0, second_run + maps + halo


def residual_bytes(fn, floats, others=()) -> float:
    """Bytes that `fn(*floats, *others)`'s forward pass saves for its backward pass with respect
    to `floats` (JAX's residuals of `jax.vjp`), traced on shapes (`jax.ShapeDtypeStruct`s:
    nothing is allocated or run); the arguments themselves are not counted (their owner holds
    them anyway), a residual saved twice is counted once."""

    def residuals(floats, others):
        return jax.tree.leaves(jax.vjp(lambda *args: fn(*args, *others), *floats)[1])

    closed = jax.make_jaxpr(residuals)(tuple(floats), tuple(others))
    arguments = set(map(id, closed.jaxpr.invars))
    saved = {id(var): var.aval for var in closed.jaxpr.outvars
             if isinstance(var, jax.extend.core.Var) and id(var) not in arguments}
    return sum(aval.size * aval.dtype.itemsize for aval in saved.values())


def xla_kda_op_bytes(cfg: ModelConfig, tensor: int, rows: int, positions: int,
                     value_width: int) -> float:
    """Bytes the chunked KDA op (`kda.chunked`, XLA's implementation) keeps for the backward
    pass on [rows, positions] tokens of packed documents with values of `value_width`: its
    residuals, traced. Heads are divided by the tensor axis size."""
    kda = cfg.kda
    heads, value_heads = -(-kda.num_heads // tensor), -(-kda.num_value_heads // tensor)
    tokens = (rows, positions)
    floats = (jax.ShapeDtypeStruct((*tokens, heads, kda.head_dim), cfg.compute_dtype),) * 2 + (
        jax.ShapeDtypeStruct((*tokens, value_heads, value_width), cfg.compute_dtype),
        jax.ShapeDtypeStruct((*tokens, value_heads, kda.head_dim), jnp.float32),
        jax.ShapeDtypeStruct((*tokens, value_heads), jnp.float32))
    bound = kda.gate_lower_bound if kda.gate == "lower_bound" else None

    def op(q, k, v, g, beta, segment_ids):
        return kda_attention(q, k, v, g, beta, segment_ids=segment_ids, use_qk_l2norm=True,
                             gate_lower_bound=bound, impl="chunked")[0]

    return residual_bytes(op, floats, (jax.ShapeDtypeStruct(tokens, jnp.int32),))


def xla_attention_bytes(cfg: ModelConfig, tensor: int, rows: int, queries: int,
                        keys: int) -> float:
    """Bytes XLA's dense attention (`jax.nn.dot_product_attention`, implementation "xla": the
    [queries, keys] scores materialised) keeps for the backward pass for `queries` queries of a
    row against `keys` keys under a bool mask: its residuals, traced (q, k and v padded to one
    head size, as Gated MLA calls it)."""
    mla = cfg.mla
    heads = -(-mla.num_heads // tensor)
    width = max(mla.qk_head_dim, mla.v_head_dim)
    q = jax.ShapeDtypeStruct((rows, queries, heads, width), cfg.compute_dtype)
    kv = jax.ShapeDtypeStruct((rows, keys, heads, width), cfg.compute_dtype)

    def attend(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=mla.softmax_scale,
                                            implementation="xla")

    mask = jax.ShapeDtypeStruct((rows, 1, queries, keys), jnp.bool_)
    return residual_bytes(attend, (q, kv, kv), (mask,))


def _xla_core_bytes(cfg: ModelConfig, mixer: str, tensor: int, rows: int, seq_len: int,
                    shards: int) -> float:
    """What XLA's implementation of a token mixer's core keeps beyond the GPU kernels' estimate,
    in bytes per device: the chunked KDA op's residuals in place of the kernels' chunk states
    (twice under context parallelism: the op's second run has values of width K), or dense
    attention's (its [T / P, T] scores) in place of cuDNN's softmax statistics."""
    local = seq_len // shards
    if mixer == "kda":
        runs = 1 if shards == 1 else 2
        kernels_floats = runs * local * rows * _kda_op_floats(cfg, tensor)
        xla = runs * xla_kda_op_bytes(cfg, tensor, rows, local, cfg.kda.head_dim)
    else:
        kernels_floats = local * rows * 2 * cfg.mla.num_heads / tensor
        xla = xla_attention_bytes(cfg, tensor, rows, local, seq_len)
    return xla - kernels_floats * cfg.compute_dtype.itemsize


def _recomputed_layer_bytes(cfg: ModelConfig, mixer: str, ffn: str, tensor: int, rows: int,
                            seq_len: int, shards: int, core_bytes: float = 0.0) -> float:
    """Bytes one layer's recomputation holds in the backward pass under `full` or `offload`: its
    activations for the positions it works on at once (KDA's `segment_tokens`, the MoE's
    `token_chunk`, else the device's T / P), what context parallelism adds to its mixer, and
    `core_bytes` (`_xla_core_bytes`, for XLA's implementations)."""
    local = seq_len // shards
    mixer_positions = min(local, (mixer == "kda" and cfg.kda.segment_tokens) or local)
    ffn_positions = min(local, (ffn == "moe" and cfg.moe.token_chunk) or local)
    floats = (mixer_positions * sum(_mixer_activation_floats(cfg, mixer, tensor))
              + ffn_positions * sum(_ffn_activation_floats(cfg, ffn, tensor))
              + sum(context_parallel_floats(cfg, mixer, tensor, shards, seq_len)))
    return rows * floats * cfg.compute_dtype.itemsize + core_bytes


def estimate_activation_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rows: int,
                              seq_len: int, loss_chunk_tokens: int | None = None,
                              kernels: bool = True) -> tuple[float, float]:
    """(device bytes, pinned host bytes) of the activations kept for the backward pass of `rows`
    rows of `seq_len` tokens on each device, T / P of them on each device of a `seq` axis of P
    (see the module docstring); the host holds the layer inputs under `offload`.
    loss_chunk_tokens: the LM head's and loss's positions at once (`train.loop.TrainConfig`;
    None: all of them). kernels: the token mixers' cores run as GPU kernels (else as XLA's
    implementations, `_xla_core_bytes`)."""
    tensor, shards = sizes.get("tensor", 1), sizes.get("seq", 1)
    local = seq_len // shards
    kinds = list(zip(cfg.mixer_kinds, cfg.ffn_kinds))
    # Per layer (matmul outputs, everything else), per row: its T / P tokens' and what context
    # parallelism adds.
    per_layer = [tuple(local * (m + f) + c for m, f, c in zip(
        _mixer_activation_floats(cfg, mixer, tensor), _ffn_activation_floats(cfg, ffn, tensor),
        context_parallel_floats(cfg, mixer, tensor, shards, seq_len))) for mixer, ffn in kinds]
    tokens = rows * local
    itemsize = cfg.compute_dtype.itemsize
    core = {mixer: 0.0 if kernels else _xla_core_bytes(cfg, mixer, tensor, rows, seq_len, shards)
            for mixer in set(cfg.mixer_kinds)}
    inputs = cfg.num_layers * cfg.d_model  # each layer's input, kept unless recomputed
    recomputed, host = 0.0, 0.0
    # XLA's cores are kept whole under every policy but `full` and `offload` (an upper bound for
    # the `dots` policies, which keep only their matmuls).
    cores = sum(core[mixer] for mixer in cfg.mixer_kinds)
    if cfg.remat == "none":
        kept = sum(m + o for m, o in per_layer)
    elif cfg.remat in ("dots", "dots_no_batch"):
        kept = sum(m for m, _ in per_layer) + local * inputs
    elif cfg.remat == "dots_kernels":
        kept = (sum(m for m, _ in per_layer) + local * inputs
                + local * sum(_mixer_kernel_floats(cfg, mixer, tensor)
                              for mixer in cfg.mixer_kinds))
    else:  # "full" and "offload": each layer keeps its input; one layer at a time is recomputed
        kept = local * inputs if cfg.remat == "full" else 0
        host = tokens * inputs * itemsize if cfg.remat == "offload" else 0.0
        recomputed = max(_recomputed_layer_bytes(cfg, mixer, ffn, tensor, rows, seq_len, shards,
                                                 core[mixer]) for mixer, ffn in kinds)
        cores = 0.0
    snapshots = (num_seal_slots(2 * cfg.num_layers, cfg.seal_period) + 1) * cfg.d_model
    per_row = kept + local * (snapshots + cfg.d_model)  # and the embedding output
    logit_positions = rows * min(local, loss_chunk_tokens or local)
    logits_bytes = logit_positions * 2 * 4 * cfg.vocab_size / tensor  # float32, and gradient
    return rows * per_row * itemsize + cores + recomputed + logits_bytes, host


def router_stats_bytes(cfg: ModelConfig, tokens: int) -> float:
    """Bytes of every MoE layer's `moe.routing.RouterStats` for `tokens` tokens per device:
    float32 scores [E], int32 expert ids and bool copy mask [slots], a bool token mask per token.
    The step holds them from the forward pass until the router-bias update."""
    moe = cfg.moe
    per_token = 4 * moe.num_experts + 5 * moe.slots_per_token + 1
    return cfg.ffn_kinds.count("moe") * tokens * per_token


def plan_memory(
    cfg: ModelConfig,
    mesh: Mapping[str, int] | jax.sharding.Mesh | jax.sharding.AbstractMesh,
    *,
    batch_size: int,
    seq_len: int,
    optimizer_moments: int = 2,
    moment_dtype: jnp.dtype = jnp.float32,
    loss_chunk_tokens: int | None = None,
    kernels: bool = True,
    top: int = 5,
) -> MemoryPlan:
    """Per-device memory of training `cfg` on `mesh` ({axis: size}, or a mesh), AdamW-style,
    on batches [batch_size, seq_len].

    optimizer_moments: float arrays the optimizer keeps per parameter (AdamW: 2, SGD-momentum: 1).
    loss_chunk_tokens: `train.loop.TrainConfig.loss_chunk_tokens` (None: the full logits).
    kernels: the token mixers' cores run as GPU kernels (Pallas KDA, cuDNN flash attention);
      False: as XLA's implementations (what a CPU runs: the chunked KDA op, dense attention),
      whose residuals are traced at the device's shapes (`_xla_core_bytes`).
    """
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh axes must be among {MESH_AXES}, got {sorted(unknown)}")
    seq_shards = sizes.get("seq", 1)
    if seq_len % seq_shards or seq_len // seq_shards < cfg.kda.conv_size - 1:
        raise ValueError(
            f"the seq mesh axis of {seq_shards} devices must split seq_len={seq_len} into equal "
            f"shards of at least {cfg.kda.conv_size - 1} tokens (the short convolution's halo): "
            f"choose a length that divides by it")
    planning_mesh = abstract_mesh(**sizes)
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    stacked = {str(i) for i, group in enumerate(model.plan) if group.repeats > 1}

    def local_elements(variable: nnx.Variable, gathered: bool = False) -> float:
        names = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
        if gathered:
            names = tuple(None if name in GATHERED_AXES else name for name in names)
        spec = logical_to_mesh(names, variable.shape, planning_mesh)
        return math.prod(variable.shape) / _shard_factor(spec, sizes)

    def leaves(state):
        return jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]

    params_bytes, other_bytes, shards, num_params = 0.0, 0.0, [], 0
    gathered_by_unit: dict[tuple, float] = {}
    for path, variable in leaves(nnx.state(model)):
        local = local_elements(variable) * variable.dtype.itemsize
        if not isinstance(variable, nnx.Param):
            other_bytes += local
            continue
        params_bytes += local
        num_params += math.prod(variable.shape)
        shards.append((jax.tree_util.keystr(path), local))
        keys = tuple(str(getattr(part, "key", getattr(part, "idx", part))) for part in path)
        unit = keys[:4] if keys[0] == "groups" else keys[:1]
        layers = variable.shape[0] if keys[0] == "groups" and keys[1] in stacked else 1
        whole = local_elements(variable, gathered=True)
        if whole > local_elements(variable):  # split over fsdp or expert at rest: gathered
            gathered_by_unit[unit] = gathered_by_unit.get(unit, 0.0) + whole / layers
    copies_bytes = sum(
        local_elements(param) * module.dtype.itemsize
        for _, module in nnx.iter_modules(model) if isinstance(module, StableLatentMoE)
        for param in module.kernel_weights().values()
        if jnp.dtype(param.dtype).itemsize > jnp.dtype(module.dtype).itemsize)
    rows = rows_per_device(batch_size, planning_mesh)
    tokens = rows * seq_len // seq_shards
    # A gathered weight in the compute dtype, and its gradient in float32 before the
    # reduce-scatter, for the largest layer (one layer's weights are gathered at a time).
    gathered = max(gathered_by_unit.values(), default=0.0) * (
        cfg.compute_dtype.itemsize + cfg.parameter_dtype.itemsize)
    local_params = params_bytes / cfg.parameter_dtype.itemsize
    activations, host_offload = estimate_activation_bytes(cfg, sizes, rows, seq_len,
                                                          loss_chunk_tokens, kernels)
    return MemoryPlan(
        mesh={name: sizes.get(name, 1) for name in MESH_AXES},
        batch_size=batch_size,
        seq_len=seq_len,
        rows_per_device=rows,
        remat=cfg.remat,
        num_params=num_params,
        params=params_bytes,
        optimizer=optimizer_moments * local_params * jnp.dtype(moment_dtype).itemsize,
        compute_copies=copies_bytes,
        other_state=other_bytes,
        batch=tokens * BATCH_BYTES_PER_TOKEN,
        gradients=params_bytes,
        activations=activations,
        host_offload=host_offload,
        router_stats=router_stats_bytes(cfg, tokens),
        gathered_weights=gathered,
        largest=tuple(sorted(shards, key=lambda s: -s[1])[:top]),
    )


def print_memory_plan(cfg: ModelConfig, mesh, *, batch_size: int, seq_len: int,
                      device_bytes: float = H200_BYTES, **kwargs) -> MemoryPlan:
    """Prints `plan_memory(...).report()` and returns the plan."""
    plan = plan_memory(cfg, mesh, batch_size=batch_size, seq_len=seq_len, **kwargs)
    print(plan.report(device_bytes))
    return plan


def _parse_mesh(text: str) -> dict[str, int]:
    """{axis: size} of "fsdp=64,expert=16"; raises ValueError for an unknown or repeated axis or a
    size that is not a positive int."""
    sizes = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh takes axis=size pairs over {MESH_AXES} with sizes >= 1, got {item!r}"
            )
        if name in sizes:
            raise ValueError(f"--mesh names axis {name!r} twice; give each axis once")
        sizes[name] = int(size)
    return sizes


def fitting_plans(cfg: ModelConfig, devices: int, seq_len: int, *, expert: int,
                  tensor: int = 1, device_bytes: float = H200_BYTES, **kwargs):
    """Plans of `cfg` on `devices` devices at one row of `seq_len` tokens per data-like group
    (batch = devices / (seq x tensor) rows), the mesh expert=`expert`, tensor=`tensor`, seq=P,
    fsdp = the rest, for P = 1, 2, 4, ... while fsdp >= 1: every plan up to the first that fits
    `device_bytes`, which is the last (or all of them, when none fits). kwargs: `plan_memory`'s.
    """
    plans, shards = [], 1
    while devices % (shards * expert * tensor) == 0 and seq_len % shards == 0:
        mesh = dict(fsdp=devices // (expert * tensor * shards), expert=expert, seq=shards,
                    tensor=tensor)
        plans.append(plan_memory(cfg, mesh, batch_size=devices // (tensor * shards),
                                 seq_len=seq_len, **kwargs))
        if plans[-1].total <= device_bytes:
            break
        shards *= 2
    return plans


def format_plan_table(cfg: ModelConfig, device_counts, lengths, *, expert: int, tensor: int = 1,
                      device_bytes: float = H200_BYTES, **kwargs) -> str:
    """A markdown table: for each device count and sequence length, the plan without context
    parallelism and the one of `fitting_plans` with the smallest seq axis that fits (or, when
    none fits, the smallest total), each plan's parts in GiB per device."""
    header = ("| devices | tokens a row | mesh (fsdp x expert x seq x tensor) | batch | tokens a "
              "step | arguments | gradients | activations | router stats | gathered | total GiB "
              "| fits |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for devices in device_counts:
        for seq_len in lengths:
            plans = fitting_plans(cfg, devices, seq_len, expert=expert, tensor=tensor,
                                  device_bytes=device_bytes, **kwargs)
            best = min(plans, key=lambda plan: plan.total)
            for plan in [plans[0]] + ([best] if best is not plans[0] else []):
                mesh = plan.mesh
                cells = [devices, format_count(seq_len),
                         " x ".join(str(mesh[axis])
                                    for axis in ("fsdp", "expert", "seq", "tensor")),
                         plan.batch_size,
                         format_count(plan.batch_size * seq_len),
                         *(f"{bytes_ / GIB:.1f}" for bytes_ in (
                             plan.arguments, plan.gradients, plan.activations,
                             plan.router_stats, plan.gathered_weights, plan.total)),
                         "yes" if plan.total <= device_bytes else "no"]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    """An argparse type: the int of `text`, which must be >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return int(text)


def _int_list(text: str) -> list[int]:
    """An argparse type: the positive ints of "1024,4096"."""
    return [_positive_int(item) for item in text.split(",")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3", choices=sorted(PRESETS))
    parser.add_argument("--mesh", default="fsdp=64,expert=16",
                        help="axis=size pairs over data, fsdp, expert, seq, tensor")
    parser.add_argument("--batch", type=_positive_int, default=1024, help="sequences per step")
    parser.add_argument("--seq", type=_positive_int, default=8192, help="tokens per sequence")
    parser.add_argument("--remat", default="full", choices=REMAT_POLICIES)
    parser.add_argument("--loss-chunk", type=_positive_int, metavar="TOKENS",
                        help="positions of the LM head and loss at once (default: all)")
    parser.add_argument("--table", action="store_true",
                        help="instead of one plan: a markdown table over --devices and "
                        "--lengths, the seq axis doubled until the plan fits an H200 "
                        "(`fitting_plans`; --mesh and --batch unused)")
    parser.add_argument("--devices", type=_int_list, default=[1024, 4096],
                        help="--table: device counts, comma-separated")
    parser.add_argument("--lengths", type=_int_list, default=[8192, 65536, 262144, 1048576],
                        help="--table: tokens per sequence, comma-separated")
    parser.add_argument("--expert", type=_positive_int, default=16,
                        help="--table: the expert axis (fsdp takes the devices seq leaves)")
    parser.add_argument("--tensor", type=_positive_int, default=1, help="--table: the tensor axis")
    args = parser.parse_args(argv)
    try:
        mesh = _parse_mesh(args.mesh)
    except ValueError as error:
        parser.error(str(error))
    cfg = preset(args.preset, remat=args.remat, scan_layers=True)
    print(f"{args.preset}: {format_count(count_params(cfg)['total'])} parameters, "
          f"{format_count(count_params(cfg)['active'])} active per token")
    if args.table:
        print(format_plan_table(cfg, args.devices, args.lengths, expert=args.expert,
                                tensor=args.tensor, loss_chunk_tokens=args.loss_chunk))
        return
    try:
        plan = plan_memory(cfg, mesh, batch_size=args.batch, seq_len=args.seq,
                           loss_chunk_tokens=args.loss_chunk)
    except ValueError as error:  # a seq axis that does not split --seq
        parser.error(str(error))
    print(plan.report())


if __name__ == "__main__":
    main()
