"""Benchmark of native vision on one GPU: the K3 vision tower (`models.vision`) by image size and
attention path, and the `1b` training step with images against text only.

    python -m experiments.bench_vision --gpu     # K3 tower and the 1b step, bf16, under 4 minutes
                                                 # on an H200 -> benchmarks/vision_<card>.md
                                                 # (+ .json)
    python -m experiments.bench_vision --smoke   # a tiny tower and the `tiny` step on CPU (the test)
    python -m experiments.bench_vision --gpu --parts tower    # the tower's table alone

Tower: the `k3` preset's VisionConfig (27 blocks of width 1024, 12 heads of 128, MLP 4096), bf16
compute on float32 parameters, blocks scanned (one compiled body), no recomputation. Workloads
(`GPU.workloads`): 16 images of 448x448 (32 x 32 patches of 14 pixels), one a row; 4 of 896x672;
2 of 1344x1344; and a mixed packed batch, 9 images of 9 sizes in 2 rows of 8192 patch slots
(`models.vision.pack_images`). Each through both attention paths (`VisionConfig.implementation`):
"cudnn", a dense [R, 1, P, P] mask, and "cudnn_segments", cuDNN's packed layout over each row's
images. Forward: the tower's features; forward+backward: the gradients of mean(features^2) in
every parameter. Times are medians of --repeats calls after --warmup, each waited for
(`median_seconds`); one compile per workload, path and direction (16 in all).

images/s and patches/s count the images and their patches, not the padding slots. MFU = model
FLOPs / time / the device's dense bf16 peak (`train.metrics.peak_flops_per_device`: 989 TFLOP/s on
an H100 or H200; none on a CPU). Model FLOPs are counted analytically (`tower_flops`): an image of
n patches costs 2 n (p^2 C D + L (4 D Q + 2 D F)) in its matmuls (the patch embedding; per block
the q, k, v and output projections of width Q = heads x head_dim and the MLP of width F) and
L 4 n^2 Q in attention (scores and weighted values over every pair of its patches: bidirectional);
norms, RoPE and the interpolated positions are left out; forward+backward is 3x the forward
(`train.metrics.TRAIN_FLOPS_PER_FORWARD`). "diff vs dense": the relative L2 distance of a path's
forward features from the dense mask's.

Training step, through `experiments.bench_train`'s machinery (`train_config`, `compiled_trainer`,
`step_runner`, `timed_step`): the `1b` preset, 2 rows of 4096 tokens, layers scanned (to keep the
compile short), remat dots_kernels, AdamW. Text only: bench_train's synthetic batch
(random bytes, four documents a row) on the model without a tower. With images: the same batch
with two images a row in its longest document (448x448 and 672x448: 640 placeholder tokens, 15.6%
of the tokens) on the model with the k3 tower (image token `train.tokenizer.IMAGE_PAD_ID`); one
compile each.
tokens/s counts every token of the rows; the model FLOPs of the step with images add the tower's
(`tower_flops`) and the projector's (2 x its parameters a merged token), 3x, to the decoder's
(`train.metrics.train_flops_per_token`, every token). Every number is printed as it is measured
and the table and JSON rewritten, so a run cut short keeps what it measured.
"""

import dataclasses
import gc
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench_train import (BenchSetup, compiled_trainer, explained_out_of_memory,
                                     step_runner, synthetic_batch, timed_step, train_config)
from experiments.harness import (cell, command_line, compiled_once, compiled_peak_mib,
                                 gpu_or_smoke_args, median_seconds, package_version,
                                 relative_error, report_preamble, table_row, write_json,
                                 write_markdown)
from kda.common import document_index
from models.attention import document_segments
from models.config import ModelConfig, count_params, preset
from models.vision import MERGE_PATCHES, VisionBatch, VisionConfig, VisionTower, pack_images
from train.metrics import TRAIN_FLOPS_PER_FORWARD, peak_flops_per_device, train_flops_per_token
from train.multimodal import image_tokens
from train.tokenizer import IMAGE_PAD_ID

OPTIMIZER = "adamw"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A batch of the tower: images of these patch grids (h, w), packed in order into `rows`
    rows of `max_patches` slots (`pack_images`)."""

    name: str
    grids: tuple[tuple[int, int], ...]
    rows: int
    max_patches: int

    @property
    def patches(self) -> int:
        return sum(h * w for h, w in self.grids)


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the benchmark: the tower and its workloads and attention paths (the first
    is the dense reference of "diff vs dense"), the training step, and the patch grids of the
    images each of its rows holds."""

    tower: VisionConfig
    dtype: str
    workloads: tuple[Workload, ...]
    implementations: tuple[str, ...]
    train: BenchSetup
    train_grids: tuple[tuple[int, int], ...]


