"""train.cli and the experiments' command lines: typed --set overrides, clear refusals."""

import subprocess
import sys

import pytest

from experiments import quickstart
from train.cli import apply_overrides, parse_value
from train.loop import TrainConfig


@pytest.mark.parametrize(
    "text, annotation, expected",
    [
        ("3", int, 3),
        ("1e-3", float, 1e-3),
        ("2", float, 2.0),
        ("True", bool, True),
        ("off", bool, False),
        ("none", float | None, None),
        ("0.5", float | None, 0.5),
        ("muon", "Literal", "muon"),
        ("none", "Literal | None", "none"),  # the choice, not None
        ("null", "Literal | None", None),
        ("a.txt, b.jsonl", tuple[str, ...], ("a.txt", "b.jsonl")),
        ("", tuple[int, ...], ()),
        ("1,2", tuple[int, ...], (1, 2)),
    ],
)
def test_values_are_read_by_type(text, annotation, expected):
    from typing import Literal

    if annotation == "Literal":
        annotation = Literal["adamw", "muon"]
    if annotation == "Literal | None":
        annotation = Literal["none", "filter"] | None
    assert parse_value(text, annotation) == expected


def test_nested_fields_change_together():
    config = apply_overrides(TrainConfig(), [
        "model.num_layers=2", "model.kda_layers=1", "model.full_attn_layers=2",
        "model.moe.top_k=1", "model.moe.token_chunk=65536", "optim.optimizer=muon",
        "optim.clip_norm=none",
        "data.paths=notes.txt", "steps=7", "steps=9",
    ])
    assert (config.model.num_layers, config.model.kda_layers) == (2, (1,))
    assert config.model.moe.top_k == 1 and config.model.moe.token_chunk == 65536
    assert config.optim.optimizer == "muon" and config.optim.clip_norm is None
    assert config.data.paths == ("notes.txt",)
    assert config.steps == 9  # the last assignment wins
    assert TrainConfig().steps != 9  # the default is untouched


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("steps", "not of the form key=value"),
        ("=3", "not of the form key=value"),
        ("stepz=3", "unknown setting 'stepz'.*fields are"),
        ("optim.lr=3", "unknown setting 'optim.lr'"),
        ("steps.x=3", "no fields"),
        ("steps=many", "steps='many': expected an integer"),
        ("optim.optimizer=sgd", r"expected one of \['adamw', 'muon'\]"),
        ("optim.learning_rate=-1", "learning_rate must be > 0"),
        ("model.moe=small", "group of settings"),
        ("model.moe.token_chunk=0", "MoEConfig.token_chunk=0 is invalid"),
        ("progress=maybe", "expected a boolean"),
        ("model.num_layers=2", "kda_layers"),  # the model config's own check
    ],
)
def test_bad_overrides_are_refused_with_a_reason(assignment, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(TrainConfig(), [assignment])


def test_quickstart_refuses_unknown_and_invalid_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        quickstart.parse_args(["--stepz", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --stepz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--set", "optim.optimizer=sgd"])
    assert "--set optim.optimizer='sgd': expected one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--preset", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_quickstart_options_reach_the_config(tmp_path):
    args, config = quickstart.parse_args([
        "--out", str(tmp_path), "--resume", "--set", "steps=5", "--data", "a.txt", "b.jsonl",
    ])
    assert args.out == str(tmp_path) and args.resume
    assert config.steps == 5 and config.data.paths == ("a.txt", "b.jsonl")


def test_quickstart_help_lists_the_options():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.quickstart", "--help"],
        capture_output=True, text=True, check=True,
    )
    for option in ("--set KEY=VALUE", "--out DIR", "--resume", "--preset", "--data",
                   "--print-config"):
        assert option in result.stdout


def test_quickstart_refuses_missing_data_files(tmp_path, capsys):
    missing = str(tmp_path / "absent.txt")
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(["--out", str(tmp_path / "run"), "--data", missing])
    assert exit_info.value.code == 2
    assert f"data file {missing!r} does not exist" in capsys.readouterr().err
