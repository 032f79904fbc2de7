"""Times Gated MLA's training attention (`models.attention.causal_document_attention`) over packed
documents, implementation by implementation, and writes a markdown table.

    python -m experiments.bench_attention --gpu     # H200: bench_train's shape, bf16
                                                    # -> benchmarks/attention_<card>.md
    python -m experiments.bench_attention --smoke   # tiny float32 CPU run through XLA (the test)

The `--gpu` shape is the `1b` step's (`experiments.bench_train`): [B, T, H] = [4, 4096, 16], q/k
heads of 192, v heads of 128, bf16; the documents of each row are cut at random points, 1, 4
(bench_train's layout) or 16 a row. Contenders: "xla" and "cudnn" (a dense [B, 1, T, T] document
mask; "cudnn" is the baseline of the ratios), "cudnn_segments" at
each `--max-segments` M (cuDNN's packed layout, the `lax.cond` and its dense fallback included:
a layout with more than M documents a row takes the fallback), and the packed call alone
(`packed_cudnn_attention`, no cond, at the largest M) to price the cond (below M = 16 it computes
the 16-document layout wrong, and its error column says so).

Each contender is compiled once (the segment ids are an argument) and timed on every layout:
the forward, then the forward+backward (gradients of sum(out * d_out) in q, k and v), medians
of `--repeats` calls after `--warmup`. Errors are relative L2 against `plain_attention`, the
softmax formula written out here (independent of `models.attention`), in float32 on the same
(bf16-rounded) numbers: the output, and the worst of dq, dk and dv. Model TFLOP/s count only the
causal, within-document score and value products: 2 (Dqk + Dv) FLOPs per (query, key) pair of a
document with the key not after the query, per head; forward+backward 3x the forward
(`train.metrics`' convention).
"""

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

from experiments.harness import (cell, command_line, compiled_once, compiled_peak_mib,
                                 gpu_or_smoke_args, median_seconds, package_version,
                                 relative_error, report_preamble, table_row, timing_cells,
                                 write_markdown)
from models.attention import (
    causal_document_attention,
    document_segments,
    pad_head_dims,
    packed_cudnn_attention,
)
from train.metrics import TRAIN_FLOPS_PER_FORWARD

BASELINE = "cudnn"
# The number of documents a row holds, layout by layout.
DOCUMENTS_PER_ROW = (1, 4, 16)


@dataclasses.dataclass(frozen=True)
class Setup:
    batch: int
    length: int
    heads: int
    qk_dim: int
    v_dim: int
    dtype: str

    def __str__(self):
        return (f"[{self.batch}, {self.length}, {self.heads}], q/k heads of {self.qk_dim}, "
                f"v heads of {self.v_dim}, {self.dtype}")


GPU = Setup(batch=4, length=4096, heads=16, qk_dim=192, v_dim=128, dtype="bfloat16")
SMOKE = Setup(batch=2, length=64, heads=2, qk_dim=24, v_dim=16, dtype="float32")


@dataclasses.dataclass
class Timing:
    forward_ms: float | None = None
    forward_backward_ms: float | None = None
    output_error: float | None = None
    gradient_error: float | None = None
    peak_mib: float | None = None
    note: str = ""


