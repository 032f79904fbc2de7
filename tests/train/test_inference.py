"""train.inference.load_model: a training checkpoint's model alone gives the trained model's
logits, in float32 exactly, in bf16 within bf16 rounding, on another mesh; damage is refused."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.sharding import make_mesh
from experiments.harness import relative_error
from tests.train.small_run import SMALL_RUN, small_run
from train.checkpoint import CheckpointError
from train.cli import config_dict, config_from_dict
from train.inference import load_model
from train.loop import CHECKPOINT_DIR, TrainConfig, train

TOKENS = (jnp.arange(64, dtype=jnp.int32).reshape(2, 32) * 7) % 256


@jax.jit
def logits(model) -> jax.Array:
    """The model's logits on TOKENS, as one compiled program (not op by op)."""
    return model(TOKENS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, config, the trained model's logits on TOKENS) of a two-step run."""
    config, stages = small_run(SMALL_RUN, [(32, 2, 2)])
    run_dir = str(tmp_path_factory.mktemp("inference") / "run")
    result = train(config, run_dir, stages=stages)
    return run_dir, config, np.asarray(logits(result.model))


def test_config_round_trips_through_json():
    config = TrainConfig()
    assert config_from_dict(TrainConfig, json.loads(json.dumps(config_dict(config)))) == config
    with pytest.raises(ValueError, match=r"TrainConfig has no field\(s\) \['stepz'\]"):
        config_from_dict(TrainConfig, {"stepz": 3})


@pytest.mark.slow
def test_loaded_model_gives_the_trained_logits(trained):
    run_dir, config, expected = trained
    os.remove(os.path.join(run_dir, "config.json"))  # the checkpoint carries the config
    model, model_config = load_model(run_dir, dtype=None)
    assert model_config == config.model
    np.testing.assert_array_equal(np.asarray(logits(model)), expected)
    bf16, _ = load_model(run_dir)
    assert bf16.lm_head.kernel[...].dtype == jnp.bfloat16
    assert 0 < relative_error(np.asarray(logits(bf16)), expected) <= 2e-2


@pytest.mark.slow
def test_loaded_model_on_another_mesh(trained):
    run_dir, _, expected = trained
    model, _ = load_model(run_dir, dtype=None, mesh=make_mesh(fsdp=2, devices=jax.devices()[:2]))
    np.testing.assert_allclose(np.asarray(logits(model)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_missing_or_damaged_checkpoint_is_refused(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoints/ folder"):
        load_model(str(tmp_path))
    run_dir, _, _ = trained
    # Step 1's arrays under step 2's checksums: every file reads, the model's arrays differ.
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    shutil.rmtree(os.path.join(checkpoints, "2", "state"))
    shutil.copytree(os.path.join(checkpoints, "1", "state"), os.path.join(checkpoints, "2", "state"))
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 .*model array\(s\) differ"):
        load_model(run_dir, dtype=None)
    load_model(run_dir, step=1, dtype=None)  # step 1 itself is intact
