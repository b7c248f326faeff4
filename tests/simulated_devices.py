"""Run a test's child script on simulated CPU devices: XLA only creates them when its flag is set before
jax starts, so meshes are tested in a child process that prints its findings as one JSON line.
`run_processes` starts several such children as the processes of one multi-process JAX job on localhost.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_child(script: Path, *, devices: int = 8, timeout: float = 900) -> dict:
    """Run `script` with `devices` CPU devices; returns the JSON of its last stdout line."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
    child = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert child.returncode == 0, f"{script.name} failed:\n{child.stderr[-6000:]}"
    return last_json(child.stdout)


def last_json(stdout: str) -> dict:
    """The findings a child printed: its last stdout line that parses as a JSON object.

    A multi-process job's collectives library writes lines of its own to stdout, at times after the
    child's findings (Gloo: "[Gloo] Rank 0 is connected to 1 peer ranks. ..."), so the last line is not
    always the child's.
    """
    for line in reversed(stdout.strip().splitlines()):
        try:
            found = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict):
            return found
    raise AssertionError(f"no JSON object in the child's stdout:\n{stdout[-6000:]}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    argv: Sequence[str], tmp_path: Path, *, processes: int, devices: int, timeout: float
) -> list[str]:
    """Run `python *argv` as each of `processes` processes of one job, each with `devices` CPU
    devices, and wait for all; returns their stdouts. Each reads `MSTAR_COORDINATOR_ADDRESS`,
    `MSTAR_NUM_PROCESSES` and `MSTAR_PROCESS_ID`.

    A child that fails leaves the others waiting for it (at the coordinator or a collective), so the
    first failure, or the timeout, ends them all and fails with every child's stderr.
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    # gRPC honours proxy variables, which would route the coordinator's localhost traffic elsewhere.
    base = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower() and not k.startswith("MSTAR_")}
    base.update(
        JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip(), MSTAR_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}"
    )
    base.update(MSTAR_NUM_PROCESSES=str(processes))
    logs = [(tmp_path / f"child{p}.out", tmp_path / f"child{p}.err") for p in range(processes)]
    children = []
    deadline = time.monotonic() + timeout
    try:
        for p, (out, err) in enumerate(logs):
            with out.open("w") as stdout, err.open("w") as stderr:  # files: a full pipe would block
                children.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        cwd=ROOT,
                        env={**base, "MSTAR_PROCESS_ID": str(p)},
                        stdout=stdout,
                        stderr=stderr,
                    )
                )
        while time.monotonic() < deadline:
            codes = [c.poll() for c in children]
            if None not in codes or any(codes):  # all done, or one failed
                break
            time.sleep(0.1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    failed = [
        f"process {p} {'was ended by the test' if c.returncode < 0 else 'exited'} with {c.returncode}:\n"
        f"{err.read_text()[-4000:]}"
        for p, (c, (_, err)) in enumerate(zip(children, logs, strict=True))
        if c.returncode
    ]
    if failed:
        expired = f"timed out after {timeout} s; " if time.monotonic() >= deadline else ""
        pytest.fail(expired + "\n".join(failed))
    return [out.read_text() for out, _ in logs]


def report_as_process(child: Callable[[], dict]) -> None:
    """A child process's entry point: print `child()`'s result as one JSON line. On an error print it and
    exit at once: a normal exit would wait at JAX's shutdown barrier for the other processes."""
    try:
        result = child()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(json.dumps(result), flush=True)
