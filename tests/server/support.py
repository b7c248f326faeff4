"""What the server tests share: a tiny speech deployment, a live server on localhost, and waits."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import uvicorn

from mstar_jax.models.streaming_tts.audio import pcm16
from mstar_jax.models.streaming_tts.request import TTSRequest
from mstar_jax.models.streaming_tts.tokenizer import ByteTokenizer
from mstar_jax.server import ServerSettings
from mstar_jax.server.command import _server

TTS_YAML = """\
model:
  name: streaming_tts
  config:
    text_vocab_size: 256
    codec_vocab_size: 16
    d_model: 32
    talker_layers: 1
    talker_heads: 2
    talker_kv_heads: 1
    talker_head_dim: 8
    talker_ffn_dim: 32
    min_voice_frames: 3
    max_voice_frames: 6
    talker_sink_extra: 2
    talker_window: 6
    query_window: 7
    flow_d_model: 16
    flow_layers: 1
    flow_heads: 2
    flow_head_dim: 8
    flow_chunk: 4
    flow_window: 5
    flow_steps: 1
    mel_bins: 4
    max_slots: 4
compile:
  batch_sizes: [4]
  token_counts: [1, 4]
  persistent_cache_dir: {cache}
  persistent_cache_min_compile_secs: 0.0
engine:
  max_batch: 4
  pipelined: true
workload:
  voices: 2
"""
"""The smallest speech deployment served: UTF-8 bytes fit its text vocabulary of 256, one batch bucket."""

TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def live(app, *, grace_s: float | None = None, send_buffer: int | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a free localhost port in a thread; yield its base URL. With `grace_s`,
    the server is `mstar-jax serve`'s, whose `handle_exit(signal.SIGTERM, None)` (`app.state.server`)
    shuts down as a signal would; with `send_buffer`, each connection's kernel send buffer is that many
    bytes (its sends stop sooner for a client that does not read)."""
    sock = socket.socket()
    if send_buffer is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", ws="websockets-sansio")
    server = uvicorn.Server(config) if grace_s is None else _server(config, app.state.host, grace_s)
    app.state.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def alone(engine, voice, text: str, settings: ServerSettings, seed: int = 0) -> bytes:
    """The PCM of `text` served alone by the engine in process (no server), as a server with `settings`
    would speak it."""
    tokens = ByteTokenizer(256, frames_per_byte=settings.frames_per_byte, max_frames=settings.max_frames)
    ids = tokens.encode(text)
    request = TTSRequest(f"alone-{text}-{seed}", ids, voice, tokens.frames_for(len(ids)), seed)
    return b"".join(pcm16(chunk.samples) for chunk in engine.stream(request))


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def assert_nothing_leaked(host) -> None:
    """No live stream, no slot held, no source read, no record kept, no handle left: within a bounded wait."""
    engine = host.engine

    def clean() -> bool:
        managers = host.managers
        return (
            not engine.streams
            and host.live == 0
            and host.waiting == 0
            and all(m.free_slots == host.free_slots[m.spec.resource_key] for m in managers)
            and all(not m.request_ids for m in managers)
            and all(m.readers(i) == 0 for m in managers for i in range(m.bank.num_sources))
        )

    wait_for(clean, "every stream, slot, record and reader to be released", timeout_s=20.0)


def outcomes(url: str) -> dict[str, float]:
    """The server's `mstar_requests_total` by outcome, read from its `/metrics`."""
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("mstar_requests_total{"):
            name, value = line.split()
            counts[name.split('"')[1]] = float(value)
    return counts


@contextlib.contextmanager
def serve_process(config: Path, *options: str, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`mstar-jax serve --config config *options` in a child process on a free localhost port, its output
    in `log`; yields (the process, its base URL) once it is ready, and kills it if it is still running."""
    port = free_port()
    command = [sys.executable, "-m", "mstar_jax.cli", "serve", "--config", str(config), "--port", str(port),
               "--no-progress", "--log-level", "warning", *options]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    with log.open("wb") as out:
        server = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert server.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, "the server to be ready", timeout_s=120)
        yield server, url
    finally:
        if server.poll() is None:
            server.kill()
