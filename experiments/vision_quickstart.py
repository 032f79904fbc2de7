"""Does the model look? Train the tiny hybrid with a small vision tower on text and image
questions, and score its held-out answers next to two controls trained the same way.

    python -m experiments.vision_quickstart                  # three runs on a 2-core CPU
    python -m experiments.vision_quickstart --out runs/vq --set steps=600
    python -m experiments.vision_quickstart --out runs/vq --resume
    python -m experiments.vision_quickstart --controls none  # only the run with images

The data (`train.multimodal`, `train.image_tasks`, nothing downloaded) mixes corpus chunks of
the Python standard library with image-question-answer examples packed several to a row, e.g.
`<bos><image_start><image> x n<image_end>Which digit? 7`, the loss on the answer bytes: digits
(scikit-learn's 8 x 8 digits) and shape colours on canvases of varied aspect ratio are the gate
tasks; counting shapes and reading a rendered two-digit number are stretch tasks, reported.

Three runs, identical but for the images (`MultimodalDataConfig.vision_control`): with images;
every pixel zeroed; images shuffled between examples of a task (each example shows another's
image). A model that reads the image beats both controls; a control above chance would mean the
answer leaks through something other than the pixels (the placeholder count, the question).
Accuracy is exact match of the answer on each task's held-out split (balanced answers, so chance
is 1 / the number of answers), each control evaluated under its own condition.

Gate: digits and colour at least 95% with images, and both controls within 5 points of chance on
both; the run exits with status 1 when it fails. The table goes to vision_quickstart.md, a bar
plot to accuracy.png and everything to summary.json in the run folder; each run (images/,
zeroed/, shuffled/) is a quickstart run folder of its own (metrics, plots, checkpoint). The runs
compile the same programs, once: JAX's persistent compilation cache goes to compilation_cache/
in the run folder unless JAX_COMPILATION_CACHE_DIR names another.
"""

import dataclasses
import json
import os
import sys
import time

import jax

from models.config import count_params, format_count, preset
from models.vision import VisionConfig
from train.cli import join_processes, make_parser, one_line_errors, resolve_config, run_folder
from train.distributed import is_primary, print_primary
from train.loop import TrainConfig, train
from train.multimodal import MultimodalDataConfig, make_image_task_batches
from train.optim import OptimConfig
from train.tokenizer import IMAGE_PAD_ID

DEFAULT_OUT = "runs/vision_quickstart"
COMPILATION_CACHE = "compilation_cache"
# A small tower: 4-pixel patches (an 8 x 8 digit is 2 x 2 patches, one merged token), two
# blocks of width 64.
TOWER = VisionConfig(patch_size=4, width=64, num_layers=2, num_heads=4, head_dim=16,
                     mlp_hidden=128, pos_table=(16, 16), image_token_id=IMAGE_PAD_ID)
CONFIG = TrainConfig(
    model=preset("tiny", vision=TOWER),
    # Image examples of 18 to 30 tokens (at most 32 patches an image), about five to a row;
    # about one row in eight is a corpus chunk. Digits weigh most: the gate task slowest to
    # learn. Each answer byte weighs 4 corpus bytes in the loss.
    data=MultimodalDataConfig(seq_len=128, batch_size=16, patch_size=4, image_patches=32,
                              row_patches=128, corpus_weight=0.1, digits_weight=3.0,
                              colour_weight=1.0, count_weight=0.25, reading_weight=0.25,
                              answer_weight=4.0, packing_bins=16),
    optim=OptimConfig(learning_rate=4e-3, warmup_steps=20, schedule="wsd", decay_fraction=0.3),
    steps=200,
    log_every=5,
    eval_batches=4,
    checkpoint_every=100,
)
# vision_control of each run, and the run's name (its folder and its table column).
CONTROLS = {"none": "images", "zeroed": "zeroed", "shuffled": "shuffled"}
GATE_TASKS = ("digits", "colour")
GATE_ACCURACY = 0.95
GATE_CHANCE_MARGIN = 0.05


