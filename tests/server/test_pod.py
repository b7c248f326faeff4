"""`mstar-jax serve` on a pod: two processes of one job (one simulated CPU device each, a `(data=2,
model=1)` mesh) on localhost, each serving its own port and admitting its own requests into its own data
shard, in lockstep. The audio each gives equals the single-device engine's for the same request (one
model shard: bit for bit), including a request to one process while the other has none, and `SIGTERM`
to both stops the pod, each process with status 0."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server.support import TTS_YAML, free_port, wait_for
from tests.server.test_speech import SETTINGS, TEXTS, alone
from tests.simulated_devices import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.serve]

TIMEOUT_S = 240


def pod_config(tmp_path):
    text = TTS_YAML.format(cache="null").replace("  persistent_cache_min_compile_secs: 0.0\n", "")
    text = text.replace("batch_sizes: [4]", "batch_sizes: [2]").replace("pipelined: true", "pipelined: false")
    path = tmp_path / "pod.yaml"
    path.write_text(text + "mesh:\n  data: 2\n  model: 1\n")
    return path


def speak(port: int, voice: str, text: str) -> bytes:
    body = {"model": "streaming_tts", "voice": voice, "input": text, "response_format": "pcm"}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/audio/speech", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_bytes())


def test_two_processes_each_serve_their_own_port_and_stop_together(tts, tmp_path):
    engine, voices = tts
    path, ports = pod_config(tmp_path), [free_port(), free_port()]
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower() and not k.startswith("MSTAR_")}
    env.update(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=str(ROOT),
        MSTAR_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", MSTAR_NUM_PROCESSES="2",
    )  # fmt: skip
    flags = ["--frames-per-byte", str(SETTINGS.frames_per_byte), "--max-frames", str(SETTINGS.max_frames)]
    logs = [tmp_path / f"serve{i}.log" for i in range(2)]
    servers = []
    try:
        for i, log in enumerate(logs):
            command = [
                sys.executable, "-m", "mstar_jax.cli", "serve", "--config", str(path),
                "--port", str(ports[i]), "--no-progress", "--log-level", "warning", *flags,
            ]  # fmt: skip
            with log.open("wb") as out:
                servers.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env={**env, "MSTAR_PROCESS_ID": str(i)},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

        def ready() -> bool:
            for server, log in zip(servers, logs, strict=True):
                assert server.poll() is None, log.read_text()
            try:
                return all(
                    httpx.get(f"http://127.0.0.1:{p}/ready", timeout=1).status_code == 200 for p in ports
                )
            except httpx.TransportError:
                return False

        wait_for(ready, "both processes to be ready", timeout_s=TIMEOUT_S)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one request on each process at once
            both = list(pool.map(speak, ports, ["voice-0", "voice-1"], TEXTS[:2]))
        assert both == [
            alone(engine, voices["voice-0"], TEXTS[0]),
            alone(engine, voices["voice-1"], TEXTS[1]),
        ]
        # Process 1 alone has work: process 0 enters its steps with no rows.
        assert speak(ports[1], "voice-0", TEXTS[2]) == alone(engine, voices["voice-0"], TEXTS[2])
        metrics = httpx.get(f"http://127.0.0.1:{ports[0]}/metrics", timeout=5).text
        assert 'mstar_requests_total{outcome="done"} 1.0' in metrics  # process 0 served its own only
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server, log in zip(servers, logs, strict=True):
            assert server.wait(60) == 0, log.read_text()
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()
