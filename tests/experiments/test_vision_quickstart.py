"""`python -m experiments.vision_quickstart`: the gate's logic, and a short run of the experiment
whose model with images clearly beats the zeroed control on a three-colour task."""

import json
import os

import pytest

from experiments import vision_quickstart
from experiments.vision_quickstart import GATE_ACCURACY, chance, gate, gate_judged, table

CHANCE = chance(vision_quickstart.CONFIG.data)
PASSING = {"images": {"digits": 0.97, "colour": 1.0, "count": 0.3, "reading": 0.02},
           "zeroed": {"digits": 0.12, "colour": 0.17, "count": 0.2, "reading": 0.01},
           "shuffled": {"digits": 0.09, "colour": 0.2, "count": 0.2, "reading": 0.01}}


def with_value(run, task, value):
    return {**PASSING, run: {**PASSING[run], task: value}}


def test_the_gate_reads_both_gate_tasks_and_both_controls():
    assert CHANCE == {"digits": 0.1, "colour": 1 / 6, "count": 0.2, "reading": 1 / 90}
    assert gate(PASSING, CHANCE) == []
    assert gate(with_value("images", "digits", 0.94), CHANCE) == [
        f"digits with images 94.0% < {GATE_ACCURACY:.0%}"]
    assert gate(with_value("images", "count", 0.2), CHANCE) == []  # a stretch task
    assert gate(with_value("zeroed", "colour", 0.22), CHANCE) == [
        "colour zeroed 22.0% is more than 5% from chance 16.7%"]
    assert gate(with_value("shuffled", "digits", 0.04), CHANCE) == [
        "digits shuffled 4.0% is more than 5% from chance 10.0%"]
    assert gate_judged(PASSING)
    only_colour = {run: {"colour": scores["colour"]} for run, scores in PASSING.items()}
    assert gate(only_colour, CHANCE) == [] and not gate_judged(only_colour)
    assert gate({"images": PASSING["images"]}, CHANCE) == []
    assert not gate_judged({"images": PASSING["images"]})  # controls not run
    lines = table(PASSING, CHANCE, vision_quickstart.CONFIG.data).splitlines()
    assert lines[0] == "| task | held out | chance | images | zeroed | shuffled |"
    assert lines[2] == "| digits (gate) | 300 | 10.0% | 97.0% | 12.0% | 9.0% |"
    assert lines[5] == "| reading (stretch) | 300 | 1.1% | 2.0% | 1.0% | 1.0% |"


def test_print_config_prints_the_resolved_config_and_stops(capsys):
    with pytest.raises(SystemExit) as exit_info:
        vision_quickstart.main(["--print-config", "--set", "steps=7",
                                "--set", "data.vision_control=zeroed"])
    assert exit_info.value.code == 0
    config = json.loads(capsys.readouterr().out)
    assert config["steps"] == 7 and config["data"]["vision_control"] == "zeroed"
    assert config["model"]["vision"]["width"] == vision_quickstart.TOWER.width


# One decoder layer (KDA, dense FFN) and a one-block tower of width 16, 30 steps of 8 x 64 tokens,
# three colours only: a short run, one compile of each step shared by its two runs. (A Gated MLA
# layer in its place sees the colour as well but spells "green" worse in 60 steps; KDA's short
# convolution learns the spelling.)
SHORT_RUN = {
    "steps": 30, "log_every": 10, "checkpoint_every": 0, "eval_batches": 1,
    "progress": "false", "mesh.data": 1, "fast_compile": "true",
    "model.num_layers": 1, "model.kda_layers": 1, "model.full_attn_layers": "",
    "model.first_k_dense": 1,
    "model.vision.width": 16, "model.vision.num_layers": 1, "model.vision.num_heads": 2,
    "model.vision.head_dim": 8, "model.vision.mlp_hidden": 32,
    "data.seq_len": 64, "data.batch_size": 8, "data.image_patches": 16,
    "data.row_patches": 64, "data.packing_bins": 8, "data.corpus_weight": 0.1,
    "data.digits_weight": 0, "data.count_weight": 0, "data.reading_weight": 0,
    "data.colour.colours": 3, "data.colour.held_out": 48,
    "optim.learning_rate": 1e-2, "optim.warmup_steps": 5,
}


@pytest.mark.slow
def test_a_short_run_with_images_beats_the_zeroed_control(tmp_path, capsys):
    out = str(tmp_path / "vq")
    flags = [flag for key, value in SHORT_RUN.items() for flag in ("--set", f"{key}={value}")]
    summary = vision_quickstart.main(["--out", out, "--controls", "none", "zeroed", *flags])
    with_images = summary["runs"]["images"]["accuracy"]["colour"]
    zeroed = summary["runs"]["zeroed"]["accuracy"]["colour"]
    assert with_images >= 0.9 and zeroed <= 1 / 3 + 0.15, (with_images, zeroed)
    printed = capsys.readouterr().out
    assert "| colour (gate) | 48 | 33.3% |" in printed
    assert not summary["gate_passed"]  # digits and the shuffled control were not run
    for name in ("vision_quickstart.md", "accuracy.png", "summary.json",
                 "images/metrics.jsonl", "zeroed/checkpoints"):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["chance"] == {"colour": pytest.approx(1 / 3)}
