"""`benchmarks/host.py` on a tiny workload: the engine on programs that return at once serves every
stream to its end, compiling nothing (the script raises otherwise), and prints a line per case."""

from __future__ import annotations

import re

import pytest

from benchmarks import host


def test_prints_the_host_time_of_every_case_by_phase(capsys):
    host.main(["--quick", "--batch", "1", "2", "--frames", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "[--quick: batches [1, 2], 4 frames, 1 repeats; not a full run's figures]" in out
    lines = [line for line in out.splitlines() if line.startswith("   batch ")]
    assert len(lines) == 4  # two batches, synchronous and pipelined
    for line in lines:
        total = float(re.search(r"(?:synchronous|pipelined)\s+([\d.]+) \(", line)[1])
        phases = [
            float(x)
            for x in re.findall(r"(?:rows|admit|plan|inputs|commit|dispatched|read|rest) ([-\d.]+)", line)
        ]
        assert len(phases) == 8
        # One repeat: the total is the phases' sum, each rounded to 0.01 us.
        assert sum(phases) == pytest.approx(total, abs=0.05)
