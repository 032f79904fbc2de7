"""`python -m experiments.bench_vision --smoke` on CPU: the tower's table (every workload
through the dense path) and the training step with and without images; the FLOP counts against
hand-computed numbers of the smoke tower."""

import json

import numpy as np
import pytest

from experiments import bench_vision

TOWER_COLUMNS = ("| workload | images | patches / slots | attention | fwd ms | fwd+bwd ms | "
                 "fwd images/s | fwd patches/s | fwd+bwd images/s | fwd+bwd patches/s | fwd MFU | "
                 "fwd+bwd MFU | diff vs dense | memory MiB | note |")
TRAIN_COLUMNS = ("| batch | images | image tokens | step ms | tokens/s | model TFLOP/s | MFU | "
                 "compile s | XLA peak GiB | note |")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(results, markdown, saved JSON) of one smoke run."""
    out = tmp_path_factory.mktemp("bench") / "vision.md"
    results = bench_vision.main(["--smoke", "--repeats", "2", "--warmup", "1", "--out", str(out)])
    return results, out.read_text(), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow  # the smoke run: two tower and two step compiles
def test_tower_table_has_every_workload_timed(smoke):
    results, markdown, saved = smoke
    lines = markdown.splitlines()
    start = lines.index(TOWER_COLUMNS)
    table = lines[start + 2:start + 2 + len(results["tower"])]
    assert [row.split(" | ")[0] for row in table] == ["| 8x8", "| mixed packed"]
    for row, line in zip(results["tower"], table):
        assert row["implementation"] == "xla" and not row["note"]
        for name in ("forward", "forward_backward"):
            seconds = row[f"{name}_ms"] / 1e3
            assert row[f"{name}_patches_per_s"] == pytest.approx(row["patches"] / seconds)
            assert row[f"{name}_images_per_s"] == pytest.approx(row["images"] / seconds)
            assert row[f"{name}_mfu"] is None  # no peak on a CPU
        assert f"| {row['forward_ms']:.2f} | {row['forward_backward_ms']:.2f} |" in line
    # The mixed batch: 6 images of 132 patches in 2 rows of 96 slots.
    mixed = results["tower"][-1]
    assert (mixed["images"], mixed["patches"], mixed["slots"]) == (6, 132, 192)
    assert "| mixed packed | 6 | 132 / 192 | xla |" in markdown
    assert saved == json.loads(json.dumps(results))


@pytest.mark.slow  # the smoke run: two tower and two step compiles
def test_tower_flops_equal_a_hand_count(smoke):
    # The smoke tower: patches of 2 x 2 x 3 = 12 numbers, width D = 32, L = 2 blocks, q/k/v width
    # Q = 2 x 16 = 32, MLP F = 64. A patch's matmuls: 12 D + L (4 D Q + 2 D F) = 384 + 2 (4096 +
    # 4096) = 16768 multiply-adds. Each 8x8 image, n = 16 patches: 2 n 16768 = 536,576 in the
    # matmuls and L 4 n^2 Q = 65,536 in attention; the workload holds 4.
    results = smoke[0]
    row = next(row for row in results["tower"] if row["workload"] == "8x8")
    assert row["forward_flops"] == 4 * (536_576 + 65_536)


@pytest.mark.slow  # the smoke run: two tower and two step compiles
def test_training_step_with_images_against_text_only(smoke):
    results, markdown, _ = smoke
    text, images = results["train"]
    assert (text["batch"], images["batch"]) == ("text only", "with images")
    assert not text.get("note") and not images.get("note")
    # 4 + 6 placeholders in each row of 64 tokens; 2 images a row.
    assert (text["image_token_share"], images["image_token_share"]) == (0.0, 10 / 64)
    assert (text["images"], images["images"]) == (0, 4)
    # The tower and projector's training FLOPs, per token of the 2 x 64: the images of 4 x 4 and
    # 4 x 6 patches cost 602,112 + 952,320 in the tower (as above: 2 n 16768 + 8 n^2 32), and
    # their 10 merged tokens 2 x 10 x 24,640 in the projector (128 x 128 + 128 x 64 + 64
    # parameters); forward and backward 3x, 2 rows.
    vision = 3 * 2 * (602_112 + 952_320 + 2 * 10 * 24_640) / 128
    assert images["flops_per_token"] - text["flops_per_token"] == pytest.approx(vision)
    for row in (text, images):
        assert row["tokens_per_second"] == pytest.approx(128 / row["step_seconds"])
    lines = markdown.splitlines()
    start = lines.index(TRAIN_COLUMNS)
    assert lines[start + 2].startswith("| text only | 0 | 0.0% | ")
    assert lines[start + 3].startswith("| with images | 4 | 15.6% | ")


def test_image_batch_places_the_runs_in_one_document():
    setup, cfg = bench_vision.SMOKE.train, bench_vision.SMOKE.tower
    batch = bench_vision.image_batch(setup, cfg, bench_vision.SMOKE.train_grids)
    for row in range(setup.batch):
        run = np.flatnonzero(batch["tokens"][row] >= 259)  # <image_start>, <image>, <image_end>
        assert run.size == 10 + 4 and np.all(np.diff(run) == 1)  # both runs back to back
        assert len(set(batch["segment_ids"][row][run])) == 1  # inside one document
        # loss_mask[t] weighs the target tokens[t + 1]: no token of a run is a target, the text
        # after <image_end> is.
        assert batch["loss_mask"][row][run - 1].sum() == 0
        assert batch["loss_mask"][row][run[-1]] == 1
        np.testing.assert_array_equal(batch["targets"][row][run - 1], batch["tokens"][row][run])
    assert (batch["image_segment_ids"] > 0).sum(1).tolist() == [16 + 24] * setup.batch
