"""`experiments.mosaic_trace` on a hand-made trace: region cycles, the gaps between regions and a
loop's period, per warpgroup stream."""

import gzip
import json

import pytest

from experiments import mosaic_trace


def stream(pid, tid, ranges):
    """Events of one warpgroup stream: (name, start, end) in the trace's units (k-cycles)."""
    events = []
    for name, start, end in ranges:
        events += [dict(name=name, ph="B", ts=start, pid=pid, tid=tid),
                   dict(name=name, ph="E", ts=end, pid=pid, tid=tid)]
    return events


def two_step_trace():
    """Two programs, each a loop of two steps: "load" then "math", with gaps between."""
    return (stream(0, 0, [("load", 0.0, 0.5), ("math", 0.6, 1.6), ("load", 2.0, 2.5),
                          ("math", 2.6, 3.6)])
            + stream(1, 0, [("load", 10.0, 10.7), ("math", 10.8, 11.8), ("load", 12.2, 12.9),
                            ("math", 13.0, 14.0)]))


def test_regions_gaps_and_periods_in_cycles():
    summary = mosaic_trace.summarize(two_step_trace(), period_regions=["load"])
    assert summary.streams == 2
    assert summary.regions["load"].median_cycles == pytest.approx(600)  # 500, 500, 700, 700
    assert summary.regions["math"] == mosaic_trace.RegionStats(1000, 1000, 4)
    assert summary.gaps["load -> math"].median_cycles == pytest.approx(100)
    assert summary.gaps["math -> load"].median_cycles == pytest.approx(400)
    assert summary.periods["load"] == pytest.approx(mosaic_trace.RegionStats(2100, 2100, 2))


def test_nested_regions_count_the_outer_one_and_no_gap_inside_it():
    events = stream(0, 0, [("step", 0.0, 2.0)])
    events[1:1] = stream(0, 0, [("inner", 0.5, 1.0)])  # inside "step"
    summary = mosaic_trace.summarize(events)
    assert summary.regions["step"].median_cycles == 2000
    assert summary.regions["inner"].median_cycles == 500
    assert summary.gaps == {}


def test_a_trace_cut_short_is_refused():
    events = stream(0, 0, [("load", 0.0, 0.5)])[1:]  # the end without its start
    with pytest.raises(ValueError, match="profile_space"):
        mosaic_trace.summarize(events)


def test_cli_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "kernel-trace.json.gz"
    with gzip.open(path, "wt") as trace:
        json.dump({"displayTimeUnit": "ns", "traceEvents": two_step_trace()}, trace)
    mosaic_trace.main([str(path), "--period", "load"])
    output = capsys.readouterr().out
    assert "| math | 1000 | 1000 | 4 |" in output
    assert "| period load | 2100 | 2100 | 2 |" in output
