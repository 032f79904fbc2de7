"""`python -m experiments.bench_short_conv` on CPU: its smoke run times both paths (the kernels
interpreted) and writes the table, and its `--tiles` option strings parse or are refused clearly."""

import argparse

import pytest

from experiments import bench_short_conv
from kda.kernels.triton import short_conv


@pytest.mark.slow
def test_benchmark_smoke_writes_both_paths(tmp_path):
    """`--smoke`: both paths run, and each is within bf16 rounding of the float32 answer."""
    out = tmp_path / "short_conv.md"
    results = bench_short_conv.main(["--smoke", "--repeats", "1", "--warmup", "1",
                                     "--out", str(out)])
    assert set(results) == {"xla", f"pallas {short_conv.OPTIONS}"}
    assert all(error < 2**-6 for _, error in results.values())
    text = out.read_text()
    assert "| xla |" in text and f"| pallas {short_conv.OPTIONS} |" in text
    assert "fwd+bwd device ms" in text  # the device-op times, beside the wall times
    assert all(timing.forward_backward_device_ms > 0 for timing, _ in results.values())


def test_kernel_options_parse_and_refuse_clearly():
    parse_options = bench_short_conv.parse_options
    assert parse_options("32x64/4") == short_conv.OPTIONS
    assert parse_options("16x256/8w/recompute") == short_conv.KernelOptions(16, 256, 8,
                                                                            "recompute")
    for bad in ("32x128", "32x128/4/fast", "32x128/4/recompute/1"):
        with pytest.raises(argparse.ArgumentTypeError, match="TOKENSxCHANNELS/WARPS"):
            parse_options(bad)