def document_layout(setup: Setup, documents: int, seed: int = 0) -> np.ndarray:
    """segment_ids int32 [B, T]: `documents` documents a row (ids 1, 2, ...), cut at distinct
    random points."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(np.stack([rng.choice(np.arange(1, setup.length), documents - 1, replace=False)
                             for _ in range(setup.batch)]), axis=1)
    return (1 + (np.arange(setup.length)[None, :, None] >= cuts[:, None, :]).sum(-1)).astype(
        np.int32)


def document_layouts(setup: Setup) -> dict[int, np.ndarray]:
    """Each timed layout: documents a row (`DOCUMENTS_PER_ROW`) -> its segment_ids [B, T]."""
    return {documents: document_layout(setup, documents) for documents in DOCUMENTS_PER_ROW}


def document_attention_flops(segment_ids: np.ndarray, heads: int, qk_dim: int,
                             v_dim: int) -> float:
    """Forward FLOPs of the causal, within-document score and value products. Documents are runs
    of equal ids (`models.attention.document_segments`, room for one a token); segment_ids:
    [B, T]."""
    lengths = np.asarray(document_segments(jnp.asarray(segment_ids), segment_ids.shape[1]).lengths,
                         np.int64)
    lengths = lengths[lengths > 0]  # unused slots hold -1
    return 2.0 * (qk_dim + v_dim) * heads * float(np.sum(lengths * (lengths + 1) // 2))


Attention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def implementation(name: str, max_segments: int | None = None) -> Attention:
    """`(q, k, v, segment_ids) -> out` through `causal_document_attention`."""
    def attend(q, k, v, segment_ids):
        return causal_document_attention(q, k, v, scale=q.shape[-1] ** -0.5,
                                         segment_ids=segment_ids, implementation=name,
                                         max_segments=max_segments)
    return attend


def packed_alone(max_segments: int) -> Attention:
    """The packed cuDNN call without the cond and its fallback (every row must fit)."""
    def attend(q, k, v, segment_ids):
        segments = document_segments(segment_ids, max_segments)
        out = packed_cudnn_attention(*pad_head_dims(q, k, v), segments,
                                     scale=q.shape[-1] ** -0.5)
        return out[..., : v.shape[-1]]
    return attend


def contenders(gpu: bool, max_segments: list[int]) -> dict[str, Attention]:
    if not gpu:  # the cuDNN paths run on GPUs only
        return {"xla": implementation("xla")}
    table = {"xla": implementation("xla"), "cudnn": implementation("cudnn")}
    for m in max_segments:
        table[f"cudnn_segments M={m}"] = implementation("cudnn_segments", m)
    table[f"packed call alone M={max(max_segments)}"] = packed_alone(max(max_segments))
    return table


def plain_attention(q, k, v, segment_ids):
    """The oracle: softmax(q k^T / sqrt(Dqk)) v over the keys not after the query with the same
    segment id, as one dense einsum and mask. q, k [B, T, H, Dqk], v [B, T, H, Dv], segment_ids
    [B, T] -> [B, T, H, Dv]."""
    highest = jax.lax.Precision.HIGHEST  # no TF32 rounding in the oracle on a GPU
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=highest) * q.shape[-1] ** -0.5
    length = q.shape[1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    same_document = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(causal & same_document, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=highest)


def gradients(attend: Attention) -> Callable:
    """`(q, k, v, segment_ids, d_out) -> (out, (dq, dk, dv))`, gradients of sum(out * d_out)."""
    def run(q, k, v, segment_ids, d_out):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
        return out, vjp(d_out.astype(out.dtype))
    return run


def make_inputs(setup: Setup, seed: int = 0) -> tuple[jax.Array, ...]:
    """q, k [B, T, H, Dqk], v and d_out [B, T, H, Dv], standard normal, in the setup's dtype."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (setup.batch, setup.length, setup.heads)
    dims = (setup.qk_dim, setup.qk_dim, setup.v_dim, setup.v_dim)
    return tuple(jax.random.normal(key, shape + (dim,), setup.dtype)
                 for key, dim in zip(keys, dims))


def run(setup: Setup, layouts: dict[int, np.ndarray], table: dict[str, Attention], repeats: int,
        warmup: int, on_progress: Callable[[dict], None]) -> dict[tuple[int, str], Timing]:
    """Times every contender on every layout (documents a row -> segment_ids [B, T]); calls
    `on_progress(results)` after each one."""
    inputs = make_inputs(setup)
    exact_inputs = [t.astype(jnp.float32) for t in inputs]
    reference = jax.jit(gradients(plain_attention))
    programs: dict[str, tuple] = {}
    results: dict[tuple[int, str], Timing] = {}
    for documents, layout in layouts.items():
        segment_ids = jnp.asarray(layout)
        q, k, v, d_out = inputs
        want_out, want_grads = reference(*exact_inputs[:3], segment_ids, exact_inputs[3])
        for name, attend in table.items():
            try:  # a contender that fails (an unsupported cuDNN, say) must not stop the run
                if name not in programs:  # compiled once: the layout is an argument
                    programs[name] = (compiled_once(attend, q, k, v, segment_ids),
                                      compiled_once(gradients(attend), q, k, v, segment_ids, d_out))
                forward, backward = programs[name]
                out, grads = backward(q, k, v, segment_ids, d_out)
                timing = Timing(
                    forward_ms=1e3 * median_seconds(lambda: forward(q, k, v, segment_ids),
                                                    repeats, warmup),
                    forward_backward_ms=1e3 * median_seconds(
                        lambda: backward(q, k, v, segment_ids, d_out), repeats, warmup),
                    output_error=relative_error(out, want_out),
                    gradient_error=relative_error(grads, want_grads),
                    peak_mib=compiled_peak_mib(backward))
            except Exception as error:  # noqa: BLE001 (reported in the table's note)
                first_line = (str(error).splitlines() or [""])[0]
                timing = Timing(note=f"{type(error).__name__}: {first_line[:120]}")
                print(f"{documents} a row, {name}: {timing.note}", file=sys.stderr)
            results[(documents, name)] = timing
            print(f"{documents} documents a row, {name}: fwd {cell(timing.forward_ms, '.3f')} "
                  f"ms, fwd+bwd {cell(timing.forward_backward_ms, '.3f')} ms", flush=True)
            on_progress(results)  # the table so far survives a run cut short
    return results


