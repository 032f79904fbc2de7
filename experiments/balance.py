"""Load balancing compared: Quantile Balancing, the sign rule, an auxiliary loss and none.

    python -m experiments.balance                       # CPU, a few minutes
    python -m experiments.balance --steps 400 --out benchmarks

Trains the same tiny byte-level MoE language model (embedding, then per layer a causal token mixer
and a Stable LatentMoE with SiTU-GLU, then a tied read-out) on the same windows of the
interpreter's standard-library sources, from the same seed, once per balancing method. Logs the
MaxVio of every MoE layer at every step (the batch routed with the bias of that step) and writes
`balance_maxvio.png`, `balance_table.md` (steps until MaxVio < 0.2, final MaxVio, final loss) and
`balance_log.json` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from core.norms import rms_norm
from experiments.harness import command_line
from moe.config import BALANCERS, MoEConfig
from moe.experts import StableLatentMoE, update_router_biases
from moe.routing import max_violation, sequence_max_violation
from train.corpus import stdlib_corpus

VOCAB = 256  # bytes
MAXVIO_TARGET = 0.2
SMOOTHING = 10  # steps in the moving average that "steps until MaxVio < 0.2" reads
FINAL_WINDOW = 20  # steps averaged for the "final" columns


@dataclasses.dataclass(frozen=True)
class ModelShape:
    d_model: int = 64
    layers: int = 2
    conv_width: int = 4
    num_experts: int = 8
    top_k: int = 2
    latent_dim: int = 32
    expert_hidden: int = 64
    shared_hidden: int = 64


class CausalMixer(nnx.Module):
    """The model's token mixing: a depthwise causal convolution over the last `width` positions
    plus a learned per-channel weight on the running mean of all earlier positions.

    The running mean gives every token its own long context; with the convolution alone, byte
    runs such as indentation give many tokens identical hidden states, which any token-choice
    router must send to the same experts, whatever the bias.
    """

    def __init__(self, d_model: int, width: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=(width + 1) ** -0.5)
        self.kernel = nnx.Param(init(rngs.params(), (width, d_model)))
        self.mean_weight = nnx.Param(init(rngs.params(), (d_model,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> [B, T, D]; position t sees positions <= t."""
        width, length = self.kernel.shape[0], x.shape[1]
        padded = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
        conv = sum(padded[:, i : i + length] * self.kernel[...][i] for i in range(width))
        running_mean = jnp.cumsum(x, axis=1) / jnp.arange(1, length + 1)[:, None]
        return conv + running_mean * self.mean_weight[...]


class TinyMoELM(nnx.Module):
    """Byte LM: embed -> [x += mix(norm x); x += MoE(norm x)] * layers -> norm -> tied logits."""

    def __init__(self, shape: ModelShape, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (VOCAB, shape.d_model)))
        self.mixers = nnx.List(
            [CausalMixer(shape.d_model, shape.conv_width, rngs=rngs) for _ in range(shape.layers)]
        )
        self.moes = nnx.List(
            [
                StableLatentMoE(shape.d_model, cfg, dtype=jnp.float32, rngs=rngs)
                for _ in range(shape.layers)
            ]
        )
        self.norm_gain = nnx.Param(jnp.ones((shape.d_model,)))

    def __call__(self, tokens: jax.Array):
        """tokens: [B, T] int -> (logits [B, T, VOCAB], per-layer RouterStats)."""
        ones = jnp.ones(self.embed.shape[1])
        x = self.embed[...][tokens]
        stats = []
        for mixer, moe in zip(self.mixers, self.moes):
            x = x + mixer(rms_norm(x, ones, 1e-5))
            y, layer_stats = moe(rms_norm(x, ones, 1e-5))
            x = x + y
            stats.append(layer_stats)
        # Tied read-out, scaled so that unit-RMS features give unit-scale logits.
        logits = rms_norm(x, self.norm_gain[...], 1e-5) @ self.embed[...].T
        return logits * self.embed.shape[1] ** -0.5, stats


def byte_batches(seed: int, batch: int, length: int):
    """Endless random windows of length + 1 bytes of the standard-library corpus."""
    data = stdlib_corpus().data
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, data.size - length - 1, size=batch)
        yield jnp.asarray(np.stack([data[s : s + length + 1] for s in starts]).astype(np.int32))


