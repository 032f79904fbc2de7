"""Staged context extension: train at growing sequence lengths with constant tokens per step, the
data mix shifting toward long documents and long-range recall, and measure needle-in-a-haystack
and MQAR accuracy at every stage boundary.

    python -m experiments.context_extension                    # CPU: 64 -> 256 -> 1K bytes
    python -m experiments.context_extension --set lengths=8192,65536,262144,1048576 \\
        --set tokens_per_step=8388608 --set stage_steps=4000,1000,300,100 --set train.model=... \\
        --set corpus=stdlib,repositories,repositories,repositories --set corpus_weight=1,1,1,1 \\
        --set long_document_bias=0,0.5,0.7,0.7 --set mqar_weight=0.05,0.15,0.25,0.25 \\
        --set needle_weight=0.05,0.15,0.25,0.25 --set answer_weight=1,4,4,4

K3 extends its context 8K -> 64K -> 256K -> 1M; the CPU default is that recipe scaled down.
Each stage keeps batch_size x seq_len = tokens_per_step and sets its data mix: corpus chunks, of
which a share drawn from documents longer than the row (`long_document_bias`), and synthetic MQAR
and needle rows. The CPU default's first stage trains on the tasks alone, in short rows where
their examples are cheap: recall forms there as a sudden transition after a few hundred steps (a
few hundred thousand answer tokens; mixed with corpus rows from the start, the same steps stay at
chance). The later stages mix the corpus back in, with the answers' loss weighted up.
The learning-rate schedule runs once over all stages. At the end of every stage the model is
evaluated at every length of the curriculum (held-out task examples; needles at fixed depths), so
the table shows both what the stage taught and how far beyond its length it reaches. The table
goes to context_extension.md (and summary.json) in the run folder.
"""

import dataclasses
import os
import sys

from models.config import preset
from train.cli import join_processes, make_parser, one_line_errors, resolve_config, run_folder
from train.corpus import EmbeddedCorpus
from train.data import make_train_dataset
from train.distributed import is_primary, print_primary
from train.loop import Stage, TrainConfig, Trainer, train
from train.optim import OptimConfig
from train.synthetic import MQAR, NeedleInHaystack

DEFAULT_OUT = "runs/context_extension"


@dataclasses.dataclass(frozen=True)
class ContextExtensionConfig:
    """The curriculum: one entry per stage in each per-stage tuple.

    train: model, optimizer and loop settings (its data settings are the first stage's base;
        steps is derived from stage_steps).
    lengths: sequence length of each stage.
    tokens_per_step: batch_size x seq_len of every stage (a multiple of each length).
    stage_steps: optimizer steps of each stage.
    corpus_weight, long_document_bias, mqar_weight, needle_weight, answer_weight: each stage's
        data mix and the loss weight of a task's answer tokens (see DataConfig).
    corpus: each stage's embedded corpus (DataConfig.corpus), or empty for train.data.corpus in
        every stage. Rows past 256K need "repositories": the stdlib has no document that long.
    mqar: the MQAR task trained on and evaluated.
    needle: the needle task trained on (at uniform depths) and evaluated at needle_depths.
    needle_depths: needle positions evaluated (fractions of the haystack before the needle).
    eval_examples: held-out examples per task, length and depth.
    """

    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(
        model=preset("tiny"),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=20, decay_fraction=0.3),
        log_every=10, eval_batches=4,
    ))
    lengths: tuple[int, ...] = (64, 256, 1024)
    tokens_per_step: int = 2048
    stage_steps: tuple[int, ...] = (700, 100, 40)
    corpus_weight: tuple[float, ...] = (0.0, 1.0, 1.0)
    long_document_bias: tuple[float, ...] = (0.0, 0.5, 0.7)
    mqar_weight: tuple[float, ...] = (1.0, 0.5, 0.5)
    needle_weight: tuple[float, ...] = (1.0, 0.5, 0.5)
    answer_weight: tuple[float, ...] = (1.0, 4.0, 4.0)
    corpus: tuple[EmbeddedCorpus, ...] = ()
    mqar: MQAR = dataclasses.field(default_factory=lambda: MQAR(num_kv_pairs=4))
    needle: NeedleInHaystack = dataclasses.field(
        default_factory=lambda: NeedleInHaystack(key_bytes=2, value_bytes=3))
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    eval_examples: int = 16

    def __post_init__(self):
        per_stage = ("stage_steps", "corpus_weight", "long_document_bias", "mqar_weight",
                     "needle_weight", "answer_weight")
        for name in per_stage + (("corpus",) if self.corpus else ()):
            if len(getattr(self, name)) != len(self.lengths):
                raise ValueError(
                    f"ContextExtensionConfig.{name} has {len(getattr(self, name))} entries for "
                    f"{len(self.lengths)} stages (lengths={self.lengths}); give one per stage"
                )
        if not self.lengths or list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths must be increasing, got {self.lengths}")
        for length in self.lengths:
            if self.tokens_per_step % length:
                raise ValueError(
                    f"tokens_per_step={self.tokens_per_step} is not a multiple of the stage "
                    f"length {length}; every stage keeps batch_size x seq_len = tokens_per_step"
                )
        if self.eval_examples < 1:
            raise ValueError(f"eval_examples must be at least 1, got {self.eval_examples}")

    def stages(self) -> tuple[Stage, ...]:
        base = self.train.data
        corpora = self.corpus or (base.corpus,) * len(self.lengths)
        return tuple(
            Stage(
                dataclasses.replace(
                    base, seq_len=length, batch_size=self.tokens_per_step // length,
                    corpus_weight=corpus_share, long_document_bias=bias,
                    mqar_weight=mqar_share, needle_weight=needle_share, answer_weight=answer,
                    mqar=self.mqar, needle=self.needle, corpus=corpus,
                ),
                steps,
            )
            for length, steps, corpus_share, bias, mqar_share, needle_share, answer, corpus
            in zip(
                self.lengths, self.stage_steps, self.corpus_weight, self.long_document_bias,
                self.mqar_weight, self.needle_weight, self.answer_weight, corpora,
            )
        )

    def train_config(self) -> TrainConfig:
        return dataclasses.replace(
            self.train, steps=sum(self.stage_steps), data=self.stages()[0].data
        )


