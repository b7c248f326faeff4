"""`benchmarks/device_session.sh --dry-run`: every step of the device session runs on this host's CPU at
its smallest and the table names each step with its status and headline figure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_runs_every_step_and_prints_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_session.sh"), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "table.txt").read_text()
    assert "dry run on the CPU: not a device figure" in table
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line and not line.startswith("logs")}
    names = {"kernels", "kernel", "engine", "engine2", "gemma", "gemma2", "profile"}  # dry run: K = 2
    assert set(rows) == names
    for name in names:
        assert rows[name].split()[1] == "ok", table
    assert "passed" in rows["kernels"]
    assert "frames/s" in rows["engine"]
    assert "K=2" in rows["engine2"]
    assert "frames/s" in rows["engine2"]
    assert "decode" in rows["gemma"]
    assert "K=2" in rows["gemma2"]
    assert "decode" in rows["gemma2"]
    assert "of copy" in rows["kernel"]
    assert "engine no device lane; gemma no device lane" in rows["profile"]  # a CPU has no device lane
    for step in ("kernels", "kernel", "engine", "gemma", "profile"):
        assert (tmp_path / f"{step}.log").stat().st_size > 0


def test_it_refuses_an_unknown_argument(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_session.sh"), "--fast"],
        cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "usage:" in done.stderr