def train(method: str, args: argparse.Namespace, shape: ModelShape, progress: tqdm) -> dict:
    """Trains one model with `method`; returns its per-step loss and per-layer MaxVio."""
    cfg = MoEConfig(
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        expert_hidden=shape.expert_hidden,
        latent_dim=shape.latent_dim,
        shared_hidden=shape.shared_hidden,
        latent_norm=True,
        balancing=method,
        gmm_backend="xla",
    )
    model = TinyMoELM(shape, cfg, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits, stats = model(tokens[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return ce + sum(s.aux_loss for s in stats), (ce, stats)

        (_, (ce, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        max_vio, seq_vio = (
            jnp.stack([metric(s.expert_ids, cfg.num_experts, s.copy_mask) for s in stats])
            for metric in (max_violation, sequence_max_violation)
        )
        update_router_biases(model.moes, stats)  # after the step, on the stats routed with old bias
        return ce, max_vio, seq_vio

    log = dict(loss=[], max_vio=[], seq_max_vio=[])
    for _, tokens in zip(range(args.steps), byte_batches(args.seed, args.batch, args.seq_len)):
        ce, max_vio, seq_vio = step(model, optimizer, tokens)
        log["loss"].append(float(ce))
        log["max_vio"].append(np.asarray(max_vio).tolist())
        log["seq_max_vio"].append(np.asarray(seq_vio).tolist())
        progress.set_postfix(
            method=method, loss=f"{float(ce):.3f}", maxvio=f"{float(max_vio.max()):.2f}"
        )
        progress.update()
    return log


def summarise(logs: dict[str, dict]) -> list[dict]:
    """Per method: steps until MaxVio < 0.2, final MaxVio per layer, final loss.

    "Steps until" is the first step at which the moving average (over the last SMOOTHING steps)
    of the worst layer's MaxVio is below the target: one lucky batch does not count.
    """
    rows = []
    for method, log in logs.items():
        max_vio = np.asarray(log["max_vio"])  # [steps, layers]
        worst = max_vio.max(axis=1)
        window = min(SMOOTHING, worst.size)
        smoothed = np.convolve(worst, np.ones(window) / window, mode="valid")
        below = np.flatnonzero(smoothed < MAXVIO_TARGET) + window - 1
        rows.append(
            dict(
                method=method,
                steps_to_target=int(below[0]) if below.size else None,
                final_max_vio=max_vio[-FINAL_WINDOW:].mean(axis=0).tolist(),
                final_seq_max_vio=np.asarray(log["seq_max_vio"])[-FINAL_WINDOW:].mean(0).tolist(),
                final_loss=float(np.mean(log["loss"][-FINAL_WINDOW:])),
            )
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, shape: ModelShape, command: str) -> str:
    corpus = stdlib_corpus()
    lines = [
        "# Load balancing: QB vs sign rule vs auxiliary loss vs none",
        "",
        f"Command: `{command}`",
        "",
        f"- model: {shape.layers} layers of causal mixer + Stable LatentMoE (d={shape.d_model}, "
        f"{shape.num_experts} experts, top-{shape.top_k}, latent {shape.latent_dim}, expert "
        f"width {shape.expert_hidden}, shared {shape.shared_hidden}, SiTU-GLU), byte vocabulary",
        f"- data: {corpus.name} (sha256 {corpus.sha256[:16]}), random windows, batch "
        f"{args.batch} x {args.seq_len} tokens, seed {args.seed}, AdamW lr {args.lr}, "
        f"{args.steps} steps; python {platform.python_version()}, jax {jax.__version__}",
        f"- MaxVio = max_j load_j / mean load - 1 of the batch routed with that step's bias; "
        f"'final' = mean of the last {FINAL_WINDOW} steps; sign rule gamma 1e-3, aux-loss "
        "weight 1e-2",
        "",
        f"| method | steps until MaxVio < 0.2 (worst layer, {SMOOTHING}-step mean) | "
        "final MaxVio per layer | "
        "final per-sequence MaxVio per layer | final loss (nats/byte) |",
        "|---|---:|---|---|---:|",
    ]
    for row in rows:
        steps = "never" if row["steps_to_target"] is None else str(row["steps_to_target"])
        vio = ", ".join(f"{v:.3f}" for v in row["final_max_vio"])
        seq_vio = ", ".join(f"{v:.3f}" for v in row["final_seq_max_vio"])
        lines.append(f"| {row['method']} | {steps} | {vio} | {seq_vio} | {row['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(logs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_vio, ax_loss) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (method, log) in zip(colors, logs.items()):
        max_vio = np.asarray(log["max_vio"])
        for layer in range(max_vio.shape[1]):
            ax_vio.plot(
                max_vio[:, layer],
                color=color,
                linestyle=("-", "--", ":", "-.")[layer % 4],
                label=f"{method}, layer {layer}",
            )
        ax_loss.plot(log["loss"], color=color, label=method)
    ax_vio.axhline(MAXVIO_TARGET, color="gray", linewidth=0.8)
    ax_vio.set_yscale("log")
    ax_vio.set_ylabel("batch MaxVio")
    ax_vio.legend(fontsize=7, ncol=2)
    ax_loss.set_ylabel("cross-entropy (nats/byte)")
    ax_loss.set_xlabel("step")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.balance",
        description="Train one tiny MoE LM per balancing method; plot and tabulate MaxVio.",
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps per method")
    parser.add_argument("--out", default="runs/balance", help="folder for the plot, table, log")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["qb", "sign", "aux_loss", "none"],
        choices=BALANCERS,
        help="balancing methods to compare",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2:
        parser.error("--steps and --batch must be >= 1 and --seq-len >= 2")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    shape = ModelShape()
    os.makedirs(args.out, exist_ok=True)
    logs = {}
    with tqdm(total=args.steps * len(args.methods), desc="balance", unit="step") as progress:
        for method in args.methods:
            logs[method] = train(method, args, shape, progress)
    rows = summarise(logs)
    command = command_line("experiments.balance", argv)
    table = markdown(rows, args, shape, command)
    with open(os.path.join(args.out, "balance_table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "balance_log.json"), "w") as f:
        json.dump(dict(args=vars(args), logs=logs, summary=rows), f)
    plot(logs, os.path.join(args.out, "balance_maxvio.png"))
    print(table)
    return rows


if __name__ == "__main__":
    main()