def recall_accuracy(config: ContextExtensionConfig, trainer: Trainer) -> dict:
    """Needle (per depth) and MQAR exact-match and token accuracy at every curriculum length."""
    by_length = {}
    for length in config.lengths:
        rows = max(config.tokens_per_step // length, 1)
        batches = max(config.eval_examples // rows, 1)
        options = dict(seq_len=length, batch_size=min(rows, config.eval_examples),
                       num_batches=batches)
        results = {"mqar": trainer.task_accuracy(config.mqar, **options)}
        for depth in config.needle_depths:
            results[f"needle@{depth:g}"] = trainer.task_accuracy(
                dataclasses.replace(config.needle, depth=depth), **options
            )
        by_length[str(length)] = results
    return {"recall": by_length}


def table(config: ContextExtensionConfig, stage_results: list[dict]) -> str:
    """The markdown table: one row per (stage, evaluated length)."""
    depths = [f"needle@{depth:g}" for depth in config.needle_depths]
    header = ["stage", "trained to", "eval length", "MQAR exact", "MQAR token"] + [
        f"{name} exact" for name in depths
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in stage_results:
        for length, tasks in result["recall"].items():
            cells = [str(result["stage"] + 1), str(config.lengths[result["stage"]]), length,
                     f"{tasks['mqar']['exact_match']:.2f}",
                     f"{tasks['mqar']['token_accuracy']:.2f}"]
            cells += [f"{tasks[name]['exact_match']:.2f}" for name in depths]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chance_note(config: ContextExtensionConfig) -> str:
    """The accuracies a model that ignores the context gets, to read the table against."""
    needle = config.needle
    needle_token = needle.chance_token_accuracy()
    return (f"Chance without recall: MQAR token {config.mqar.chance_token_accuracy():.3f}, "
            f"needle token {needle_token:.1f} (exact {needle_token ** needle.value_bytes:.0e}).")


def main(argv=None) -> dict:
    # The summary and the usage examples, whose --set keys name this config's fields.
    parser = make_parser("python -m experiments.context_extension",
                         "\n\n".join(__doc__.split("\n\n")[:2]), multi_process=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = resolve_config(parser, args, ContextExtensionConfig())
    out = run_folder(args, config, DEFAULT_OUT)
    with one_line_errors(args.debug):
        join_processes(args)  # before anything touches a device
    stages = config.stages()
    for index, stage in enumerate(stages):
        print_primary(f"stage {index + 1}: {stage.steps} steps of {stage.data.batch_size} x "
                      f"{stage.data.seq_len}; corpus {stage.data.corpus_weight:g} (long documents "
                      f"{stage.data.long_document_bias:.0%}), MQAR {stage.data.mqar_weight:g}, "
                      f"needle {stage.data.needle_weight:g}")
    with one_line_errors(args.debug):
        # Building every stage's pipeline now refuses a long stage without long enough
        # documents before the earlier stages have trained for hours.
        for stage in stages:
            make_train_dataset(stage.data)
        result = train(
            config.train_config(), out, resume=args.resume, stages=stages,
            allow_data_change=args.allow_data_change,
            after_stage=lambda index, stage, trainer: recall_accuracy(config, trainer),
        )
    stage_results = result.summary.get("stages", [])
    markdown = table(config, stage_results) + "\n\n" + chance_note(config)
    if is_primary():  # the run folder's file, written once
        with open(os.path.join(out, "context_extension.md"), "w") as f:
            f.write(markdown + "\n")
    print_primary(f"\nrecall at every stage boundary (exact match over {config.eval_examples} "
                  f"held-out examples):\n{markdown}\n\nvalidation bits per byte at the last "
                  f"length: {result.summary['val_bits_per_byte']:.3f}; run folder: {out}/")
    return result.summary


if __name__ == "__main__":
    main()