def _cudnn_version() -> str:
    try:
        return str(check_cudnn_version())
    except RuntimeError:  # no cuDNN here (a CPU jaxlib)
        return "none"


def write_table(path: Path, results, setup: Setup, flops: dict[int, float], names: list[str],
                command: str):
    """The table of `run`'s results; flops: documents a row -> forward FLOPs of its layout."""
    lines = report_preamble(
        "Gated MLA training attention over packed documents", command,
        f"jaxlib {package_version('jaxlib')}, cuDNN {_cudnn_version()}") + [
        f"- Shape: {setup}; documents cut at random points (seed 0), 1, 4 or 16 a row.",
        "- Times: medians after warm-up, in milliseconds. fwd+bwd: forward and the gradients in "
        f"q, k and v. 'vs {BASELINE}' = {BASELINE}'s time / this row's (above 1: faster).",
        "- TFLOP/s: model FLOPs of the causal, within-document score and value products only "
        "(2 (Dqk + Dv) a pair a head; fwd+bwd = 3x fwd) over the time.",
        "- Errors: relative L2 against a plain softmax formula (`plain_attention`) in float32 on "
        "the same numbers; grad = the worst of "
        "dq, dk, dv. Memory: arguments, outputs and temporaries of the fwd+bwd (XLA's analysis).",
        "",
        f"| documents a row | implementation | fwd ms | fwd+bwd ms | fwd vs {BASELINE} | "
        f"fwd+bwd vs {BASELINE} | fwd TFLOP/s | fwd+bwd TFLOP/s | out error | grad error | "
        "memory MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for documents, layout_flops in flops.items():
        base = results.get((documents, BASELINE), Timing())
        for name in names:
            t = results.get((documents, name), Timing(note="not run"))
            rate = lambda ms, factor: (None if ms is None  # noqa: E731
                                       else factor * layout_flops / (ms * 1e-3) / 1e12)
            lines.append(table_row(
                str(documents), name, *timing_cells(t, base, ".3f"),
                cell(rate(t.forward_ms, 1), ".3g"),
                cell(rate(t.forward_backward_ms, TRAIN_FLOPS_PER_FORWARD), ".3g"),
                cell(t.output_error, ".1e"), cell(t.gradient_error, ".1e"),
                cell(t.peak_mib, ".0f"), t.note))
    write_markdown(path, lines)


def main(argv=None):
    def max_segments_option(parser):
        parser.add_argument("--max-segments", nargs="+", type=int, default=[4, 16], metavar="M",
                            help="the M of each cudnn_segments contender (default: 4 16)")

    args = gpu_or_smoke_args(argv, __doc__.split("\n\n")[0], "attention",
                             gpu_help="the H200 shape and every implementation",
                             smoke_help="a tiny float32 shape through XLA alone (a CPU check)",
                             add_options=max_segments_option)
    if min(args.max_segments) < 1:
        raise SystemExit(f"--max-segments: each M must be a positive int, got {args.max_segments}")
    setup = GPU if args.gpu else SMOKE
    table = contenders(args.gpu, args.max_segments)
    command = command_line("experiments.bench_attention", argv)
    layouts = document_layouts(setup)
    flops = {documents: document_attention_flops(layout, setup.heads, setup.qk_dim, setup.v_dim)
             for documents, layout in layouts.items()}
    on_progress = ((lambda results: None) if args.out is None else
                   (lambda results: write_table(args.out, results, setup, flops, list(table),
                                                command)))
    results = run(setup, layouts, table, args.repeats, args.warmup, on_progress)
    if args.out is not None:
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
