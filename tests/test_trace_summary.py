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


def _thunk(tid: int, name: str, ts: int, dur: int, run: str, module: str = "jit_step") -> dict:
    args = {"hlo_op": name, "hlo_module": module, "run_id": run}
    return {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_host_programs_split_each_run_into_dots_ynnpack_other_and_idle():
    rng = np.random.default_rng(2)
    events, expected = [], collections.defaultdict(list)
    for run in range(7):
        count = int(rng.integers(1, 9))
        thunks = [
            _thunk(int(rng.integers(1, 4)), f"{rng.choice(['dot', 'ynn_fusion', 'add_fusion'])}.{i}",
                   1000 * run + int(rng.integers(0, 90)), int(rng.integers(0, 20)), str(run))
            for i in range(count)
        ]  # fmt: skip
        events += thunks
        # Brute force: which kinds of thunk run in each µs of the run's span.
        first, last = min(t["ts"] for t in thunks), max(t["ts"] + t["dur"] for t in thunks)
        tally = collections.Counter()
        for at in range(first, last):
            kinds = {
                t["name"].split("_")[0].split(".")[0] for t in thunks if t["ts"] <= at < t["ts"] + t["dur"]
            }
            tally["dot" if "dot" in kinds else "ynn" if "ynn" in kinds else "other" if kinds else "idle"] += 1
        key = ("jit_step", count)
        expected[key].append((last - first, tally["dot"], tally["ynn"], tally["other"], tally["idle"]))
    events += [
        _op(2, "ThunkExecutor::Execute", 0, 5000),  # no hlo_op: not a thunk
        _thunk(1, "dot.1", 9000, 30, run="x", module="jit_prefill"),
    ]  # fmt: skip
    expected["jit_prefill", 1].append((30, 30, 0, 0, 0))
    programs = trace_summary.host_programs(events)
    got = {(p.module, p.thunks): p for p in programs}
    assert got.keys() == expected.keys()
    for key, samples in expected.items():
        p = got[key]
        medians = tuple(float(np.median(column)) for column in zip(*samples, strict=True))
        assert p.runs == len(samples)
        assert (p.span_us, p.dots_us, p.ynn_us, p.other_us, p.idle_us) == pytest.approx(medians)
    lines = trace_summary.program_table(programs)
    assert lines[0].startswith("XLA:CPU programs")
    assert lines[1].split() == ["runs", "thunks", "span", "dots", "YNNPACK", "other", "idle", "program"]
    assert lines[2:] == [
        f"  {p.runs:5d} {p.thunks:7d} "
        + " ".join(f"{v / 1e3:8.2f}" for v in (p.span_us, p.dots_us, p.ynn_us, p.other_us, p.idle_us))
        + f"  {p.module}"
        for p in sorted(programs, key=lambda p: -p.span_us * p.runs)
    ]
    assert trace_summary.program_table(()) == []


def test_main_prints_the_host_programs_of_a_cpu_trace(tmp_path, capsys):
    path = tmp_path / trace_summary.TRACE_NAME
    thunks = [_thunk(1, "dot.0", 0, 30, "1"), _thunk(2, "add_fusion", 40, 10, "1")]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace(thunks)}, f)
    trace_summary.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    table = out.index("XLA:CPU programs on the host's threads, ms a run (medians over its runs):")
    assert out[table + 2].split() == ["1", "2", "0.05", "0.03", "0.00", "0.01", "0.01", "jit_step"]
