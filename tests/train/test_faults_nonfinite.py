"""Non-finite training: learning rates that are not finite positive float32 numbers are refused,
a step whose update overflows reports it, and the loop stops (without checkpointing the bad
state) on such a step or after too many skipped steps in a row."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.small_run import SMALL_RUN, small_run
from tests.train.toy_model import make_batch, split_state
from train.cli import apply_overrides, one_line_errors
from train.loop import CHECKPOINT_DIR, RunDiverged, TrainConfig, Trainer, check_health, train
from train.optim import OptimConfig
from train.step import FAST_COMPILE_OPTIONS, make_train_step


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e39", "0", "-0.001"])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused(value):
    with pytest.raises(ValueError, match="OptimConfig.learning_rate must be"):
        apply_overrides(TrainConfig(), [f"optim.learning_rate={value}"])


def test_every_float_hyperparameter_must_be_finite():
    for field in ("weight_decay", "eps", "clip_norm", "qk_clip_tau"):
        with pytest.raises(ValueError, match=f"OptimConfig.{field} must be a finite"):
            OptimConfig(**{field: math.inf})


def constant_rate_step(learning_rate: float):
    """(initial state, compiled step) of the toy model at a constant `learning_rate`."""
    graphdef, state = split_state(OptimConfig(learning_rate=learning_rate, warmup_steps=0,
                                              schedule="constant"))
    return state, make_train_step(graphdef, compiler_options=FAST_COMPILE_OPTIONS)


@pytest.fixture(scope="module")
def ordinary_step():
    """The toy model's step at an ordinary learning rate (3e-3), shared by two tests."""
    return constant_rate_step(3e-3)


@pytest.mark.slow
def test_an_update_that_overflows_float32_is_reported_by_the_step(ordinary_step):
    # Adam's first update is sign(g) exactly, so a learning rate at float32's top overflows
    # every parameter whose decayed update exceeds one: finite loss and gradients, inf weights.
    for learning_rate, overflows in ((3e-3, 0.0), (3.4e38, 1.0)):
        state, step = ordinary_step if learning_rate == 3e-3 else constant_rate_step(learning_rate)
        _, metrics = step(jax.tree.map(jnp.copy, state), make_batch())  # the step donates
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
        assert float(metrics["skipped"]) == 0.0
        assert float(metrics["nonfinite_state"]) == overflows, learning_rate


def test_a_skipped_step_does_not_report_a_non_finite_state(ordinary_step):
    state, step = ordinary_step
    poisoned = dict(make_batch(), loss_mask=make_batch()["loss_mask"].at[0, 3].set(jnp.nan))
    _, metrics = step(jax.tree.map(jnp.copy, state), poisoned)
    assert float(metrics["skipped"]) == 1.0 and float(metrics["nonfinite_state"]) == 0.0


def rows(*skipped, nonfinite_at=None):
    return [{"step": i + 1, "loss": math.nan if s else 2.0, "grad_norm": 1.0,
             "learning_rate": 1e-3, "skipped": float(s),
             "nonfinite_state": float(i + 1 == nonfinite_at)} for i, s in enumerate(skipped)]


def test_consecutive_skips_are_counted_across_calls_and_reset_by_a_good_step():
    assert check_health(rows(1, 1, 0, 1), 0, 3, None) == 1
    assert check_health(rows(1, 1), 1, 0, None) == 3  # 0: never stop
    with pytest.raises(RunDiverged, match=r"3 steps in a row, up to step 2.*checkpoint \(step 8\)"):
        check_health(rows(1, 1), 1, 3, 8)


def test_a_non_finite_state_stops_the_run_at_once():
    with pytest.raises(RunDiverged, match="step 2 left a non-finite.*no checkpoint was written"):
        check_health(rows(0, 0, 0, nonfinite_at=2), 0, 10, None)


@pytest.mark.slow
@pytest.mark.parametrize("fault, kept", [("nonfinite_state", [1, 2]), ("skipped", [2, 3])])
def test_a_diverged_run_stops_and_keeps_its_last_good_checkpoints(tmp_path, monkeypatch, fault,
                                                                   kept):
    """From step 3 on every step reports the fault. A non-finite state stops the run before its
    checkpoint; skipped steps keep the last good state, so step 3 is saved and the second skip
    in a row (step 4) stops the run."""
    config, stages = small_run([*SMALL_RUN, "steps=6", "keep_checkpoints=2",
                                "max_consecutive_skips=2"], [(32, 2, 6)])
    original_step, steps_run = Trainer.step, []

    def faulty_step(self, batch, **options):
        metrics = original_step(self, batch, **options)
        steps_run.append(len(steps_run) + 1)
        return {**metrics, fault: jnp.ones(())} if steps_run[-1] >= 3 else metrics

    monkeypatch.setattr(Trainer, "step", faulty_step)
    run_dir = str(tmp_path / "run")
    with pytest.raises(RunDiverged, match=rf"newest checkpoint \(step {kept[-1]}\)"):
        train(config, run_dir, stages=stages)
    saved = sorted(int(name) for name in os.listdir(os.path.join(run_dir, CHECKPOINT_DIR))
                   if name.isdigit())
    assert saved == kept and steps_run[-1] == (3 if fault == "nonfinite_state" else 4)


def test_the_command_line_reports_a_diverged_run_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped, one_line_errors():
        check_health(rows(1, 1), 0, 2, 4)
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: 2 steps in a row") and "(step 4)" in line