def parse_args(argv):
    parser = make_parser(
        "python -m experiments.vision_quickstart",
        __doc__.split("\n\n")[0] + "\n\nDefaults: runs/vision_quickstart, preset tiny with a "
        f"{TOWER.num_layers}-block tower of width {TOWER.width}, {CONFIG.steps} steps of "
        f"{CONFIG.data.batch_size}x{CONFIG.data.seq_len} tokens, three runs.",
        multi_process=True,
    )
    parser.add_argument("--controls", nargs="+", default=list(CONTROLS), choices=list(CONTROLS),
                        help="the runs: none (with images), zeroed, shuffled (default: all three)")
    args = parser.parse_args(argv)
    return args, resolve_config(parser, args, CONFIG)


def image_accuracy(trainer, data: MultimodalDataConfig) -> dict[str, float]:
    """Exact-match answer accuracy on the held-out split of each image task in the mix."""
    return {name: trainer.answer_accuracy(make_image_task_batches(data, name))["exact_match"]
            for name in data.image_tasks() if data.source_weights()[name] > 0}


def chance(data: MultimodalDataConfig) -> dict[str, float]:
    """Accuracy of a constant answer on each task's balanced held-out split."""
    return {name: 1.0 / len(task.answers()) for name, task in data.image_tasks().items()}


def gate(accuracy: dict[str, dict[str, float]], chances: dict[str, float]) -> list[str]:
    """The gate's failures among the runs and tasks evaluated, in words (empty: none).
    accuracy: run name -> task -> held-out accuracy."""
    failures = []
    for task in GATE_TASKS:
        if task in accuracy.get("images", {}) and accuracy["images"][task] < GATE_ACCURACY:
            failures.append(f"{task} with images {accuracy['images'][task]:.1%} < "
                            f"{GATE_ACCURACY:.0%}")
        for run in ("zeroed", "shuffled"):
            if task in accuracy.get(run, {}) and abs(
                    accuracy[run][task] - chances[task]) > GATE_CHANCE_MARGIN:
                failures.append(f"{task} {run} {accuracy[run][task]:.1%} is more than "
                                f"{GATE_CHANCE_MARGIN:.0%} from chance {chances[task]:.1%}")
    return failures


def gate_judged(accuracy: dict[str, dict[str, float]]) -> bool:
    """Whether the runs cover the gate: all three, each scored on every gate task."""
    return set(accuracy) == set(CONTROLS.values()) and all(
        task in scores for scores in accuracy.values() for task in GATE_TASKS)


def table(accuracy: dict[str, dict[str, float]], chances: dict[str, float],
          data: MultimodalDataConfig) -> str:
    """Markdown: one row per task, its held-out size, chance and each run's accuracy."""
    runs = list(accuracy)
    tasks = list(next(iter(accuracy.values())))
    lines = ["| task | held out | chance | " + " | ".join(runs) + " |",
             "|---|---|---|" + "---|" * len(runs)]
    for task in tasks:
        kind = "gate" if task in GATE_TASKS else "stretch"
        lines.append(f"| {task} ({kind}) | {data.image_tasks()[task].held_out_size()} | "
                     f"{chances[task]:.1%} | "
                     + " | ".join(f"{accuracy[run][task]:.1%}" for run in runs) + " |")
    return "\n".join(lines)


