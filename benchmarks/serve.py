"""The front door's overhead: one workload served through `mstar-jax serve` over HTTP and by the engine
in process, in the same run, so what HTTP costs is a ratio.

A server process (`mstar-jax serve` on a free localhost port) and an engine in this process are built
from one deployment (the second loads the first's programs from the executable store). For each
concurrency N, N speech requests arrive as a Poisson process spread over about `--spread-s` seconds
(so about N streams are in flight), each of `--frames` frames; an async `httpx` client streams them from
the server, and the same requests are submitted to the in-process engine at the same times. Printed
per N, HTTP and in process, interleaved in a fresh random order every repeat (`benchmarks.timing`):

  1. time to first audio p50 and p99 (arrival to the first audio byte), its median real-time factor
     (a stream's serving time ÷ its audio's duration), streams/s, errors; and HTTP p50 ÷ in-process p50
     per repeat (the goal: <= 1.2 at N = 64);
  2. the server's resident memory after each N, and what it leaked: live streams, slots held, host
     records and source readers (all 0 when nothing leaks), read from its `/metrics`;
  3. a longer reliability run: `--disconnects` clients that leave mid-stream, then the leak counts again.

Run: python -m benchmarks.serve [--quick] [--repeats R] [--concurrency 1,16,64,256] [--frames F]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label, ratios
from mstar_jax.compile import disable_persistent_cache
from mstar_jax.deployment import load_deployment
from mstar_jax.models.streaming_tts.model import FRAME_RATE_HZ
from mstar_jax.models.streaming_tts.request import TTSRequest
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.models.streaming_tts.tokenizer import ByteTokenizer
from mstar_jax.models.streaming_tts.workload import register_voices

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. "
SLOTS = 64

QUICK_DEPLOYMENT = """\
model:
  name: streaming_tts
  config: {{text_vocab_size: 256, codec_vocab_size: 16, d_model: 32, talker_layers: 1, talker_heads: 2,
           talker_kv_heads: 1, talker_head_dim: 8, talker_ffn_dim: 32, min_voice_frames: 3,
           max_voice_frames: 6, talker_sink_extra: 2, talker_window: 6, query_window: 7, flow_d_model: 16,
           flow_layers: 1, flow_heads: 2, flow_head_dim: 8, flow_chunk: 4, flow_window: 5, flow_steps: 1,
           mel_bins: 4, max_slots: 4}}
compile: {{batch_sizes: [4], token_counts: [1, 4], persistent_cache_dir: {cache},
          persistent_cache_min_compile_secs: 0.0}}
engine: {{max_batch: 4, pipelined: true}}
workload: {{voices: 2}}
"""
"""A tiny model for `--quick`, which only shows that every section runs."""

DEPLOYMENT = """\
model:
  name: streaming_tts
  config: {{text_vocab_size: 256, codec_vocab_size: 256, d_model: 64, talker_layers: 2, talker_heads: 4,
           talker_kv_heads: 2, talker_head_dim: 16, talker_ffn_dim: 128, min_voice_frames: 8,
           max_voice_frames: 24, talker_sink_extra: 4, talker_window: 32, query_window: 33,
           flow_d_model: 64, flow_layers: 2, flow_heads: 4, flow_head_dim: 16, flow_chunk: 8,
           flow_window: 16, flow_steps: 2, mel_bins: 16, max_slots: {slots}}}
compile: {{token_counts: [1, 8, 16], persistent_cache_dir: {cache}, persistent_cache_min_compile_secs: 0.0}}
engine: {{max_batch: {slots}, pipelined: true}}
workload: {{voices: 2}}
"""
"""The default deployment's model, its caches and batches sized for `slots` streams at once."""


@dataclasses.dataclass
class Served:
    """One run's figures: per request, arrival to first audio and to its end (seconds), or None."""

    wall: float
    first_audio: list[float]
    serving: list[float]
    errors: int


