"""The training loop: build, (resume,) train with a progress bar, evaluate, checkpoint, plot.

    result = train(TrainConfig(model=preset("tiny"), steps=300), "runs/quickstart")
    result.summary["val_bits_per_byte"], result.model

A run folder holds config.json, data_manifest.json, metrics.jsonl (`train.metrics`),
checkpoints/ (`train.checkpoint`), loss.png / max_vio.png / grad_norm.png and summary.json.
`train(..., resume=True)` continues from the newest checkpoint: parameters, optimizer, router
biases, counters and the data iterator come back exactly, so on one CPU device the resumed run
computes the same losses as an uninterrupted one. A run of several processes
(`train.distributed`) trains on one global mesh; process 0 writes the run folder's files.

What a run folder may have suffered is checked before anything trains:

- The folder is created (or, on resume, found) and probed for writing up front: a read-only
  folder, a path that is a file, or one under a non-folder raise an OSError of that kind whose
  one-line message names the path and the reason.
- Resuming skips damaged checkpoints: each checkpoint is verified against the checksums saved
  with it (`train.checkpoint`); a damaged newer one is moved aside to `<step>.damaged`, with a
  warning naming the step, the cause and the step resumed from, and metrics rows after that
  step are dropped. When every checkpoint is damaged, a CheckpointError names each.
- A missing config.json is rewritten, with a warning, from the config stored in the newest
  checkpoint that holds one; it is then compared with the current config as usual.
- Data that changed since the run started (data_manifest.json's corpus hash; for `--data`
  files, each file's sha256) is refused with a ValueError naming each changed file with its
  old and new sha256 prefixes, unless `allow_data_change=True` (`--allow-data-change`): then a
  warning says so and the old manifest is kept in the new one's `history` (with the step it was
  replaced at).
"""

