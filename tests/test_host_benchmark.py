"""`benchmarks/host.py` on a tiny workload: the engine on programs that return at once serves every
stream to its end at K = 1 and K = 4, compiling nothing (the script raises otherwise), and prints a line
per case, each K's total over K = 1's."""

from __future__ import annotations

import re

import pytest

from benchmarks import host


def test_prints_the_host_time_of_every_case_by_phase(capsys):
    host.main(["--quick", "--batch", "1", "2", "--steps", "4", "--frames", "6", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "[--quick: batches [1, 2], K [1, 4], 6 frames, 1 repeats; not a full run's figures]" in out
    lines = [line for line in out.splitlines() if line.startswith("   batch ")]
    assert len(lines) == 8  # two batches, synchronous and pipelined, K = 1 and 4
    totals = {}
    for line in lines:
        batch, mode, k, total, ratio = re.search(
            r"batch\s+(\d+) (synchronous|pipelined)\s+K=(\d+)\s+([\d.]+) \([^)]*\) \(÷ K=1 ([\d.]+)\)", line
        ).groups()
        phases = [
            float(x)
            for x in re.findall(r"(?:rows|admit|plan|inputs|commit|dispatched|read|rest) ([-\d.]+)", line)
        ]
        assert len(phases) == 8
        # One repeat: the total is the phases' sum, each rounded to 0.01 us.
        assert sum(phases) == pytest.approx(float(total), abs=0.05)
        totals[batch, mode, int(k)] = float(total), float(ratio)
    for (batch, mode, _), (total, ratio) in totals.items():
        assert ratio == pytest.approx(total / totals[batch, mode, 1][0], abs=2e-3)


def test_instant_programs_return_a_blocks_codes():
    from benchmarks.engine import config_for
    from mstar_jax.models.streaming_tts.model import TALKER_DECODE, StreamingTTSModel

    model = StreamingTTSModel(config_for(4))
    programs = host.instant_programs(model, 4, decode_steps=8)
    assert programs.decode_steps == 8
    bucket = next(iter(programs.buckets[TALKER_DECODE].keys()))
    assert programs.steps[TALKER_DECODE].outputs[bucket].shape == (programs.codes_width, 8)
