"""experiments.harness: the error metric (its two norms, the worst leaf, non-finite values never
passing), the pipelined step timer, the command line, the options of a small benchmark and the
card its `--gpu` table is named for."""

import types
from pathlib import Path

import numpy as np
import pytest

from experiments import harness


def test_relative_error_l2_and_max_norms_take_the_worst_leaf():
    expected = {"a": np.array([3.0, 4.0]), "b": np.array([1.0, -2.0])}
    actual = {"a": np.array([3.0, 4.5]), "b": np.array([1.0, -2.0])}
    assert harness.relative_error(actual, expected) == pytest.approx(0.5 / 5.0)
    assert harness.relative_error(actual, expected, norm="max") == pytest.approx(0.5 / 4.0)
    assert harness.relative_error(expected, expected) == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_relative_error_of_a_non_finite_value_is_inf(bad):
    """A NaN or infinity on either side fails both `<= tol` and passes `> tol`."""
    clean = np.ones(4, np.float32)
    broken = clean.copy()
    broken[2] = bad
    for actual, expected in ((broken, clean), (clean, broken), (broken, broken)):
        for norm in ("l2", "max"):
            error = harness.relative_error([clean, actual], [clean, expected], norm=norm)
            assert error == np.inf and not error <= 1.0


def test_relative_error_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="shapes differ"):
        harness.relative_error(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="leaves"):
        harness.relative_error([np.ones(3)], [np.ones(3), np.ones(3)])
    with pytest.raises(ValueError, match="norm"):
        harness.relative_error(np.ones(3), np.ones(3), norm="l1")


def test_command_line_names_the_module_and_its_arguments():
    assert (harness.command_line("experiments.bench_kda", ["--gpu", "--repeats", "3"])
            == "python -m experiments.bench_kda --gpu --repeats 3")


def test_small_benchmark_options_put_the_gpu_table_in_benchmarks(capsys):
    args = harness.gpu_or_smoke_args(["--smoke"], "d", "x", "gpu", "smoke")
    assert args.out is None and (args.repeats, args.warmup) == (20, 3)
    with pytest.raises(SystemExit):  # this CPU has no CUDA backend
        harness.gpu_or_smoke_args(["--gpu"], "d", "x", "gpu", "smoke")
    assert "--gpu needs a CUDA backend" in capsys.readouterr().err


@pytest.mark.parametrize("device_kind, card", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-SXM2-16GB", "v100"), ("cpu", "cpu"),
    ("Some New Card", "some-new-card"),
])
def test_card_slug_is_the_first_word_with_a_digit_of_the_device_kind(device_kind, card):
    assert harness.card_slug(device_kind) == card


def test_card_slug_refuses_a_device_kind_without_words():
    with pytest.raises(ValueError, match="device_kind"):
        harness.card_slug(" - ")


def test_gpu_tables_are_named_for_the_card_the_run_is_on(monkeypatch):
    """An H100 run writes benchmarks/<subject>_h100.md unless --out says otherwise, so it never
    replaces an H200's table."""
    device = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(harness.jax, "devices", lambda *backend: [device])
    monkeypatch.setattr(harness.jax, "default_backend", lambda: "gpu")
    assert harness.gpu_table("moe") == Path("benchmarks/moe_h100.md")
    args = harness.gpu_or_smoke_args(["--gpu"], "d", "attention", "gpu", "smoke")
    assert args.out == Path("benchmarks/attention_h100.md")

    def long_option(parser):
        parser.add_argument("--long", action="store_true")

    def subject(args):
        return "x_long" if args.long else "x"

    for argv, out in ((["--gpu", "--long"], "benchmarks/x_long_h100.md"),
                      (["--gpu"], "benchmarks/x_h100.md"),
                      (["--gpu", "--out", "mine.md"], "mine.md")):
        args = harness.gpu_or_smoke_args(argv, "d", subject, "gpu", "smoke",
                                         add_options=long_option)
        assert args.out == Path(out)


def test_markdown_and_json_replace_the_file_whole(tmp_path):
    path = tmp_path / "new" / "table.md"
    harness.write_markdown(path, ["# old", "row"])
    harness.write_markdown(path, ["# new"])
    assert path.read_text() == "# new\n"
    harness.write_json(path.with_suffix(".json"), {"a": [1, 2]})
    assert path.with_suffix(".json").read_text().replace(" ", "").replace("\n", "") == '{"a":[1,2]}'


class LoggedCall:
    """What a `run()` returns in the test below: logs when it is waited for."""

    def __init__(self, index, log):
        self.index, self.log = index, log

    def block_until_ready(self):
        self.log.append(("wait", self.index))
        return self


def test_pipelined_seconds_dispatches_each_call_before_waiting():
    log = []

    def run():
        call = LoggedCall(sum(kind == "dispatch" for kind, _ in log), log)
        log.append(("dispatch", call.index))
        return call

    seconds = harness.pipelined_seconds(run, steps=3, warmup=1)
    assert seconds >= 0
    dispatches = [index for kind, index in log if kind == "dispatch"]
    assert dispatches == list(range(7))  # warm-up, a synchronised call, then 3 + 2 in flight
    # After the synchronised start, call k + 1 is dispatched before call k is waited for.
    for index in range(2, 6):
        assert log.index(("dispatch", index + 1)) < log.index(("wait", index))
    assert log[-1] == ("wait", 6)