GPU = Size(
    tower=preset("k3").vision,
    dtype="bfloat16",
    workloads=(
        Workload("448x448", ((32, 32),) * 16, rows=16, max_patches=1024),
        Workload("896x672", ((64, 48),) * 4, rows=4, max_patches=3072),
        Workload("1344x1344", ((96, 96),) * 2, rows=2, max_patches=9216),
        # Row 0: 896x672, 448x448, 672x448, 224x224, 448x896 (7936 patches); row 1: 1344x896,
        # 336x560, 224x336, 280x280 (7888).
        Workload("mixed packed", ((64, 48), (32, 32), (48, 32), (16, 16), (32, 64), (96, 64),
                                  (24, 40), (16, 24), (20, 20)), rows=2, max_patches=8192),
    ),
    implementations=("cudnn", "cudnn_segments"),
    train=BenchSetup("1b", batch=2, seq_len=4096, steps=10, warmup=2, remat="dots_kernels",
                     scan_layers=True, layers=False),
    train_grids=((32, 32), (48, 32)),  # 448x448 and 672x448: 256 + 384 placeholders a row
)
SMOKE = Size(
    tower=VisionConfig(patch_size=2, width=32, num_layers=2, num_heads=2, head_dim=16,
                       mlp_hidden=64, pos_table=(8, 8)),
    dtype="float32",
    workloads=(  # one size and a mixed batch: every kind of row, half the compiles
        Workload("8x8", ((4, 4),) * 4, rows=4, max_patches=16),
        Workload("mixed packed", ((8, 6), (4, 4), (2, 2), (4, 8), (6, 4), (2, 4)), rows=2,
                 max_patches=96),
    ),
    implementations=("xla",),  # the cuDNN paths run on GPUs only
    # One KDA layer with a dense FFN, through KDA's recurrent reference: the shortest CPU compile
    # of a step (the trainer's own machinery is most of it).
    train=BenchSetup("tiny", batch=2, seq_len=64, steps=2, warmup=1, remat="none",
                     layers=False, settings=("model.num_layers=1", "model.kda_layers=1",
                                             "model.full_attn_layers=", "model.first_k_dense=1",
                                             "model.kda.impl=reference")),
    train_grids=((4, 4), (4, 6)),  # 4 + 6 placeholders a row
)


def tower_flops(cfg: VisionConfig, grids: Sequence[tuple[int, int]]) -> float:
    """Forward model FLOPs of the tower over images of these patch grids (module docstring):
    the matmuls, 2 n (p^2 C D + L (4 D Q + 2 D F)), and attention, L 4 n^2 Q, an image of n
    patches."""
    d, qkv, layers = cfg.width, cfg.qkv_width, cfg.num_layers
    per_patch = cfg.patch_dim * d + layers * (4 * d * qkv + 2 * d * cfg.mlp_hidden)
    return float(sum(2 * h * w * per_patch + layers * 4 * (h * w) ** 2 * qkv for h, w in grids))


def random_images(cfg: VisionConfig, grids: Sequence[tuple[int, int]], seed: int = 0):
    """Images [h p, w p, C] of uniform pixels in [-1, 1], one per patch grid."""
    rng = np.random.default_rng(seed)
    p = cfg.patch_size
    return [rng.uniform(-1, 1, (h * p, w * p, cfg.in_channels)).astype(np.float32)
            for h, w in grids]


def workload_batch(cfg: VisionConfig, workload: Workload) -> VisionBatch:
    batch = pack_images(random_images(cfg, workload.grids), patch_size=cfg.patch_size,
                        num_rows=workload.rows, max_patches=workload.max_patches,
                        channels=cfg.in_channels)
    return jax.tree.map(jnp.asarray, batch)


