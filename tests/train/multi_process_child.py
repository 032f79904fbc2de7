"""One process of the two-process training test (`test_multi_process.py`): joins the run named by
the shared command-line options (--coordinator-address, --num-processes, --process-id), trains
`multi_process_config(--corpus)` in --out up to --until-step, then resumes from that checkpoint (a
fresh trainer restoring what the processes saved) to the last step. With --die-saving STEP,
process 1 kills itself (SIGKILL) once it has started writing checkpoint STEP of the resumed run,
as a host lost in the middle of a save."""

import dataclasses
import os
import signal
import sys

import jax
import numpy as np

from train.cli import apply_overrides, join_processes, make_parser
from train.checkpoint import Checkpointer
from train.loop import TrainConfig, train

# One Gated MLA layer with a dense FFN on a 2 x 2 (data x fsdp) mesh: the batch and the
# parameters are split across the two processes (each loads one of the data's two shards), and
# the programs compile quickly.
OVERRIDES = [
    "model.num_layers=1", "model.kda_layers=", "model.full_attn_layers=1",
    "model.residual=plain", "data.seq_len=32", "data.batch_size=4", "data.packing_bins=4",
    "data.shards=2",
    "steps=3", "log_every=1", "checkpoint_every=1", "eval_batches=1", "fast_compile=true",
    "progress=false", "mesh.data=2", "mesh.fsdp=2",
]


def write_corpus(directory: str) -> None:
    """Documents of 3 to 60 random letters in `directory`: several pack into one row, so the
    processes' data shards reach different positions (a checkpoint must keep each one's)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(40):
        letters = rng.integers(ord("a"), ord("z") + 1, size=rng.integers(3, 61), dtype=np.uint8)
        with open(os.path.join(directory, f"{i:02d}.txt"), "wb") as f:
            f.write(letters.tobytes())


def multi_process_config(corpus: str) -> TrainConfig:
    """The run on the documents `write_corpus` wrote in the folder `corpus`."""
    config = apply_overrides(TrainConfig(), OVERRIDES)
    paths = tuple(sorted(os.path.join(corpus, name) for name in os.listdir(corpus)))
    return dataclasses.replace(
        config, data=dataclasses.replace(config.data, paths=paths, val_fraction=0.2))


def main(argv: list[str]) -> None:
    parser = make_parser("multi_process_child", __doc__, multi_process=True)
    parser.add_argument("--corpus", required=True, help="the folder write_corpus filled")
    parser.add_argument("--until-step", type=int, required=True)
    parser.add_argument("--die-saving", type=int)
    args = parser.parse_args(argv)
    join_processes(args)
    train(multi_process_config(args.corpus), args.out, until_step=args.until_step)
    if args.die_saving is not None and jax.process_index() == 1:
        save = Checkpointer.save

        def save_then_die(self, step, *rest, **options):
            save(self, step, *rest, **options)
            if step == args.die_saving:
                os.kill(os.getpid(), signal.SIGKILL)

        Checkpointer.save = save_then_die
    train(multi_process_config(args.corpus), args.out, resume=True)


if __name__ == "__main__":
    main(sys.argv[1:])