def plot(accuracy: dict[str, dict[str, float]], chances: dict[str, float], path: str) -> None:
    """Grouped bars: held-out accuracy per task and run, chance as a dashed line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, tasks = list(accuracy), list(next(iter(accuracy.values())))
    width = 0.8 / len(runs)
    figure, axis = plt.subplots(figsize=(7, 4))
    for index, run in enumerate(runs):
        axis.bar([t + index * width for t in range(len(tasks))],
                 [100 * accuracy[run][task] for task in tasks], width, label=run)
    for t, task in enumerate(tasks):
        axis.hlines(100 * chances[task], t - width / 2, t + (len(runs) - 0.5) * width,
                    colors="black", linestyles="dashed", label="chance" if t == 0 else None)
    axis.axhline(100 * GATE_ACCURACY, color="grey", lw=0.5, label=f"gate ({GATE_ACCURACY:.0%})")
    axis.set_xticks([t + (len(runs) - 1) * width / 2 for t in range(len(tasks))], tasks)
    axis.set(ylabel="held-out exact match (%)", ylim=(0, 100),
             title="answers with images, images zeroed, images shuffled")
    axis.legend(fontsize="small", loc="center right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None) -> dict:
    args, config = parse_args(sys.argv[1:] if argv is None else argv)
    out = run_folder(args, config, DEFAULT_OUT)
    with one_line_errors(args.debug):
        join_processes(args)  # before anything touches a device
    if not jax.config.jax_compilation_cache_dir:
        # The three runs compile the same programs: compile them once.
        jax.config.update("jax_compilation_cache_dir", os.path.join(out, COMPILATION_CACHE))
    counts = count_params(config.model)
    print_primary(f"model: tiny preset, {format_count(counts['total'])} parameters with a vision "
                  f"tower and projector of {format_count(counts['vision'])}; devices: "
                  f"{jax.device_count()} x {jax.devices()[0].device_kind} in "
                  f"{jax.process_count()} process(es); run folder: {out}")
    accuracy, runs = {}, {}
    with one_line_errors(args.debug):
        for control in args.controls:
            name = CONTROLS[control]
            run_config = dataclasses.replace(
                config, data=dataclasses.replace(config.data, vision_control=control))
            print_primary(f"\nrun '{name}' (vision_control={control!r})")
            start, start_cpu = time.perf_counter(), time.process_time()
            result = train(run_config, os.path.join(out, name), resume=args.resume,
                           allow_data_change=args.allow_data_change)
            accuracy[name] = image_accuracy(result.trainer, run_config.data)
            runs[name] = dict(result.summary, wall_seconds=time.perf_counter() - start,
                              cpu_seconds=time.process_time() - start_cpu,
                              accuracy=accuracy[name])
    chances = chance(config.data)
    failures = gate(accuracy, chances)
    markdown = table(accuracy, chances, config.data)
    summary = dict(runs=runs, chance={k: chances[k] for k in next(iter(accuracy.values()))},
                   gate_failures=failures, gate_passed=gate_judged(accuracy) and not failures)
    if is_primary():  # the run folder's files, written once
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "vision_quickstart.md"), "w") as f:
            f.write(markdown + "\n")
        plot(accuracy, chances, os.path.join(out, "accuracy.png"))
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    timing = ", ".join(
        f"{name} {run['wall_seconds']:.0f} s ({run['cpu_seconds']:.0f} s of CPU"
        + (f", {run['tokens_per_second'] / (config.data.batch_size * config.data.seq_len):.2f}"
           " steps/s" if run["tokens_per_second"] else "") + ")"
        for name, run in runs.items())
    print_primary(f"\nheld-out exact match after {config.steps} steps:\n{markdown}\n"
                  f"time per run (training, evaluation, checkpoint): {timing}\n"
                  f"table, plot, summary: {out}/vision_quickstart.md, accuracy.png, summary.json")
    if failures:
        print_primary("gate FAILED: " + "; ".join(failures))
    elif gate_judged(accuracy):
        print_primary(f"gate passed: {' and '.join(GATE_TASKS)} >= {GATE_ACCURACY:.0%} with "
                      f"images, both controls within {GATE_CHANCE_MARGIN:.0%} of chance")
    else:
        print_primary(f"gate not judged: it needs the three runs, each on "
                      f"{' and '.join(GATE_TASKS)}")
    return summary


if __name__ == "__main__":
    sys.exit(1 if main().get("gate_failures") else 0)