def tower_functions(cfg: VisionConfig, implementation: str, dtype: str):
    """(parameters, forward, forward_backward) of the tower with attention path
    `implementation`: forward(parameters, batch) -> features [R, P, D]; forward_backward(
    parameters, batch) -> the gradients of mean(features^2)."""
    model = VisionTower(dataclasses.replace(cfg, implementation=implementation),
                        scan_layers=True, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def forward(params, batch):
        return nnx.merge(graphdef, params)(batch)

    def forward_backward(params, batch):
        return jax.grad(
            lambda params: jnp.mean(jnp.square(forward(params, batch).astype(jnp.float32))))(
                params)

    return params, forward, forward_backward


def packed_note(cfg: VisionConfig, implementation: str, batch: VisionBatch) -> str:
    """For the packed path, whether some row holds more runs of ids than cfg.max_segments (then
    the whole call takes the dense-mask fallback)."""
    if implementation != "cudnn_segments":
        return ""
    segments = document_segments(document_index(batch.segment_ids), cfg.max_segments)
    return "" if bool(jnp.all(segments.fits)) else (
        f"a row holds more than max_segments={cfg.max_segments} runs: the dense fallback ran")


def error_note(error: Exception) -> str:
    first_line = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:160]}"


def run_tower(size: Size, repeats: int, warmup: int,
              report: Callable[[], None], rows: list[dict]) -> None:
    """Times every workload through every path, appending a row to `rows` (and calling
    `report()`) as each is measured."""
    peak = peak_flops_per_device()
    dense_features = {}  # workload -> the first path's features, the reference of the others
    for implementation in size.implementations:
        try:
            params, forward, forward_backward = tower_functions(size.tower, implementation,
                                                                size.dtype)
        except Exception as error:  # noqa: BLE001 (a path that cannot run is reported)
            rows.extend(dict(workload=w.name, implementation=implementation,
                             note=error_note(error)) for w in size.workloads)
            report()
            continue
        for workload in size.workloads:
            batch = workload_batch(size.tower, workload)
            flops = tower_flops(size.tower, workload.grids)
            row = dict(workload=workload.name, implementation=implementation,
                       images=len(workload.grids), patches=workload.patches,
                       slots=workload.rows * workload.max_patches, forward_flops=flops,
                       note=packed_note(size.tower, implementation, batch))
            try:  # a path that fails (an unsupported cuDNN, say) must not stop the run
                fwd = compiled_once(forward, params, batch)
                fwd_bwd = compiled_once(forward_backward, params, batch)
                features = fwd(params, batch)
                seconds = {
                    "forward": median_seconds(lambda: fwd(params, batch), repeats, warmup),
                    "forward_backward": median_seconds(lambda: fwd_bwd(params, batch), repeats,
                                                       warmup)}
                for name, factor in (("forward", 1), ("forward_backward",
                                                      TRAIN_FLOPS_PER_FORWARD)):
                    row[f"{name}_ms"] = 1e3 * seconds[name]
                    row[f"{name}_images_per_s"] = len(workload.grids) / seconds[name]
                    row[f"{name}_patches_per_s"] = workload.patches / seconds[name]
                    row[f"{name}_mfu"] = (None if peak is None
                                          else factor * flops / seconds[name] / peak)
                row["peak_mib"] = compiled_peak_mib(fwd_bwd)
                if workload.name in dense_features:
                    row["diff_vs_dense"] = relative_error(features, dense_features[workload.name])
                else:
                    dense_features[workload.name] = features
                del fwd, fwd_bwd
            except Exception as error:  # noqa: BLE001 (reported in the row's note)
                row["note"] = error_note(error)
                print(f"{workload.name}, {implementation}: {row['note']}", file=sys.stderr)
            rows.append(row)
            print(f"tower {workload.name}, {implementation}: fwd "
                  f"{cell(row.get('forward_ms'), '.2f')} ms, fwd+bwd "
                  f"{cell(row.get('forward_backward_ms'), '.2f')} ms", flush=True)
            report()
        del params