import dataclasses
import errno
import functools
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
import tqdm
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig, preset
from models.lm import HybridLM
from core.sharding import batch_sharding, make_mesh, state_shardings
from train.checkpoint import CheckpointError, Checkpointer, Resumed, abstract_like
from train.cli import RunStopped, config_dict
from train.data import (
    DataConfig,
    bits_per_byte,
    data_manifest,
    global_data_state,
    make_eval_iterator,
    make_task_batches,
    make_train_iterator,
    process_data_state,
)
from train.metrics import (
    MetricsWriter,
    peak_flops_per_device,
    plot_metrics,
    read_json,
    read_metrics,
    train_flops_per_token,
)
from train.distributed import (
    gather_json,
    global_batch_array,
    initialize,
    is_primary,
    process_rows_array,
    sync,
    to_host,
)
from train.multimodal import MultimodalDataConfig, check_model_fits, make_multimodal_iterator
from train.optim import OptimConfig, learning_rate_schedule, make_optimizer
from train.step import (
    FAST_COMPILE_OPTIONS,
    TrainState,
    check_chunk_tokens,
    make_eval_step,
    make_train_step,
    stacked_axes,
)
from train.synthetic import Task, answer_accuracy
from train.tokenizer import VOCAB_SIZE

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
MANIFEST_FILE = "data_manifest.json"
# Fields that may differ between a run and its resumption (they change how the step runs, not
# what it computes beyond float32 rounding).
RUNTIME_FIELDS = ("progress", "fast_compile", "loss_chunk_tokens", "max_consecutive_skips")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes (`core.sharding.make_mesh`). One axis may be -1: it takes all
    the devices the others leave; without a -1 the mesh uses the first
    data*fsdp*expert*seq*tensor devices (mesh.data=1: a single device). seq > 1 splits each
    sequence's tokens over that many devices (context parallelism, `core.context_parallel`)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    seq: int = 1
    tensor: int = 1

    def devices(self) -> list[jax.Device]:
        sizes = dataclasses.asdict(self)
        if -1 in sizes.values():
            return jax.devices()
        wanted = math.prod(sizes.values())
        if wanted > jax.device_count():
            raise ValueError(
                f"the mesh {sizes} needs {wanted} devices but {jax.device_count()} are present; "
                "shrink an axis or set one to -1"
            )
        return jax.devices()[:wanted]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    model, data, optim, mesh: the parts' configs.
    steps: optimizer steps of the whole run (the learning-rate schedule spans them).
    seed: parameter initialisation (the data order has its own, data.seed).
    log_every: progress-bar refresh and metrics flush period, in steps (every step gets a row).
    eval_every: validation period in steps (0: only at the end); eval_batches per evaluation.
    checkpoint_every: checkpoint period in steps (0: only at the end); keep_checkpoints newest
        are kept.
    max_consecutive_skips: stop the run (`RunDiverged`) when this many steps in a row were
        skipped for a non-finite loss or gradient (0: never stop).
    fast_compile: compile the steps with XLA's cheapest optimisation (about half the compile
        time, about twice the step time on CPU): for smoke runs and tests.
    loss_chunk_tokens: run the LM head and the loss in chunks of this many positions, never
        holding the [batch, seq_len, vocab] logits (`train.step.chunked_lm_head_nll`); None: the
        full logits. The same loss and gradients up to float32 rounding.
    progress: show the progress bar.
    """

    model: ModelConfig = dataclasses.field(default_factory=lambda: preset("tiny"))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    steps: int = 300
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 8
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_consecutive_skips: int = 10
    fast_compile: bool = False
    loss_chunk_tokens: int | None = None
    progress: bool = True

    def __post_init__(self):
        for name, low in (("steps", 1), ("seed", 0), ("log_every", 1), ("eval_every", 0),
                          ("eval_batches", 1), ("checkpoint_every", 0),
                          ("keep_checkpoints", 1), ("max_consecutive_skips", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"TrainConfig.{name} must be at least {low}, got "
                                 f"{getattr(self, name)}")
        if self.loss_chunk_tokens is not None:
            check_chunk_tokens(self.loss_chunk_tokens,
                               "TrainConfig.loss_chunk_tokens (or None: the full logits)")
        if self.model.vocab_size < VOCAB_SIZE:
            raise ValueError(
                f"TrainConfig.model.vocab_size={self.model.vocab_size} cannot hold the byte "
                f"vocabulary (train.tokenizer.VOCAB_SIZE = {VOCAB_SIZE}); use at least that"
            )
        check_model_fits(self.model, self.data)


class RunDiverged(RunStopped):
    """Training cannot usefully go on: a step left a non-finite state, or too many steps in a
    row were skipped. The newest checkpoint is the last good state."""


@dataclasses.dataclass
class Trainer:
    """A built run: the split train state on a mesh and its jitted steps.

    graphdef, state: the split `TrainState` (state is replaced by each step).
    """

    config: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    state: nnx.State
    shardings: nnx.State

    @classmethod
    def create(cls, config: TrainConfig, *, abstract: bool = False) -> "Trainer":
        """Initialises the model and optimizer directly in their shards on the mesh; with
        `abstract`, only their shapes and shardings (enough to compile the step, nothing
        allocated)."""
        mesh = make_mesh(**dataclasses.asdict(config.mesh), devices=config.mesh.devices())

        def build() -> TrainState:
            model = HybridLM(config.model, rngs=nnx.Rngs(config.seed))
            params = nnx.state(model, nnx.Param)
            tx = make_optimizer(config.optim, params, config.steps, stacked_axes(model))
            return TrainState(model, tx)

        graphdef, shapes = nnx.split(nnx.eval_shape(build))
        shardings = state_shardings(shapes, mesh)
        if abstract:
            return cls(config, mesh, graphdef, abstract_like(shapes, shardings), shardings)
        with jax.set_mesh(mesh):
            # Initialisation runs once: optimising its program would cost more than it saves.
            state = jax.jit(lambda: nnx.state(build()), out_shardings=shardings,
                            compiler_options=FAST_COMPILE_OPTIONS)()
        return cls(config, mesh, graphdef, state, shardings)

    @property
    def model(self) -> HybridLM:
        """The model of the current state (shares its arrays)."""
        return nnx.merge(self.graphdef, self.state).model

    def place(self, batch: dict[str, np.ndarray], *, process_rows: bool = False
              ) -> dict[str, jax.Array]:
        """A host batch on the mesh: arrays of B rows ([B, T], or [B] as RL's `truncated`) split
        over the batch axes, others (RL's rewards [P, G]) replicated. With several processes the
        batch is the global one, the same in each, and each places only its devices' shards;
        with `process_rows` it is this process's rows [B / P, T] of the global batch, the
        processes' rows in process order (`train.distributed.process_rows_array`)."""
        rows = np.shape(batch["tokens"])[0]
        replicated = NamedSharding(self.mesh, PartitionSpec())
        scale = jax.process_count() if process_rows else 1

        def place_one(value):
            shape = np.shape(value)
            if shape[:1] != (rows,):
                return global_batch_array(value, replicated)
            sharding = batch_sharding(self.mesh, (rows * scale, *shape[1:]))
            if process_rows:
                return process_rows_array(value, sharding)
            return global_batch_array(value, sharding)

        return {key: place_one(value) for key, value in batch.items()}

    @property
    def compiler_options(self) -> dict | None:
        return FAST_COMPILE_OPTIONS if self.config.fast_compile else None

    @functools.cached_property
    def train_step(self):
        tau = self.config.optim.qk_clip_tau if self.config.optim.qk_clip else None
        return make_train_step(self.graphdef, qk_clip_tau=tau,
                               loss_chunk_tokens=self.config.loss_chunk_tokens,
                               state_shardings=self.shardings,
                               compiler_options=self.compiler_options)

    @functools.cached_property
    def eval_step(self):
        return make_eval_step(self.graphdef, loss_chunk_tokens=self.config.loss_chunk_tokens,
                              compiler_options=self.compiler_options)

    def step(self, batch: dict[str, np.ndarray], *, process_rows: bool = False
             ) -> dict[str, jax.Array]:
        """One training step on a host batch (this process's rows of it with `process_rows`,
        see `place`); returns its metrics (device arrays)."""
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.train_step(self.state,
                                                  self.place(batch, process_rows=process_rows))
        return metrics

    def evaluate(self, data: DataConfig, max_batches: int) -> dict[str, float]:
        """Validation loss (nats per byte) and bits per byte over the first `max_batches`
        validation batches of `data`'s shape."""
        nll = targets = 0.0
        with jax.set_mesh(self.mesh):
            for batch in make_eval_iterator(data, max_batches=max_batches):
                out = self.eval_step(self.state, self.place(batch))
                nll += float(out["nll"])
                targets += float(out["targets"])
        return {"val_loss": nll / targets, "val_bits_per_byte": bits_per_byte(nll, targets)}

    def task_accuracy(
        self, task: Task, *, seq_len: int, batch_size: int, num_batches: int
    ) -> dict[str, float]:
        """Answer accuracy (token and exact match) on held-out examples of a synthetic task."""
        return self.answer_accuracy(make_task_batches(
            task, seq_len=seq_len, batch_size=batch_size, num_batches=num_batches
        ))

    def answer_accuracy(self, batches) -> dict[str, float]:
        """Answer accuracy (`train.synthetic.answer_accuracy`) over `batches` (random access:
        `len`, `batches[i]`) of one example a row: a synthetic task's (`make_task_batches`) or
        an image task's (`train.multimodal.make_image_task_batches`)."""
        predictions, targets, masks = [], [], []
        with jax.set_mesh(self.mesh):
            for index in range(len(batches)):
                batch = batches[index]
                out = self.eval_step(self.state, self.place(batch))
                predictions.append(to_host(out["predictions"]))
                targets.append(batch["targets"])
                masks.append(batch["loss_mask"])
        return answer_accuracy(*(np.concatenate(parts) for parts in (predictions, targets, masks)))


@dataclasses.dataclass
class RunResult:
    """What `train` returns: the trainer (model and state), the summary, the run folder."""

    trainer: Trainer
    summary: dict
    run_dir: str

    @property
    def model(self) -> HybridLM:
        return self.trainer.model


def _differences(saved, current, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON configs."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [
            difference
            for key in sorted(set(saved) | set(current))
            for difference in _differences(saved.get(key), current.get(key), f"{prefix}{key}.")
        ]
    return [] if saved == current else [prefix[:-1]]


def _folder_problem(path: str, error: OSError) -> str:
    """Why `path` cannot be a run folder, in words, from the OSError that said so."""
    if isinstance(error, FileExistsError) or (os.path.exists(path) and not os.path.isdir(path)):
        return "it is a file, not a folder"
    if isinstance(error, NotADirectoryError):
        parent = os.path.dirname(os.path.abspath(path))
        while parent != os.path.dirname(parent) and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if os.path.exists(parent) and not os.path.isdir(parent):
            return f"{parent!r} is not a folder"
    return error.strerror or str(error)


def _check_writable(run_dir: str, create: bool) -> None:
    """Creates `run_dir` (with `create`) and probes that it and its checkpoint folder take new
    files, so that a folder that cannot be written fails now, in one line, rather than in a
    background checkpoint write later.

    Raises an OSError of the failure's kind (PermissionError, NotADirectoryError, ...) whose
    message names the folder and the reason.
    """
    for folder in (run_dir, os.path.join(run_dir, CHECKPOINT_DIR)):
        if folder != run_dir and not os.path.isdir(folder):
            continue  # created by the checkpointer, in a folder just shown to be writable
        try:
            if create:
                os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            fix = ("choose another --out or make it writable"
                   if isinstance(error, PermissionError) or error.errno == errno.EROFS
                   else "choose another --out")
            role = "as the run folder" if folder == run_dir else "for the run's checkpoints"
            raise type(error)(
                f"cannot use {folder!r} {role}: {_folder_problem(folder, error)}; {fix}"
            ) from error


def _saved_config(run_dir: str, config_path: str) -> tuple[dict, int | None]:
    """The run's config.json and None; when it is missing, the config stored in the newest
    checkpoint whose metadata reads, and that checkpoint's step (`_prepare_run_dir` writes
    it back, with a warning).

    Raises ValueError when neither is there.
    """
    if os.path.exists(config_path):
        return read_json(config_path), None
    checkpointer = Checkpointer(os.path.join(run_dir, CHECKPOINT_DIR))
    try:
        for step in sorted(checkpointer.all_steps(), reverse=True):
            try:
                meta = checkpointer.metadata(step)
            except CheckpointError:
                continue  # the full restore later names what is wrong with it
            if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
                saved = meta["config"]
                break
        else:
            raise ValueError(
                f"--resume: {config_path} is missing and no checkpoint of {run_dir!r} holds the "
                "run's config; restore config.json, or start a new run with another --out"
            )
    finally:
        checkpointer.close()
    return saved, step


def _prepare_run_dir(config: TrainConfig, run_dir: str, resume: bool) -> dict:
    """Creates or checks the run folder; returns the config as JSON.

    Raises ValueError for a run folder that does not fit (no checkpoint to resume, checkpoints
    of another run, a changed config), and an OSError naming the folder when it cannot be
    created or written (`_check_writable`).
    """
    config_json = json.loads(json.dumps(config_dict(config)))  # tuples become lists
    config_path = os.path.join(run_dir, "config.json")
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    has_checkpoints = os.path.isdir(checkpoints) and any(
        name.isdigit() for name in os.listdir(checkpoints)
    )
    if resume:
        if not has_checkpoints:
            raise ValueError(
                f"--resume: {run_dir!r} holds no complete checkpoint to continue from; run "
                "without --resume to start it"
            )
        _check_writable(run_dir, create=False)
        saved, from_step = _saved_config(run_dir, config_path)
        changed = [key for key in _differences(saved, config_json) if key not in RUNTIME_FIELDS]
        if changed:
            raise ValueError(
                f"--resume: the config differs from the one {run_dir!r} was started with (in "
                f"{changed}); resume with the same settings, or start a new run with another --out"
            )
        sync("run folder checked")  # every process has read the folder before process 0 writes
        if from_step is not None and is_primary():
            with open(config_path, "w") as f:
                json.dump(saved, f, indent=2)
            warnings.warn(f"--resume: {config_path} was missing; rewrote it from the config "
                          f"stored in checkpoint step {from_step}", stacklevel=3)
        return config_json
    if has_checkpoints:
        raise ValueError(
            f"{run_dir!r} already holds checkpoints of a run; pass --resume to continue it or "
            "choose another --out"
        )
    _check_writable(run_dir, create=True)
    sync("run folder checked")
    if is_primary():
        with open(config_path, "w") as f:
            json.dump(config_json, f, indent=2)
        for stale in (METRICS_FILE, "summary.json"):
            if os.path.exists(os.path.join(run_dir, stale)):
                os.remove(os.path.join(run_dir, stale))
    return config_json


def _data_changes(saved: dict, current: dict) -> list[str]:
    """How the data of manifest `current` differs from the `saved` one, one phrase per changed
    file (name and old -> new sha256 prefixes), or per corpus without per-file hashes; [] when
    the corpus hash is the same."""
    if saved.get("corpus_sha256") == current["corpus_sha256"]:
        return []
    old, new = saved.get("files"), current.get("files")
    if isinstance(old, dict) and isinstance(new, dict):
        changes = []
        for name in sorted(set(old) | set(new)):
            before, after = old.get(name), new.get(name)
            if before != after:
                changes.append(f"{name} (sha256 {str(before)[:12]} -> {str(after)[:12]})")
        if changes:
            return changes
    return [f"corpus {saved.get('corpus')!r} -> {current['corpus']!r} (sha256 "
            f"{str(saved.get('corpus_sha256'))[:12]} -> {current['corpus_sha256'][:12]})"]


def _check_data(run_dir: str, manifest: dict, resume: bool,
                allow_data_change: bool) -> tuple[dict | None, bool]:
    """On resume, compares the data with the run's saved manifest; returns (the saved manifest
    or None, whether the data changed).

    Raises ValueError naming each changed file, unless `allow_data_change` (then it warns).
    """
    path = os.path.join(run_dir, MANIFEST_FILE)
    if not resume:
        return None, False
    if not os.path.exists(path):
        warnings.warn(f"--resume: {path} is missing, so the data cannot be compared with what "
                      "the run started on; recording the current data", stacklevel=3)
        return None, False
    saved = read_json(path)
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: expected a JSON object (the data manifest), got "
                         f"{type(saved).__name__}; repair the file or move it away")
    changes = _data_changes(saved, manifest)
    if not changes:
        return saved, False
    what = (f"the training data changed since {run_dir!r} was started: {'; '.join(changes)}")
    if not allow_data_change:
        raise ValueError(
            f"--resume: {what}. The earlier steps and validations were on the old data; restore "
            "the files, start a new run with another --out, or pass --allow-data-change "
            "(train(..., allow_data_change=True)) to continue on the new data"
        )
    warnings.warn(f"--resume: {what}; continuing on the new data (--allow-data-change); the "
                  f"old manifest is kept in {MANIFEST_FILE}'s history", stacklevel=3)
    return saved, True


def _write_manifest(run_dir: str, manifest: dict, saved: dict | None, changed: bool,
                    start: int) -> None:
    """Writes data_manifest.json: `manifest`, with the saved manifest's `history`, plus the saved
    manifest itself (and the step it was replaced at) when the data `changed`."""
    history = list(saved.get("history", [])) if saved else []
    if changed:
        history.append({**{k: v for k, v in saved.items() if k != "history"},
                        "replaced_at_step": start})
    record = {**manifest, **({"history": history} if history else {})}
    with open(os.path.join(run_dir, MANIFEST_FILE), "w") as f:
        json.dump(record, f, indent=2)


def _warn_damaged(resumed: Resumed) -> None:
    """Warns, naming each damaged checkpoint, its cause and where it went, and the step that
    the run resumes from instead."""
    if not resumed.damaged:
        return
    damaged = " ".join(f"{error} (moved aside to {moved_to})." for error, moved_to in
                       resumed.damaged)
    warnings.warn(f"--resume: {len(resumed.damaged)} damaged checkpoint(s) set aside: {damaged} "
                  f"Resuming from step {resumed.step}, the newest intact checkpoint.",
                  stacklevel=3)


def _truncate_metrics(path: str, last_step: int) -> None:
    """Drops rows logged after `last_step` (a run killed after its last checkpoint)."""
    if not os.path.exists(path):
        return
    rows = [row for row in read_metrics(path) if row["step"] <= last_step]
    os.remove(path)
    MetricsWriter(path).write(rows)


def check_health(rows: list[dict], skips_in_a_row: int, max_skips: int,
                 last_saved: int | None) -> int:
    """The number of consecutive skipped steps after `rows` (metrics rows of consecutive steps,
    continuing a run that had `skips_in_a_row`).

    Raises RunDiverged when a row's step left a non-finite state (`nonfinite_state`), or when
    `max_skips` (> 0) steps in a row were skipped. last_saved: the newest checkpoint's step,
    named in the message as the state to go back to.
    """
    kept = (f"the newest checkpoint (step {last_saved}) holds the last good state"
            if last_saved else "no checkpoint was written")
    for row in rows:
        if row.get("nonfinite_state"):
            raise RunDiverged(
                f"step {row['step']} left a non-finite parameter or optimizer value (loss "
                f"{row['loss']:.4g}, gradient norm {row['grad_norm']:.4g}, learning rate "
                f"{row['learning_rate']:.4g}): its update overflowed float32. The run stops "
                f"without saving that state; {kept}. Start again with a lower "
                "optim.learning_rate"
            )
        skips_in_a_row = skips_in_a_row + 1 if row["skipped"] else 0
        if max_skips and skips_in_a_row >= max_skips:
            raise RunDiverged(
                f"{skips_in_a_row} steps in a row, up to step {row['step']}, were skipped for a "
                f"non-finite loss or gradient (last loss {row['loss']:.4g}); {kept}. Check the "
                "data and the learning rate, or raise max_consecutive_skips (0: never stop)"
            )
    return skips_in_a_row


class ProcessShareIterator:
    """This process's rows of the training batches of `data` (`train.data.make_train_iterator`
    with the run's process index and count), with the run's state: `get_state` gathers every
    process's position into the one-process iterator's state (all processes call it together,
    as a checkpoint save does) and `set_state` takes such a state, so a checkpoint restores
    under any process count that divides data.shards."""

    def __init__(self, data: DataConfig):
        self.data = data
        self._share = dict(process_index=jax.process_index(), process_count=jax.process_count())
        self._iterator = make_train_iterator(data, **self._share)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict:
        return global_data_state(self.data, gather_json(self._iterator.get_state()))

    def set_state(self, state: dict) -> None:
        self._iterator.set_state(process_data_state(self.data, state, **self._share))


def train_iterator(data: DataConfig):
    """The endless training iterator of `data`: text and images for a MultimodalDataConfig
    (`train.multimodal`, the whole batch in every process), otherwise this process's rows of
    the text batches (`ProcessShareIterator`)."""
    if isinstance(data, MultimodalDataConfig):
        return make_multimodal_iterator(data)
    return ProcessShareIterator(data)


class Stopwatch:
    """Wall time since the last restart, and the step it was restarted at."""

    def __init__(self):
        self._step, self._since = 0, time.perf_counter()

    def restart(self, step: int) -> float:
        """Restarts at `step`; returns the seconds since the previous restart."""
        now = time.perf_counter()
        elapsed = now - self._since
        self._step, self._since = step, now
        return elapsed

    def steps_per_second(self, step: int) -> float:
        return (step - self._step) / max(time.perf_counter() - self._since, 1e-9)


def _format_rate(tokens_per_second: float, flops_per_token: float, peak: float | None) -> dict:
    model_flops = tokens_per_second * flops_per_token
    rates = {"tok/s": f"{tokens_per_second:,.0f}"}
    if peak is None:
        rates["TFLOP/s"] = f"{model_flops / 1e12:.3g}"
    else:
        rates["MFU"] = f"{100 * model_flops / peak:.1f}%"
    return rates


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stretch of training on one data config; staged context extension changes the sequence
    length and mix between stages. steps: optimizer steps of this stage."""

    data: DataConfig
    steps: int

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"Stage.steps must be at least 1, got {self.steps}")


StageHook = Callable[[int, Stage, Trainer], dict]


def train(
    config: TrainConfig,
    run_dir: str,
    *,
    resume: bool = False,
    until_step: int | None = None,
    stages: Sequence[Stage] | None = None,
    after_stage: StageHook | None = None,
    allow_data_change: bool = False,
) -> RunResult:
    """Runs (or continues) training to `config.steps`, or only to `until_step` (a checkpoint is
    saved there, so a job with a time limit can stop and be resumed; the schedule still spans
    config.steps).

    stages: consecutive stages whose steps add up to config.steps (default: one stage on
        config.data). Each stage ends with an evaluation on its own data and a checkpoint.
    after_stage: called as after_stage(index, stage, trainer) when a stage ends; the dict it
        returns is logged as a metrics row (with `step` and `stage`) and kept in the summary.
    allow_data_change: resume even though the data changed since the run started (see the
        module docstring); without it such a resume is refused.

    Raises ValueError for stages that do not add up, a run folder that does not fit (see
    `_prepare_run_dir`), or changed data; an OSError naming the folder when it cannot be
    written; a CheckpointError (a ValueError) when resuming finds no intact checkpoint, or a
    checkpoint cannot be written.
    """
    initialize()  # joins a multi-process run launched with JAX_NUM_PROCESSES etc. set
    stages = tuple(stages or (Stage(config.data, config.steps),))
    ends = np.cumsum([stage.steps for stage in stages])
    if ends[-1] != config.steps:
        raise ValueError(
            f"the stages' steps add up to {ends[-1]}, but config.steps={config.steps}; make them "
            "agree"
        )
    if until_step is not None and not 1 <= until_step <= config.steps:
        raise ValueError(f"until_step must lie in [1, steps={config.steps}], got {until_step}")
    stop = config.steps if until_step is None else until_step
    manifests = [data_manifest(stage.data) for stage in stages]  # missing files fail here
    config_json = _prepare_run_dir(config, run_dir, resume)
    saved_manifest, data_changed = _check_data(run_dir, manifests[0], resume, allow_data_change)

    trainer = Trainer.create(config)
    checkpointer = Checkpointer(
        os.path.join(run_dir, CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints
    )
    metrics_path = os.path.join(run_dir, METRICS_FILE)

    def stage_of(step: int) -> int:
        """Index of the stage that runs `step` (1-based)."""
        return int(np.searchsorted(ends, step))

    # The iterator of the stage that was running; a checkpoint that ends a stage is followed by
    # a fresh iterator of the next stage (in the loop below).
    def iterator_at(step: int):
        return train_iterator(stages[stage_of(max(step, 1))].data)

    start = 0
    if resume:
        resumed = checkpointer.restore_newest_intact(
            abstract_like(trainer.state, trainer.shardings), iterator_at)
        _warn_damaged(resumed)
        start, trainer.state, data_iterator = resumed.step, resumed.state, resumed.data_iterator
        if is_primary():
            _truncate_metrics(metrics_path, start)
    else:
        data_iterator = iterator_at(start)
    stage_index = stage_of(max(start, 1))
    primary = is_primary()  # writes the files, metrics rows and progress bar of the run
    if primary:
        _write_manifest(run_dir, manifests[0], saved_manifest, data_changed, start)
    writer = MetricsWriter(metrics_path)

    def log(rows: list[dict]) -> None:
        if primary:
            writer.write(rows)

    schedule = learning_rate_schedule(config.optim, config.steps)
    peak = peak_flops_per_device()
    peak = None if peak is None else peak * trainer.mesh.size
    bar = tqdm.tqdm(total=config.steps, initial=start, disable=not (config.progress and primary),
                    unit="step", dynamic_ncols=True)
    pending: list[tuple[int, dict]] = []  # metrics of steps not yet written (device arrays)
    clock = Stopwatch()
    first_step_seconds = None
    skips_in_a_row, last_saved = 0, start or None

    def write_pending(**extra) -> dict:
        """Fetches and writes the pending steps' rows (`extra` goes into the last one); stops
        the run when they show it diverged (`check_health`)."""
        nonlocal skips_in_a_row
        rows = [
            {"step": step, "learning_rate": float(schedule(step - 1)),
             **{k: np.asarray(v).tolist() for k, v in metrics.items()}}
            for step, metrics in jax.device_get(pending)
        ]
        pending.clear()
        if rows:
            rows[-1].update(extra)
            log(rows)
        try:
            skips_in_a_row = check_health(rows, skips_in_a_row, config.max_consecutive_skips,
                                          last_saved)
        except RunDiverged:
            bar.close()
            checkpointer.close()  # lets the saves already started finish
            raise
        return rows[-1] if rows else {}

    for step in range(start + 1, stop + 1):
        if stage_of(step) != stage_index:
            stage_index = stage_of(step)
            data_iterator = train_iterator(stages[stage_index].data)
        stage = stages[stage_index]
        tokens_per_step = stage.data.batch_size * stage.data.seq_len
        pending.append((step, trainer.step(
            next(data_iterator), process_rows=isinstance(data_iterator, ProcessShareIterator))))
        if len(pending) > 1:
            # One step in flight at a time: the device stays busy and the bar stays truthful.
            jax.block_until_ready(pending[-2][1])
        if step == start + 1:  # the first step compiles; time it apart
            write_pending()
            first_step_seconds = clock.restart(step)
        elif step % config.log_every == 0 or step == stop:
            jax.block_until_ready(pending[-1][1])
            rates = {"tokens_per_second": clock.steps_per_second(step) * tokens_per_step}
            last = write_pending(**rates)
            flops = train_flops_per_token(config.model, stage.data.seq_len)["total"]
            bar.set_postfix({"loss": f"{last['loss']:.3f}",
                             **_format_rate(rates["tokens_per_second"], flops, peak)})
            clock.restart(step)
        bar.update(1)
        stage_ends = step == ends[stage_index]
        evaluated = step == stop or stage_ends or (
            config.eval_every and step % config.eval_every == 0)
        if evaluated:
            write_pending()
            result = trainer.evaluate(stage.data, config.eval_batches)
            log([{"step": step, "seq_len": stage.data.seq_len, **result}])
            if primary:
                bar.write(f"step {step}: validation {result['val_bits_per_byte']:.3f} bits/byte "
                          f"at length {stage.data.seq_len}")
        if stage_ends and after_stage is not None:
            result = after_stage(stage_index, stage, trainer)
            log([{"step": step, "stage": stage_index, **result}])
        saved = step == stop or stage_ends or (
            config.checkpoint_every and step % config.checkpoint_every == 0)
        if saved:
            write_pending()
            checkpointer.save(step, trainer.state, data_iterator,
                              metadata={"config": config_json})
            last_saved = step
        if evaluated or saved:
            clock.restart(step)  # keep evaluation and checkpointing out of tokens/s
    bar.close()
    checkpointer.wait()
    checkpointer.close()
    summary_path = os.path.join(run_dir, "summary.json")
    if not primary:  # process 0 writes the summary into the shared run folder
        sync("summary written")
        return RunResult(trainer, read_json(summary_path), run_dir)

    rows = read_metrics(metrics_path)
    evaluations = [row for row in rows if "val_bits_per_byte" in row]
    train_rows = [row for row in rows if "loss" in row]
    last_stage = stages[stage_of(stop)].data
    summary = {
        "steps": stop,
        "tokens_seen": int(sum(
            min(stage.steps, max(stop - (end - stage.steps), 0))
            * stage.data.batch_size * stage.data.seq_len
            for stage, end in zip(stages, ends)
        )),
        "final_train_loss": train_rows[-1]["loss"] if train_rows else math.nan,
        "val_bits_per_byte": evaluations[-1]["val_bits_per_byte"] if evaluations else math.nan,
        "val_unigram_bits_per_byte": manifests[0]["validation_unigram_bits_per_byte"],
        "skipped_steps": int(train_rows[-1]["skipped_steps"]) if train_rows else 0,
        "first_step_seconds": first_step_seconds,
        "tokens_per_second": next(  # of this session (None if it trained no step)
            (row["tokens_per_second"] for row in reversed(train_rows)
             if "tokens_per_second" in row and row["step"] > start), None),
        "train_flops_per_token": train_flops_per_token(config.model, last_stage.seq_len)["total"],
        "corpus": manifests[0]["corpus"],
        "corpus_sha256": manifests[0]["corpus_sha256"],
    }
    stage_rows = [row for row in rows if "stage" in row]
    if stage_rows:
        summary["stages"] = stage_rows
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    sync("summary written")
    plot_metrics(metrics_path, run_dir)
    return RunResult(trainer, summary, run_dir)
