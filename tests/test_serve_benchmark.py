"""`benchmarks/serve.py` on a tiny workload: a real server process and an in-process engine serve it,
and it prints every section (the overhead ratio, the leak counts, the exit status), labelled quick."""

from __future__ import annotations

import re

import pytest

from tests import extras

extras.skip_module_without("serve")
pytestmark = pytest.mark.serve

from benchmarks import serve as serve_benchmark


def test_prints_the_overhead_ratio_and_no_leaks(capsys):
    serve_benchmark.main(["--quick", "--concurrency", "2", "--disconnects", "8"])
    out = capsys.readouterr().out
    assert "[--quick: 4 slots, N = [2], 1 repeats; not a full run's figures]" in out
    for section in ("1. time to first audio", "2. the server after each N", "3. 8 clients leaving"):
        assert section in out
    assert re.search(r"N=2 +first audio p50, http ÷ in process: \d+\.\d\d", out)
    assert out.count("0 errors") == 2
    assert out.count("slots held 0, source readers 0, host records 0, waiting 0, paused 0") == 2
    assert "server exit status after SIGTERM: 0" in out
