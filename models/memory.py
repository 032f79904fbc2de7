"""Per-device memory of a training step, planned without allocating anything.

    plan = print_memory_plan(preset("k3"), {"fsdp": 64, "expert": 16}, batch_size=1024,
                             seq_len=8192)

or from the shell:

    python -m models.memory --preset k3 --mesh fsdp=64,expert=16 --batch 1024 --seq 8192

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
reported apart from the device's total). XLA's real peak adds fusion temporaries and collective
buffers; `tests/models/test_memory.py` checks the plan against XLA's memory analysis of the
compiled step and states the tolerances.
"""

import argparse
import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from core.sharding import MESH_AXES, abstract_mesh, describe_mesh, logical_to_mesh
from kda.chunked import CHUNK_SIZE
from models.attn_res import num_seal_slots
from models.config import PRESETS, REMAT_POLICIES, ModelConfig, count_params, format_count, preset
from models.lm import HybridLM
from moe.experts import StableLatentMoE

H200_BYTES = 141e9
GIB = 2**30
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
        # the float32 chunk states of the chunked algorithm (one K x V state per 64 tokens).
        other = (2 * kda.qkv_dim + 2 * keys + 3 * keys
                 + 2 * kda.num_value_heads * kda.head_dim * kda.head_dim / 64) / tensor
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


def _recomputed_layer_bytes(cfg: ModelConfig, mixer: str, ffn: str, tensor: int, rows: int,
                            seq_len: int) -> float:
    """Bytes one layer's recomputation holds in the backward pass under `full` or `offload`: its
    activations for the positions it works on at once (KDA's `segment_tokens`, the MoE's
    `token_chunk`, else the whole row)."""
    mixer_positions = min(seq_len, (mixer == "kda" and cfg.kda.segment_tokens) or seq_len)
    ffn_positions = min(seq_len, (ffn == "moe" and cfg.moe.token_chunk) or seq_len)
    floats = (mixer_positions * sum(_mixer_activation_floats(cfg, mixer, tensor))
              + ffn_positions * sum(_ffn_activation_floats(cfg, ffn, tensor)))
    return rows * floats * cfg.compute_dtype.itemsize


def estimate_activation_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rows: int,
                              seq_len: int, loss_chunk_tokens: int | None = None
                              ) -> tuple[float, float]:
    """(device bytes, pinned host bytes) of the activations kept for the backward pass of `rows`
    rows of `seq_len` tokens on each device (see the module docstring); the host holds the
    layer inputs under `offload`. loss_chunk_tokens: the LM head's and loss's positions at once
    (`train.loop.TrainConfig`; None: all of them)."""
    tensor = sizes.get("tensor", 1)
    kinds = list(zip(cfg.mixer_kinds, cfg.ffn_kinds))
    per_layer = [tuple(map(sum, zip(_mixer_activation_floats(cfg, mixer, tensor),
                                    _ffn_activation_floats(cfg, ffn, tensor))))
                 for mixer, ffn in kinds]
    tokens = rows * seq_len
    itemsize = cfg.compute_dtype.itemsize
    inputs = cfg.num_layers * cfg.d_model  # each layer's input, kept unless recomputed
    recomputed, host = 0.0, 0.0
    if cfg.remat == "none":
        kept = sum(m + o for m, o in per_layer)
    elif cfg.remat in ("dots", "dots_no_batch"):
        kept = sum(m for m, _ in per_layer) + inputs
    elif cfg.remat == "dots_kernels":
        kept = (sum(m for m, _ in per_layer) + inputs
                + sum(_mixer_kernel_floats(cfg, mixer, tensor) for mixer in cfg.mixer_kinds))
    else:  # "full" and "offload": each layer keeps its input; one layer at a time is recomputed
        kept = inputs if cfg.remat == "full" else 0
        host = tokens * inputs * itemsize if cfg.remat == "offload" else 0.0
        recomputed = max(_recomputed_layer_bytes(cfg, mixer, ffn, tensor, rows, seq_len)
                         for mixer, ffn in kinds)
    snapshots = (num_seal_slots(2 * cfg.num_layers, cfg.seal_period) + 1) * cfg.d_model
    floats = kept + snapshots + cfg.d_model  # the embedding output
    logit_positions = rows * min(seq_len, loss_chunk_tokens or seq_len)
    logits_bytes = logit_positions * 2 * 4 * cfg.vocab_size / tensor  # float32, and gradient
    return tokens * floats * itemsize + recomputed + logits_bytes, host


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
    top: int = 5,
) -> MemoryPlan:
    """Per-device memory of training `cfg` on `mesh` ({axis: size}, or a mesh), AdamW-style,
    on batches [batch_size, seq_len].

    optimizer_moments: float arrays the optimizer keeps per parameter (AdamW: 2, SGD-momentum: 1).
    loss_chunk_tokens: `train.loop.TrainConfig.loss_chunk_tokens` (None: the full logits).
    """
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh axes must be among {MESH_AXES}, got {sorted(unknown)}")
    if sizes.get("seq", 1) > 1:
        raise ValueError(f"the planner does not count context parallelism yet: got seq="
                         f"{sizes['seq']}; plan with seq=1")
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
    tokens = rows * seq_len
    # A gathered weight in the compute dtype, and its gradient in float32 before the
    # reduce-scatter, for the largest layer (one layer's weights are gathered at a time).
    gathered = max(gathered_by_unit.values(), default=0.0) * (
        cfg.compute_dtype.itemsize + cfg.parameter_dtype.itemsize)
    local_params = params_bytes / cfg.parameter_dtype.itemsize
    activations, host_offload = estimate_activation_bytes(cfg, sizes, rows, seq_len,
                                                          loss_chunk_tokens)
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


def _positive_int(text: str) -> int:
    """An argparse type: the int of `text`, which must be >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return int(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3", choices=sorted(PRESETS))
    parser.add_argument("--mesh", default="fsdp=64,expert=16",
                        help="axis=size pairs over data, fsdp, expert, tensor")
    parser.add_argument("--batch", type=_positive_int, default=1024, help="sequences per step")
    parser.add_argument("--seq", type=_positive_int, default=8192, help="tokens per sequence")
    parser.add_argument("--remat", default="full", choices=REMAT_POLICIES)
    parser.add_argument("--loss-chunk", type=_positive_int, metavar="TOKENS",
                        help="positions of the LM head and loss at once (default: all)")
    args = parser.parse_args(argv)
    try:
        mesh = _parse_mesh(args.mesh)
    except ValueError as error:
        parser.error(str(error))
    cfg = preset(args.preset, remat=args.remat, scan_layers=True)
    print(f"{args.preset}: {format_count(count_params(cfg)['total'])} parameters, "
          f"{format_count(count_params(cfg)['active'])} active per token")
    print_memory_plan(cfg, mesh, batch_size=args.batch, seq_len=args.seq,
                      loss_chunk_tokens=args.loss_chunk)


if __name__ == "__main__":
    main()
