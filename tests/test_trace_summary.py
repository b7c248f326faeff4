"""benchmarks/trace_summary.py against hand-built traces whose busy times are counted by brute force."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os

import numpy as np
import pytest

from benchmarks import trace_summary


def _trace(events: list[dict]) -> list[dict]:
    names = {1: "/device:GPU:0", 2: "/host:CPU"}
    return [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": n}} for pid, n in names.items()
    ] + events


def _op(pid: int, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "pid": pid, "tid": 7, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_the_intervals():
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = rng.integers(0, 100, rng.integers(1, 12))
        intervals = [
            (int(s), int(s + d)) for s, d in zip(starts, rng.integers(0, 30, len(starts)), strict=True)
        ]
        covered = np.zeros(200, bool)
        for start, end in intervals:
            covered[start:end] = True
        assert trace_summary.busy_time(intervals) == covered.sum()


def test_summarise_splits_device_lanes_from_the_host():
    events = _trace([
        _op(1, "attention", 100, 30), _op(1, "matmul", 140, 5), _op(1, "attention", 150, 50),
        _op(1, "copy", 160, 10),  # overlaps the second attention (another stream): counted once
        _op(2, "step", 90, 200), _op(2, "dispatch", 95, 20), {"ph": "i", "pid": 1, "name": "marker", "ts": 0},
    ])  # fmt: skip
    (lane,), host, host_self = trace_summary.summarise(events)
    assert lane.name == "/device:GPU:0"
    assert lane.span_us == 200 - 100
    assert lane.busy_us == 30 + 5 + 50
    assert [(op.name, op.count, op.total_us, op.median_us) for op in lane.ops] == [
        ("attention", 2, 80, 40), ("copy", 1, 10, 10), ("matmul", 1, 5, 5),
    ]  # fmt: skip
    assert [(op.name, op.total_us) for op in host] == [("step", 200), ("dispatch", 20)]
    assert [(op.name, op.total_us) for op in host_self] == [("step", 180), ("dispatch", 20)]
    lines = trace_summary.report([lane], host, top=1)
    assert lines[0] == "/device:GPU:0: busy 0.1 of 0.1 ms (busy ÷ span 0.85), 4 ops"
    assert sum("attention" in line for line in lines) == 1
    assert not any("copy" in line for line in lines)


def _nested(rng, lo: int, hi: int, depth: int, tid: int) -> list[dict]:
    """Disjoint events within [lo, hi) on thread `tid`, each with events nested in it, as a thread's are
    (none spans all of [lo, hi): which of two equal events nests in the other is anyone's guess)."""
    events, at = [], lo
    while depth and at < hi - 2 and rng.random() < 0.7:
        start = int(rng.integers(at, hi - 1))
        end = int(rng.integers(start + 1, hi + (start > lo)))
        events.append({"ph": "X", "pid": 2, "tid": tid, "name": f"e{len(events)}d{depth}", "ts": start,
                       "dur": end - start})  # fmt: skip
        events += _nested(rng, start, end, depth - 1, tid)
        at = end
    return events


def test_self_times_are_what_no_nested_event_covers():
    rng = np.random.default_rng(1)
    for _ in range(100):
        events = _nested(rng, 0, 200, 4, tid=1) + _nested(rng, 0, 200, 3, tid=2)
        rng.shuffle(events)
        # Brute force: each time unit belongs to the innermost (shortest) event of its thread covering it.
        expected = collections.Counter()
        for tid in (1, 2):
            mine = [e for e in events if e["tid"] == tid]
            for t in range(200):
                covering = [e for e in mine if e["ts"] <= t < e["ts"] + e["dur"]]
                if covering:
                    innermost = min(covering, key=lambda e: e["dur"])
                    expected[tid, innermost["name"], innermost["ts"]] += 1
        got = {(e["tid"], e["name"], e["ts"]): e["dur"] for e in trace_summary.self_times(events)}
        assert len(got) == len(events)
        assert got == {key: expected.get(key, 0) for key in got}


def test_main_reads_the_newest_trace_below_a_folder(tmp_path, capsys):
    for age, busy in ((100, 10), (50, 40)):  # the newer one (50 s old) holds 40 µs of work
        folder = tmp_path / "plugins" / "profile" / f"run{age}"
        folder.mkdir(parents=True)
        path = folder / trace_summary.TRACE_NAME
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": _trace([_op(1, "k", 0, busy), _op(1, "k", 60, 40)])}, f)
        os.utime(path, (1e9 - age, 1e9 - age))
    trace_summary.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "run50" in out
    assert out.rstrip().endswith(f"device busy ÷ span: {tmp_path.name} 0.80")


def test_main_refuses_what_is_not_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        trace_summary.main([str(tmp_path / "missing")])
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_summary.main([str(tmp_path)])
    assert "no perfetto_trace.json.gz below it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_summary.main([str(tmp_path), "--top", "0"])
    assert "--top 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_summary.main([str(tmp_path), "--top", "nan"])
    assert "invalid int value: 'nan'" in capsys.readouterr().err


def test_the_trace_argument_takes_a_folder_not_a_file(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    trace_summary.add_trace_argument(parser, "serve once more")
    assert parser.parse_args(["--trace", str(tmp_path / "new")]).trace == tmp_path / "new"
    assert parser.parse_args([]).trace is None
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit):
        parser.parse_args(["--trace", str(tmp_path / "a_file")])
    assert "a_file is a file; --trace takes a folder" in capsys.readouterr().err
