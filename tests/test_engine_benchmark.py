"""`benchmarks/engine.py` on a tiny workload: both engines serve it, give the same codes (the script
raises otherwise) and it prints every section, labelled as a quick run."""

from __future__ import annotations

from benchmarks import engine as engine_benchmark


def test_prints_every_section_for_both_engines(capsys):
    engine_benchmark.main(["--quick", "--batch", "2", "--streams", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "[--quick: batch 2, 3 streams, 1 repeats; not a full run's figures]" in out
    for section in ("1. throughput and latency", "2. the host's own time", "3. host time hidden"):
        assert section in out
    for name in ("synchronous", "pipelined"):
        assert out.count(f"\n   {name:<12} ") == 2  # one line in section 1, one in section 2
    assert "pipelined ÷ synchronous wall time:" in out
