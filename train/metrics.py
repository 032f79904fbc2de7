"""Run records: JSONL metrics, PNG plots, and model FLOPs for tokens/s and MFU.

Metrics are one JSON object per line in `metrics.jsonl`: training rows carry `step` and `loss`
(plus grad_norm, learning_rate, max_vio per MoE layer, ...), evaluation rows carry `step` and
`val_bits_per_byte`. `plot_metrics` turns the file into loss.png, max_vio.png and grad_norm.png.
Non-finite numbers are written as NaN / Infinity / -Infinity (Python's JSON extension, also read
by pandas and JSON5), so they read back as floats. A last line without its newline that does not
parse (a write cut short by a kill) is dropped with a warning; any other unreadable line, and any
unreadable run file read with `read_json`, is an error that names the file and the line.

Model FLOPs (`train_flops_per_token`) count what the model must compute, whatever the kernels do,
in the MaxText convention: 2 FLOPs per multiply-add, training = 3x forward (forward, input
gradients, weight gradients), causal attention counted at half the full square. MFU divides the
achieved model FLOP/s by the accelerator's dense bf16 peak (989 TFLOP/s for an H100/H200).
"""

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence

import jax

from models.config import ModelConfig, count_params

# Dense bf16 peak of an H100 / H200 SXM (datasheet), the denominator of MFU.
HOPPER_PEAK_FLOPS = 989e12
# Training FLOPs are this many times the forward FLOPs (forward, input grads, weight grads).
TRAIN_FLOPS_PER_FORWARD = 3
# KDA's chunked scan works on chunks of this many tokens (kda.chunked.CHUNK_SIZE).
KDA_CHUNK = 64


def kda_recurrence_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the KDA recurrences of all KDA layers (projections excluded).

    Per value head with K = V = head_dim and chunk C: the intra-chunk products (q k^T and k k^T
    within a chunk, the triangular solve's products, w and u) cost about 2·C·(3K + V), and the
    state read, correction and update cost 3 · 2·K·V.
    """
    head_dim, chunk = cfg.kda.head_dim, KDA_CHUNK
    per_head = 2 * chunk * (3 * head_dim + head_dim) + 6 * head_dim * head_dim
    return len(cfg.kda_layers) * cfg.kda.num_value_heads * per_head


def attention_score_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the MLA score and value products (causal: half of T keys)."""
    mla = cfg.mla
    per_key = 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    return len(cfg.full_attn_layers) * per_key * seq_len / 2


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token by part: kda (projections + recurrence), attention (MLA
    projections + scores), moe (active experts, shared expert, latent projections, router) and
    rest (dense FFNs, LM head, AttnRes, norms); and their total."""
    params = count_params(cfg)
    forward = dict(
        kda=2 * params["kda"] + kda_recurrence_flops(cfg),
        attention=2 * params["mla"] + attention_score_flops(cfg, seq_len),
        moe=2 * params["moe_active"],
        rest=2 * (params["dense_ffn"] + params["lm_head"] + params["attn_res"] + params["norms"]),
    )
    parts = {name: TRAIN_FLOPS_PER_FORWARD * value for name, value in forward.items()}
    return {**parts, "total": sum(parts.values())}


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
    """The dense bf16 peak MFU is measured against, or None where none is defined (CPUs)."""
    device = device or jax.devices()[0]
    kind = device.device_kind
    if device.platform == "gpu" and ("H100" in kind or "H200" in kind):
        return HOPPER_PEAK_FLOPS
    return None


class MetricsWriter:
    """Appends metric rows to a JSONL file (one object per line), flushing each write."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, rows: Iterable[dict]) -> None:
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(_plain(row)) + "\n")


def _plain(value):
    """JSON-able copy: numpy/jax scalars and arrays become numbers and lists."""
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    return value


def _decode(text: bytes, path: str, line: int | None = None):
    """The JSON value in `text`, the contents of `path` (or its JSONL line number `line`).

    Raises ValueError naming the file, the line and the column, for invalid JSON or UTF-8.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        row, column, reason = error.lineno, error.colno, f"invalid JSON: {error.msg}"
    except UnicodeDecodeError as error:
        before = text[: error.start]
        row, column = before.count(b"\n") + 1, error.start - before.rfind(b"\n")
        reason = "not UTF-8 text"
    raise ValueError(
        f"{path}, line {row if line is None else line}, column {column}: {reason}; repair the "
        "file or move it away"
    )


def read_json(path: str):
    """The JSON value in the run file at `path` (config.json, data_manifest.json, ...).

    Raises ValueError naming the file and the line where it is not valid JSON or UTF-8.
    """
    with open(path, "rb") as f:
        return _decode(f.read(), path)


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics JSONL file, dropping (with a warning) a torn last line: one without
    its newline that does not parse, left by a kill during a write.

    Raises ValueError naming the file and the line for any other line that is not a JSON object.
    """
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")  # the last item is b"" unless the last line is torn
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = _decode(line, path, number)
        except ValueError:
            if number < len(lines):
                raise
            warnings.warn(f"{path}: dropping line {number}, a row cut short by an interrupted "
                          "write (no newline, not valid JSON)", stacklevel=2)
            break
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}, line {number}: expected a JSON object (one metrics row), got "
                f"{type(row).__name__}; repair the file or move it away"
            )
        rows.append(row)
    return rows


def _plottable(value) -> bool:
    return isinstance(value, list) or (
        isinstance(value, (int, float)) and math.isfinite(value))


def _series(rows: Sequence[dict], key: str) -> tuple[list[int], list]:
    # A plot skips rows without the key and non-finite values.
    picked = [(row["step"], row[key]) for row in rows if _plottable(row.get(key))]
    return [step for step, _ in picked], [value for _, value in picked]


def plot_metrics(path: str, out_dir: str) -> list[str]:
    """Writes loss.png (training loss and validation bits per byte), max_vio.png (per MoE layer)
    and grad_norm.png from the metrics file at `path`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    written = []

    def save(figure, name):
        figure.tight_layout()
        figure.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(figure)
        written.append(os.path.join(out_dir, name))

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    steps, loss = _series(rows, "loss")
    loss_axis.plot(steps, [value / math.log(2) for value in loss], lw=1, label="train (bits/byte)")
    steps, val = _series(rows, "val_bits_per_byte")
    loss_axis.plot(steps, val, "o-", label="validation (bits/byte)")
    loss_axis.set(xlabel="step", ylabel="bits per byte", title="loss")
    loss_axis.legend()
    save(figure, "loss.png")

    figure, axis = plt.subplots(figsize=(7, 4))
    steps, max_vio = _series(rows, "max_vio")
    for layer in range(len(max_vio[0]) if max_vio else 0):
        axis.plot(steps, [values[layer] for values in max_vio], lw=1, label=f"MoE layer {layer}")
    axis.set(xlabel="step", ylabel="MaxVio", title="expert load imbalance (MaxVio) per MoE layer")
    if max_vio and max_vio[0]:
        axis.legend(fontsize="small")
    save(figure, "max_vio.png")

    figure, axis = plt.subplots(figsize=(7, 4))
    steps, grad_norm = _series(rows, "grad_norm")
    axis.plot(steps, grad_norm, lw=1)
    axis.set(xlabel="step", ylabel="global gradient norm", yscale="log", title="gradient norm")
    save(figure, "grad_norm.png")
    return written