def arrivals(n: int, spread_s: float, seed: int) -> np.ndarray:
    """f64[n]: Poisson arrival times whose mean gap spreads n requests over about `spread_s`."""
    gaps = np.random.default_rng(seed).exponential(spread_s / max(n, 1), n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def in_process(engine: Engine, voice, times: np.ndarray, frames: int) -> Served:
    """The requests submitted to `engine` at their arrival times, the engine stepped in this thread."""
    text = tuple(TEXT.encode())
    pending = collections.deque(enumerate(times))
    first: dict[int, float] = {}
    start = time.perf_counter()
    streams = {}
    while pending or engine.streams:
        now = time.perf_counter() - start
        while pending and pending[0][1] <= now:
            i, _ = pending.popleft()

            def heard(chunk, i=i):
                first.setdefault(i, time.perf_counter() - start)

            streams[i] = engine.submit(TTSRequest(f"bench-{i}-{start}", text, voice, frames), on_output=heard)
        if not engine.step() and pending and engine.idle:
            time.sleep(max(0.0, pending[0][1] - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    ttfa = [first[i] - times[i] for i in sorted(first)]
    done = [s.finished_at - s.submitted_at for s in streams.values() if s.failure is None]
    return Served(wall, ttfa, done, sum(s.failure is not None for s in streams.values()))


async def over_http(url: str, times: np.ndarray, frames: int, speed: float) -> Served:
    """The requests streamed from the server at their arrival times by one async httpx client."""
    body = {"model": "streaming_tts", "voice": "voice-0", "input": TEXT, "response_format": "pcm",
            "speed": speed}  # fmt: skip
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=len(times) + 8, max_keepalive_connections=len(times) + 8)

    async def one(http: httpx.AsyncClient, at: float):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        first, size = None, 0
        try:
            async with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
                if response.status_code != 200:
                    return None
                async for chunk in response.aiter_raw():
                    first = first or time.perf_counter()
                    size += len(chunk)
        except httpx.HTTPError:
            return None
        if size != frames * 1920 * 2:
            return None
        return first - sent, time.perf_counter() - sent

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        results = await asyncio.gather(*(one(http, at) for at in times))
    wall = time.perf_counter() - start
    good = [r for r in results if r is not None]
    return Served(wall, [r[0] for r in good], [r[1] for r in good], len(results) - len(good))


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def rtf(served: Served, frames: int) -> float:
    return statistics.median(served.serving) / (frames / FRAME_RATE_HZ) if served.serving else float("nan")


def server_state(url: str) -> dict[str, float]:
    """The leak counts the server's own metrics give."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    state: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        names = (
            "mstar_slots_in_use", "mstar_source_readers", "mstar_live_requests", "mstar_waiting_requests",
            "mstar_paused_streams", "mstar_time_to_first_output_seconds_sum",
            "mstar_time_to_first_output_seconds_count",
        )  # fmt: skip
        if line.startswith(names):
            state[line.split("{")[0].split()[0]] += float(line.split()[-1])
    return state


def leaks(state: dict[str, float]) -> str:
    """What is left held: 0 each when nothing leaked."""
    return (
        f"slots held {state['mstar_slots_in_use']:.0f}, source readers {state['mstar_source_readers']:.0f}, "
        f"host records {state['mstar_live_requests']:.0f}, waiting {state['mstar_waiting_requests']:.0f}, "
        f"paused {state['mstar_paused_streams']:.0f}"
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def disconnect_storm(url: str, clients: int) -> int:
    """`clients` clients that read their first chunk and leave; returns how many reached it."""
    body = {"model": "streaming_tts", "voice": "voice-0", "input": TEXT * 2, "response_format": "pcm"}
    reached = 0

    async def leave(http):
        nonlocal reached
        async with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            async for _ in response.aiter_raw():
                reached += 1
                break

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        await asyncio.gather(*(leave(http) for _ in range(clients)), return_exceptions=True)
    return reached


def start_server(config: Path, port: int, frames_per_byte: float, log) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "mstar_jax.cli", "serve", "--config", str(config), "--port", str(port),
        "--no-progress", "--log-level", "warning", "--max-waiting", "100000", "--frames-per-byte",
        f"{frames_per_byte}", "--voices", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {timeout_s} s")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, 4 slots, N = 1, 4, 1 repeat (labelled)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs each way per N (default 3)")
    parser.add_argument("--concurrency", default=None, help="values of N (default 1,16,64,256)")
    parser.add_argument("--frames", type=int, default=None, help="frames a request speaks (default 90)")
    parser.add_argument("--spread-s", type=float, default=1.0, help="arrivals spread over (default 1 s)")
    parser.add_argument("--disconnects", type=int, default=None, help="clients leaving (default 1000)")
    args = parser.parse_args(argv)
    slots = 4 if args.quick else SLOTS
    levels = [int(n) for n in (args.concurrency or ("1,4" if args.quick else "1,16,64,256")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    frames = args.frames or (16 if args.quick else 90)
    disconnects = args.disconnects if args.disconnects is not None else (20 if args.quick else 1000)
    speed = len(TEXT.encode()) / frames  # one frame a byte at speed 1: about `frames` frames a request
    frames = ByteTokenizer(256, frames_per_byte=1.0, max_frames=1500).frames_for(len(TEXT.encode()), speed)
    label = quick_label(args.quick, f"{slots} slots, N = {levels}, {repeats} repeats")
    print(f"benchmarks/serve.py{label}")
    print(f"{slots} slots, {frames} frames a request ({frames / FRAME_RATE_HZ:.1f} s of audio), arrivals "
          f"Poisson over ~{args.spread_s:g} s; timing: {ORDER_NOTE}; median (min–max)")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "serve.log", "wb") as log:
        config = Path(tmp) / "deployment.yaml"
        # A fresh store each run: the engine here compiles into it, the server loads from it.
        cache = Path(tmp) / "cache"
        cache.mkdir()
        template = QUICK_DEPLOYMENT if args.quick else DEPLOYMENT
        config.write_text(template.format(slots=slots, cache=cache.resolve()))
        started = time.perf_counter()
        engine = Engine.from_deployment(load_deployment(config), progress=False, max_workers=2)
        voice = register_voices(engine, 2, seed=0)[0]
        print(f"in-process engine captured in {time.perf_counter() - started:.0f} s")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(config, port, 1.0, log)
        try:
            started = time.perf_counter()
            wait_ready(url, server)
            print(f"server ready in {time.perf_counter() - started:.0f} s (programs from the store)")
            run_levels(
                engine, voice, url, server, levels, repeats, frames, speed, args.spread_s, label,
                warmup=0 if args.quick else 1,
            )  # fmt: skip
            print(f"\n3. {disconnects} clients leaving mid-stream{label}")
            reached = asyncio.run(disconnect_storm(url, disconnects))
            time.sleep(0.5)
            state = server_state(url)
            print(f"   {reached} reached their first audio and left; afterwards {leaks(state)}; "
                  f"server RSS {rss_mib(server.pid):.0f} MiB")  # fmt: skip
        finally:
            server.terminate()
            status = server.wait(120)
            disable_persistent_cache()  # its directory goes with `tmp`: nothing may write there after
        print(f"server exit status after SIGTERM: {status}")


def run_levels(engine, voice, url, server, levels, repeats, frames, speed, spread_s, label, warmup) -> None:
    print(f"\n1. time to first audio, real-time factor, throughput{label}")
    memory = []
    for n in levels:
        times = arrivals(n, spread_s, seed=n)
        runs: dict[str, list[Served]] = {"in process": [], "http": []}

        def case(name: str, times=times, runs=runs):
            def run() -> float:
                if name == "http":
                    served = asyncio.run(over_http(url, times, frames, speed))
                else:
                    served = in_process(engine, voice, times, frames)
                runs[name].append(served)
                return served.wall

            return run

        before = server_state(url)
        interleaved_times({name: case(name) for name in runs}, repeats, self_timed=True, warmup=warmup)
        after = server_state(url)
        runs = {name: served[-repeats:] for name, served in runs.items()}  # the warm-up runs left out
        for name, served in runs.items():
            p50 = describe([p(s.first_audio, 50) for s in served], ".1f", scale=1e3, repeats=False)
            p99 = describe([p(s.first_audio, 99) for s in served], ".1f", scale=1e3, repeats=False)
            rtfs = describe([rtf(s, frames) for s in served], ".3f", repeats=False)
            rate = describe([n / s.wall for s in served], ".1f", repeats=False)
            errors = sum(s.errors for s in served)
            print(f"   N={n:<4} {name:<10} first audio p50 {p50} ms, p99 {p99} ms; RTF {rtfs}; "
                  f"{rate} streams/s; {errors} errors")  # fmt: skip
        http = [p(s.first_audio, 50) for s in runs["http"]]
        local = [p(s.first_audio, 50) for s in runs["in process"]]
        print(f"   N={n:<4} first audio p50, http ÷ in process: {describe(ratios(http, local), '.2f')}")
        key = "mstar_time_to_first_output_seconds"
        count = after[f"{key}_count"] - before[f"{key}_count"]
        inside = (after[f"{key}_sum"] - before[f"{key}_sum"]) / count if count else float("nan")
        outside = statistics.mean(t for s in runs["http"] for t in s.first_audio)
        print(f"   N={n:<4} http first audio, mean: {outside * 1e3:.1f} ms at the client, "
              f"{inside * 1e3:.1f} ms in the server (submit to first chunk, the engine thread)")  # fmt: skip
        state = server_state(url)
        memory.append((n, rss_mib(server.pid), state))
    print(f"\n2. the server after each N{label}")
    for n, rss, state in memory:
        print(f"   N={n:<4} RSS {rss:.0f} MiB; {leaks(state)}")


if __name__ == "__main__":
    main()
