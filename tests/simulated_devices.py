"""Run a test's child script on simulated CPU devices: XLA only creates them when its flag is set before
jax starts, so meshes are tested in a child process that prints its findings as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_child(script: Path, *, devices: int = 8, timeout: float = 900) -> dict:
    """Run `script` with `devices` CPU devices; returns the JSON of its last stdout line."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
    child = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert child.returncode == 0, f"{script.name} failed:\n{child.stderr[-6000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])
