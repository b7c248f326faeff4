"""`benchmarks/engine.py` on a tiny workload: both engines serve it at K = 1 and K = 2 decode steps per
dispatch, give the same codes (the script raises otherwise) and it prints every section, labelled as a
quick run."""

from __future__ import annotations

import re

import pytest

from benchmarks import engine as engine_benchmark

pytestmark = pytest.mark.slow


def test_prints_every_section_for_both_engines_and_each_k(capsys):
    engine_benchmark.main(["--quick", "--batch", "2", "--streams", "3", "--repeats", "1", "--steps", "2"])
    out = capsys.readouterr().out
    assert "[--quick: batch 2, K [1, 2], 3 streams, 1 repeats; not a full run's figures]" in out
    for section in (
        "1. throughput and latency",
        "2. the host's own time",
        "3. host time hidden",
        "4. K decode",
    ):
        assert section in out
    for name in ("synchronous", "pipelined"):
        assert out.count(f"\n   {name:<12} ") == 4  # sections 1 and 2, then K = 1 and 2 in section 4
    assert "pipelined ÷ synchronous wall time:" in out
    section = out[out.index("4. K decode") :]
    rows = re.findall(r"(synchronous|pipelined)\s+K=(\d+)\s+[\d.]+ .*× K=1 ([\d.]+).*÷ K=1 ([\d.]+)", section)
    assert sorted((mode, int(k)) for mode, k, _, _ in rows) == [
        ("pipelined", 1),
        ("pipelined", 2),
        ("synchronous", 1),
        ("synchronous", 2),
    ]
    for _, k, speed, later in rows:
        if k == "1":  # K = 1 against itself
            assert float(speed) == float(later) == 1.0
