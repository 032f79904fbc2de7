"""A trained model for inference: the model part of a run's checkpoint alone, on any mesh, in bf16.

    model, config = load_model("runs/quickstart")        # newest checkpoint, one device, bf16
    logits = model(tokens)                               # [B, T, vocab]
    generate(model, prompts, max_new_tokens=32)          # models.generate

Only the model's variables are read (parameters and router biases: no optimizer moments, no data
iterator), placed by the logical-axis rules on the mesh given, whatever mesh the run trained on,
and checked against the checkpoint's checksums. The model config is the one stored in the
checkpoint (the run folder's config.json is not needed). Parameters are cast to `dtype` after
the check (the checksums are of the saved float32 arrays); router biases keep float32, since a
rounded bias could change which experts a token picks.
"""

import os

import jax
import jax.numpy as jnp
from flax import nnx

from core.sharding import make_mesh, state_shardings
from models.config import ModelConfig
from models.lm import HybridLM
from train.checkpoint import Checkpointer, abstract_like
from train.cli import config_from_dict
from train.loop import CHECKPOINT_DIR


def load_model(
    run_dir: str,
    *,
    step: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    dtype: str | None = "bfloat16",
) -> tuple[HybridLM, ModelConfig]:
    """The model of checkpoint `step` (default: the newest) of the run in `run_dir`, and its
    config.

    mesh: where to place the parameters (default: the first device alone).
    dtype: floating parameters are cast to it; None keeps the stored dtype (float32).
    Raises FileNotFoundError naming the folder when it holds no checkpoint, and
    `train.checkpoint.CheckpointError` when the checkpoint cannot be read back as saved.
    """
    directory = os.path.join(run_dir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{run_dir!r} holds no {CHECKPOINT_DIR}/ folder: pass the --out "
                                "folder of a training run that saved a checkpoint")
    checkpointer = Checkpointer(directory)
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        config = config_from_dict(ModelConfig, checkpointer.metadata(step)["config"]["model"])
        mesh = mesh or make_mesh(devices=jax.devices()[:1])
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0))))
        shardings = state_shardings(shapes, mesh)
        state = checkpointer.restore_model(abstract_like(shapes, shardings), step)
    finally:
        checkpointer.close()
    if dtype is not None:
        state = cast_params(state, dtype)
    return nnx.merge(graphdef, state), config


def cast_params(state: nnx.State, dtype: str) -> nnx.State:
    """`state` with its floating parameters (`nnx.Param`) cast to `dtype` on their devices; other
    variables (router biases) keep their dtype."""
    params, rest = nnx.split_state(state, nnx.Param, ...)
    cast = jax.jit(lambda tree: jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree))
    return nnx.merge_state(cast(params), rest)
