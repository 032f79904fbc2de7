"""experiments.context_extension: the curriculum's stages, its checks, and a tiny end-to-end run."""

import os

import pytest

from experiments import context_extension
from experiments.context_extension import ContextExtensionConfig, main, table
from train.synthetic import NeedleInHaystack


def test_stages_keep_tokens_per_step_and_shift_the_mix():
    config = ContextExtensionConfig()
    stages = config.stages()
    assert [stage.data.seq_len for stage in stages] == list(config.lengths)
    assert {stage.data.seq_len * stage.data.batch_size for stage in stages} == {
        config.tokens_per_step}
    biases = [stage.data.long_document_bias for stage in stages]
    assert biases == sorted(biases) and biases[-1] > biases[0]
    # The first stage trains on the tasks alone; the corpus joins later.
    assert [stage.data.corpus_weight for stage in stages] == list(config.corpus_weight)
    assert stages[0].data.corpus_weight == 0 and stages[-1].data.corpus_weight > 0
    assert config.train_config().steps == sum(config.stage_steps)
    assert config.train_config().data == stages[0].data


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(stage_steps=(1, 2)), "stage_steps has 2 entries for 3 stages"),
        (dict(corpus_weight=(1, 1, 1, 1)), "corpus_weight has 4 entries for 3 stages"),
        (dict(lengths=(1024, 256, 4096)), "increasing"),
        (dict(tokens_per_step=1000), "not a multiple"),
        (dict(eval_examples=0), "eval_examples"),
    ],
)
def test_inconsistent_curricula_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ContextExtensionConfig(**changes)


def test_table_has_a_row_per_stage_and_length():
    config = ContextExtensionConfig(lengths=(64, 128), tokens_per_step=128, stage_steps=(1, 1),
                                    corpus_weight=(1, 1), long_document_bias=(0, 0),
                                    mqar_weight=(0, 0), needle_weight=(0, 0), answer_weight=(1, 1),
                                    needle_depths=(0.5,))
    accuracy = {"exact_match": 0.25, "token_accuracy": 0.5}
    recall = {length: {"mqar": accuracy, "needle@0.5": accuracy} for length in ("64", "128")}
    text = table(config, [{"stage": 0, "recall": recall}, {"stage": 1, "recall": recall}])
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert lines[2] == "| 1 | 64 | 64 | 0.25 | 0.50 | 0.25 |"
    assert lines[5] == "| 2 | 128 | 128 | 0.25 | 0.50 | 0.25 |"


SMALL_MODEL = {
    "train.model.num_layers": "2", "train.model.kda_layers": "1",
    "train.model.full_attn_layers": "2", "train.eval_batches": "1",
    "train.fast_compile": "true", "train.progress": "false", "train.mesh.data": "1",
}


def _run(out: str, settings: dict) -> dict:
    return main(["--out", out, *[f"--set={key}={value}" for key, value in settings.items()]])


@pytest.mark.slow
def test_a_short_curriculum_learns_to_recall_and_writes_its_table(tmp_path, capsys):
    # Two layers (KDA, then MLA) trained on needles alone (" K=12." in random text) for 50
    # steps of 32 rows of 32 bytes, then 2 steps at 64 bytes, recall the digits far above
    # chance (a guess among the ten digits) at the first stage's length.
    needle = NeedleInHaystack(key_bytes=1, value_bytes=2)
    out = str(tmp_path / "run")
    summary = _run(out, {
        "lengths": "32,64", "tokens_per_step": "1024", "stage_steps": "50,2",
        "corpus_weight": "0,0", "long_document_bias": "0,0", "mqar_weight": "0,0",
        "needle_weight": "1,1",
        "answer_weight": "1,1", "mqar.num_kv_pairs": "2", "needle.key_bytes": "1",
        "needle.value_bytes": "2", "needle_depths": "0.5", "eval_examples": "32",
        "train.optim.learning_rate": "1e-2", "train.optim.warmup_steps": "5",
        "train.optim.schedule": "constant", **SMALL_MODEL,
    })
    recall = summary["stages"][0]["recall"]["32"]["needle@0.5"]
    chance = needle.chance_token_accuracy()
    assert recall["token_accuracy"] >= 5 * chance
    assert recall["exact_match"] >= 25 * chance ** needle.value_bytes
    assert [row["stage"] for row in summary["stages"]] == [0, 1]
    assert set(summary["stages"][1]["recall"]) == {"32", "64"}
    with open(os.path.join(out, "context_extension.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 2 + 2 * 2 + 2 and lines[-1].startswith("Chance without recall")
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["50", "52"]
    assert "recall at every stage boundary" in capsys.readouterr().out


def test_stages_take_their_corpus_and_a_long_stage_without_long_documents_fails_first(
        tmp_path, capsys, monkeypatch):
    short = dict(lengths=(64, 1 << 20), tokens_per_step=1 << 20, stage_steps=(1, 1),
                 corpus_weight=(1, 1), long_document_bias=(0.0, 0.5), mqar_weight=(0, 0), needle_weight=(0, 0),
                 answer_weight=(1, 1))
    stages = ContextExtensionConfig(**short, corpus=("stdlib", "repositories")).stages()
    assert [stage.data.corpus for stage in stages] == ["stdlib", "repositories"]
    assert {s.data.corpus for s in ContextExtensionConfig(**short).stages()} == {"stdlib"}
    with pytest.raises(ValueError, match="corpus has 1 entries for 2 stages"):
        ContextExtensionConfig(**short, corpus=("repositories",))
    # The stdlib has no document of a million bytes: refused before stage 1 trains.
    settings = {key: ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                for key, value in short.items()}
    def train_first(*args, **kwargs):
        raise AssertionError("stage 1 would train before the long stage is checked")

    monkeypatch.setattr(context_extension, "train", train_first)
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "run"),
              *[f"--set={key}={value}" for key, value in settings.items()]])
    assert "no document of 'stdlib-" in capsys.readouterr().err