def image_batch(setup: BenchSetup, cfg: VisionConfig, grids: Sequence[tuple[int, int]],
                seed: int = 0) -> dict[str, np.ndarray]:
    """bench_train's synthetic batch with, in each row's longest document after its first token,
    one placeholder run (`train.multimodal.image_tokens`) per patch grid, and the vision buffer
    of their images (random pixels): a row of images per token row. No target inside a run
    counts in the loss, as in `train.multimodal`."""
    batch = synthetic_batch(setup, seed)
    tokens, targets, loss_mask = (batch[key].copy() for key in ("tokens", "targets",
                                                                 "loss_mask"))
    runs = np.concatenate([image_tokens(h * w // MERGE_PATCHES) for h, w in grids])
    for row, ids in enumerate(batch["segment_ids"]):
        documents, lengths = np.unique(ids, return_counts=True)
        inside = np.flatnonzero(ids == documents[np.argmax(lengths)])
        if runs.size >= inside.size:
            raise ValueError(f"row {row}'s longest document has {inside.size} tokens, too few "
                             f"for {runs.size} image tokens: use longer rows or smaller images")
        start = inside[0] + 1
        end = start + runs.size
        tokens[row, start:end] = runs
        targets[row, start - 1:end - 1] = runs
        loss_mask[row, start - 1:end - 1] = 0.0
    images = random_images(cfg, list(grids) * setup.batch, seed)
    buffer = pack_images(images, patch_size=cfg.patch_size, num_rows=setup.batch,
                         max_patches=sum(h * w for h, w in grids), channels=cfg.in_channels)
    return {**batch, "tokens": tokens, "targets": targets, "loss_mask": loss_mask,
            "image_pixels": buffer.pixels, "image_segment_ids": buffer.segment_ids,
            "image_positions": buffer.positions}


def vision_train_flops(model: ModelConfig, grids: Sequence[tuple[int, int]], rows: int) -> float:
    """Training FLOPs of a step's tower and projector: `rows` rows of images of these grids."""
    projector = count_params(model)["vision_projector"]
    merged = sum(h * w for h, w in grids) // MERGE_PATCHES
    forward = tower_flops(model.vision, grids) + 2 * projector * merged
    return TRAIN_FLOPS_PER_FORWARD * rows * forward


def train_row(setup: BenchSetup, model: ModelConfig, batch: dict, extra_flops: float) -> dict:
    """Compiles (the preflight printed) and times the training step of `model` on `batch`;
    extra_flops: the step's model FLOPs outside the decoder (the tower's)."""
    config = dataclasses.replace(train_config(setup, OPTIMIZER), model=model)
    trainer, placed, compiled, times = compiled_trainer(config, setup, batch=batch)
    memory = times.pop("memory_gib")
    flops_per_token = (train_flops_per_token(model, setup.seq_len)["total"]
                       + extra_flops / setup.tokens)
    with explained_out_of_memory(setup, memory):
        numbers = timed_step(step_runner(trainer, compiled, placed), setup, flops_per_token)
    del trainer, compiled, placed
    gc.collect()  # frees the state before the next step is built
    peak = peak_flops_per_device()
    return {**times, "peak_gib": memory["peak"], "flops_per_token": flops_per_token,
            "step_seconds": numbers["step_seconds"],
            "tokens_per_second": numbers["tokens_per_second"],
            "model_tflops_per_second": numbers["model_tflops_per_second"],
            "mfu": None if peak is None else numbers["model_tflops_per_second"] * 1e12 / peak}


def run_train(size: Size, report: Callable[[], None], rows: list[dict]) -> None:
    """The step on text only, then with images; a row each in `rows` as it is measured."""
    setup = size.train
    text_model = train_config(setup, OPTIMIZER).model
    vision = dataclasses.replace(size.tower, image_token_id=IMAGE_PAD_ID)
    image_model = dataclasses.replace(text_model, vision=vision)
    batch = image_batch(setup, vision, size.train_grids)
    placeholders = int((batch["tokens"] == IMAGE_PAD_ID).sum())
    cases = (("text only", text_model, synthetic_batch(setup), 0.0, 0),
             ("with images", image_model, batch,
              vision_train_flops(image_model, size.train_grids, setup.batch), placeholders))
    for name, model, step_batch, extra_flops, image_token_count in cases:
        row = dict(batch=name, image_token_share=image_token_count / setup.tokens,
                   images=0 if not image_token_count else len(size.train_grids) * setup.batch)
        try:
            row.update(train_row(setup, model, step_batch, extra_flops))
        except Exception as error:  # noqa: BLE001 (reported in the row's note)
            row["note"] = error_note(error)
            print(f"step {name}: {row['note']}", file=sys.stderr)
        rows.append(row)
        report()


def markdown(size: Size, tower: list[dict], train: list[dict], command: str) -> list[str]:
    cfg, setup = size.tower, size.train
    lines = report_preamble("Vision tower and training with images", command,
                            f"flax {package_version('flax')}, jaxlib {package_version('jaxlib')}")
    lines += [
        f"- Tower: {cfg.num_layers} blocks of width {cfg.width}, {cfg.num_heads} heads of "
        f"{cfg.head_dim}, MLP {cfg.mlp_hidden}, patches of {cfg.patch_size} pixels; "
        f"{size.dtype} compute, float32 parameters, blocks scanned, no recomputation.",
        "- Times: medians after warm-up, in milliseconds, each call waited for. fwd+bwd: the "
        "forward and the gradients of mean(features^2) in every parameter.",
        "- images/s and patches/s count images and their patches (padding slots not). MFU: "
        "model FLOPs (matmuls 2 n (p^2 C D + L (4 D Q + 2 D F)), attention L 4 n^2 Q an image of "
        "n patches; fwd+bwd 3x) over the time and the dense bf16 peak (989 TFLOP/s).",
        "- diff vs dense: relative L2 distance of the path's forward features from the dense "
        "mask's. Memory: arguments, outputs and temporaries of the fwd+bwd (XLA's analysis).",
        "",
        "| workload | images | patches / slots | attention | fwd ms | fwd+bwd ms | fwd images/s | "
        "fwd patches/s | fwd+bwd images/s | fwd+bwd patches/s | fwd MFU | fwd+bwd MFU | "
        "diff vs dense | memory MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in tower:
        percent = lambda value: None if value is None else 100 * value  # noqa: E731
        lines.append(table_row(
            row["workload"], cell(row.get("images"), "d"),
            f"{cell(row.get('patches'), ',d')} / {cell(row.get('slots'), ',d')}",
            row["implementation"], cell(row.get("forward_ms"), ".2f"),
            cell(row.get("forward_backward_ms"), ".2f"),
            cell(row.get("forward_images_per_s"), ",.1f"),
            cell(row.get("forward_patches_per_s"), ",.0f"),
            cell(row.get("forward_backward_images_per_s"), ",.1f"),
            cell(row.get("forward_backward_patches_per_s"), ",.0f"),
            cell(percent(row.get("forward_mfu")), ".1f"),
            cell(percent(row.get("forward_backward_mfu")), ".1f"),
            cell(row.get("diff_vs_dense"), ".1e"), cell(row.get("peak_mib"), ",.0f"),
            row.get("note", "")))
    lines += [
        "",
        f"## The `{setup.preset}` training step, {setup.batch} x {setup.seq_len} tokens",
        "",
        f"Layers scanned, remat {setup.remat}, {OPTIMIZER}; median of {setup.steps} steps issued "
        "one in flight (`experiments.bench_train`). With images: each row's longest document "
        f"holds images of {' and '.join(f'{h * cfg.patch_size}x{w * cfg.patch_size}' for h, w in size.train_grids)} "
        "pixels, on the model with the tower above (text only: no tower). Model FLOPs: the "
        "decoder's for every token, plus the tower's and the projector's.",
        "",
        "| batch | images | image tokens | step ms | tokens/s | model TFLOP/s | MFU | compile s | "
        "XLA peak GiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in train:
        step_ms = row.get("step_seconds")
        lines.append(table_row(
            row["batch"], str(row["images"]), f"{100 * row['image_token_share']:.1f}%",
            cell(None if step_ms is None else 1e3 * step_ms, ".1f"),
            cell(row.get("tokens_per_second"), ",.0f"),
            cell(row.get("model_tflops_per_second"), ".1f"),
            cell(None if row.get("mfu") is None else 100 * row["mfu"], ".1f"),
            cell(row.get("compile_seconds"), ".0f"), cell(row.get("peak_gib"), ".1f"),
            row.get("note", "")))
    return lines


def main(argv=None) -> dict:
    def parts_option(parser):
        parser.add_argument("--parts", nargs="+", choices=("tower", "train"),
                            default=["tower", "train"],
                            help="what to measure: the tower's table, the training step's "
                            "(default: both)")

    args = gpu_or_smoke_args(
        argv, __doc__.split("\n\n")[0], "vision",
        gpu_help="the K3 tower in bf16 and the 1b step (under 4 minutes on an H200)",
        smoke_help="a tiny tower and the tiny step in float32 on CPU (a check)",
        add_options=parts_option)
    size = GPU if args.gpu else SMOKE
    command = command_line("experiments.bench_vision", argv)
    results = {"tower": [], "train": []}

    def report():
        if args.out is not None:
            write_markdown(args.out, markdown(size, results["tower"], results["train"], command))
            write_json(Path(args.out).with_suffix(".json"), results)

    if "tower" in args.parts:
        run_tower(size, args.repeats, args.warmup, report, results["tower"])
    if "train" in args.parts:
        run_train(size, report, results["train"])
    if args.out is not None:
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
