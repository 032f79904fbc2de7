"""The main job: train the tiny K3-style hybrid on the embedded corpus, then sample from it.

    python -m experiments.quickstart                       # 3-4 minutes on an idle 2-core CPU
    python -m experiments.quickstart --out runs/qs --set steps=600 --set optim.optimizer=muon
    python -m experiments.quickstart --out runs/qs --resume
    python -m experiments.quickstart --data notes.txt more.jsonl   # your own text instead

Errors (a run folder that cannot be written, data files changed under a resumed run, damaged
checkpoints with none intact, a full disk) print one line, `error: ...`, and exit with status 2;
`--debug` shows the traceback.

The model is the `tiny` preset: KDA and Gated MLA token mixers (3:1), Stable LatentMoE FFNs
balanced by Quantile Balancing, Block Attention Residuals. The data is the Python standard
library's own source and help text (no download), as bytes. The run prints a progress bar, the
validation bits per byte next to the corpus's order-0 entropy (what a model that ignores context
would get), a sample, and leaves metrics, plots and a checkpoint in the run folder.
"""

import dataclasses
import math
import sys

import jax

from models.config import PRESETS, count_params, format_count, preset
from models.generate import Sampling, generate
from train.cli import join_processes, make_parser, one_line_errors, resolve_config, run_folder
from train.data import DataConfig
from train.distributed import print_primary
from train.loop import TrainConfig, train
from train.optim import OptimConfig
from train.tokenizer import decode, encode

DEFAULT_OUT = "runs/quickstart"
CONFIG = TrainConfig(
    model=preset("tiny"),
    data=DataConfig(seq_len=256, batch_size=16),
    optim=OptimConfig(learning_rate=4e-3, warmup_steps=20, schedule="wsd", decay_fraction=0.3),
    steps=300,
    log_every=5,
    eval_every=100,
    eval_batches=16,
    checkpoint_every=100,
)
PROMPT = "def "


def parse_args(argv):
    parser = make_parser(
        "python -m experiments.quickstart",
        __doc__.split("\n\n")[0] + "\n\nDefaults: runs/quickstart, preset tiny, "
        f"{CONFIG.steps} steps of {CONFIG.data.batch_size}x{CONFIG.data.seq_len} bytes.",
        multi_process=True,
    )
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset to start from (default: tiny)")
    parser.add_argument("--data", nargs="+", metavar="FILE",
                        help="train on these text or JSONL files instead of the embedded corpus")
    parser.add_argument("--prompt", default=PROMPT, help=f"sample prompt (default: {PROMPT!r})")
    parser.add_argument("--sample-bytes", type=int, default=200, metavar="N",
                        help="bytes to sample after training (default: 200; 0 skips sampling)")
    args = parser.parse_args(argv)
    config = dataclasses.replace(CONFIG, model=preset(args.preset))
    if args.data:
        config = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                      paths=tuple(args.data)))
    config = resolve_config(parser, args, config)
    if args.sample_bytes < 0:
        parser.error(f"--sample-bytes must be >= 0, got {args.sample_bytes}")
    return args, config


def sample(model, prompt: str, num_bytes: int, seed: int = 0) -> str:
    """`num_bytes` sampled continuation bytes of `prompt` (temperature 0.8, top-p 0.95)."""
    prompts = encode(prompt)[None]
    result = generate(model, prompts, max_new_tokens=num_bytes,
                      sampling=Sampling(temperature=0.8, top_p=0.95), seed=seed)
    return decode(result.tokens[0, : result.lengths[0]])


def _rate(summary: dict) -> str:
    if summary["tokens_per_second"] is None:  # nothing trained in this process (a finished run resumed)
        return "n/a"
    return (f"{summary['tokens_per_second']:,.0f} bytes/s (first step, with compilation: "
            f"{summary['first_step_seconds']:.0f} s)")


def _comparison(validation: float, entropy: float) -> str:
    if not math.isfinite(validation):  # a diverged run: metrics.jsonl shows where
        return "no comparison: the validation figure is not finite"
    return f"the model is at {100 * validation / entropy:.0f}% of it"


def main(argv=None) -> dict:
    args, config = parse_args(sys.argv[1:] if argv is None else argv)
    out = run_folder(args, config, DEFAULT_OUT)
    with one_line_errors(args.debug):
        several = join_processes(args)  # before anything touches a device
    # With several processes, process 0 prints; the sample needs the whole model on one host.
    counts = count_params(config.model)
    print_primary(f"model: {args.preset} preset, {format_count(counts['total'])} parameters "
                  f"({format_count(counts['active'])} active per token, embedding excluded); "
                  f"{len(config.model.kda_layers)} KDA + {len(config.model.full_attn_layers)} "
                  "MLA layers")
    print_primary(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} in "
                  f"{jax.process_count()} process(es); run folder: {out}")
    # A refusal (run folder, data, checkpoints, a disk that fills up) is one line and exit 2.
    with one_line_errors(args.debug):
        result = train(config, out, resume=args.resume, allow_data_change=args.allow_data_change)
    summary = result.summary
    if args.sample_bytes and not several:
        text = sample(result.model, args.prompt, args.sample_bytes)
        print("\nsample (temperature 0.8):\n" + "-" * 60 + f"\n{args.prompt}{text}\n" + "-" * 60)
    validation, entropy = summary["val_bits_per_byte"], summary["val_unigram_bits_per_byte"]
    print_primary(
        f"\nsummary: {summary['steps']} steps, {summary['tokens_seen']:,} training bytes, "
        f"{summary['corpus']} (sha256 {summary['corpus_sha256'][:12]})\n"
        f"  validation bits per byte:      {validation:.3f}\n"
        f"  order-0 entropy of validation: {entropy:.3f} bits per byte "
        f"({_comparison(validation, entropy)})\n"
        f"  training throughput:           {_rate(summary)}\n"
        f"  skipped non-finite steps:      {summary['skipped_steps']}\n"
        f"  metrics, plots, checkpoint:    {out}/"
    )
    return summary


if __name__ == "__main__":
    main()
