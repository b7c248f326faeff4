"""Soak: serve a randomized workload for many steps and count what must stay zero.

Arrivals, cancellations, pauses with offloads and malformed requests are drawn per step from one seeded
generator, injected device faults (see `mstar_jax.engine.faults`) from a second, drawn alike every step,
so the faults do not depend on the streams' timing. Once the workload drains, it reports:

- mismatches: finished requests whose codes or audio differ, in any bit, from the same request served
  alone by an idle engine sharing the programs, checked as each finishes (every one, or every Nth
  with `--verify-every N`) and then dropped, so the soak itself holds no audio;
- leaked slots and leaked source readers in both caches, and request records left behind;
- malformed requests that were accepted, or that changed the engine's state when refused;
- live device bytes (`jax.live_arrays`) and host RSS at the start, once warm (a tenth of the way in:
  the first steps fill allocator pools and caches) and at the end of the drain.

Goal: 0 mismatches, 0 leaks, device bytes equal, host RSS flat from warm to end. Requests lost to a
fault fail with a retryable error when snapshots are off (`--snapshot-every 0`); with them on, none
should fail.

Run: python -m benchmarks.soak [--steps 10000] [--seed 0] [--snapshot-every 8] [--config PATH]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment
from mstar_jax.engine import Phase
from mstar_jax.engine.faults import FAULT_KINDS, inject_faults
from mstar_jax.models.streaming_tts import Engine, Stream, TTSRequest
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.settings import EngineSettings


@dataclasses.dataclass(frozen=True)
class Rates:
    """Per-step probabilities of each event."""

    arrive: float = 0.25
    cancel: float = 0.01
    pause: float = 0.02
    bad: float = 0.03
    fault: float = 0.01
    max_live: int = 12
    max_frames: int = 24
    max_text: int = 12


@dataclasses.dataclass
class SoakReport:
    steps: int
    submitted: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bad_refused: int = 0
    bad_accepted: int = 0
    bad_changed_state: int = 0
    faults_injected: int = 0
    checked: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)
    leaked_slots: int = 0
    leaked_readers: int = 0
    leaked_records: int = 0
    device_bytes: tuple[int, ...] = ()
    host_rss: tuple[int, ...] = ()
    wall_s: float = 0.0
    batch_sizes: set[int] = dataclasses.field(default_factory=set)  # of every step, whatever the history

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["mismatches"] = len(self.mismatches)
        out["batch_sizes"] = sorted(self.batch_sizes)
        return out


class FakeClock:
    """Advances 1 ms per read, so holds and idle times follow the step count, not the host's speed."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def live_device_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_state(engine: Engine) -> tuple:
    managers = (engine.talker, engine.flow)
    return (
        tuple(engine.streams),
        tuple(m.free_slots for m in managers),
        tuple(m.request_ids for m in managers),
        tuple(sorted(engine.voices.voices.items())),
    )


def bad_requests(engine: Engine, rng: np.random.Generator, live: list[str]) -> list[Callable[[], object]]:
    """Calls that must each raise a typed error and change nothing."""
    voices = list(engine.voices.voices.values())
    voice = voices[rng.integers(len(voices))]
    vocab = engine.model.config.text_vocab_size
    unused = next(i for i in range(engine.voices.capacity) if i not in engine.voices.voices)
    text = (1, 2)
    calls = [
        lambda: engine.submit(TTSRequest("bad", text, Voice(unused, voice.frames), 4)),
        lambda: engine.submit(TTSRequest("bad", text, Voice(voice.index, voice.frames + 1), 4)),
        lambda: engine.submit(TTSRequest("bad", (1, vocab), voice, 4)),
        lambda: engine.submit(TTSRequest("bad", (1.5, 2), voice, 4)),
        lambda: engine.submit(TTSRequest("bad", text, voice, 0)),
        lambda: engine.submit(TTSRequest("", text, voice, 4)),
        lambda: engine.submit("speak"),
        lambda: engine.pause("nobody"),
        lambda: engine.offload("nobody"),
    ]
    if live:
        calls.append(lambda: engine.submit(TTSRequest(live[0], text, voice, 4)))
    return calls


def serve_alone(reference: Engine, request: TTSRequest) -> Stream:
    stream = reference.submit(request)
    reference.run_until_idle()
    return stream


def same_output(a: Stream, b: Stream) -> bool:
    if a.codes != b.codes or len(a.chunks) != len(b.chunks):
        return False
    return all(
        x.first_frame == y.first_frame
        and all(np.array_equal(p, q) for p, q in ((x.codes, y.codes), (x.mel, y.mel), (x.samples, y.samples)))
        for x, y in zip(a.chunks, b.chunks, strict=True)
    )


def soak(
    engine: Engine,
    reference: Engine,
    *,
    steps: int,
    seed: int,
    rates: Rates = Rates(),
    verify_every: int = 1,
) -> SoakReport:
    """Serve `steps` randomized engine steps on `engine`, drain, and check against `reference`.

    Both engines must share programs and have the same voices registered; `reference` must be idle.
    """
    rng = np.random.default_rng(seed)
    # The faults' own generator, drawn the same way every step: how many are injected, and where, never
    # depends on the draws above it, which follow the streams' timing (a pipelined copy landing late).
    fault_rng = np.random.default_rng([seed, 1])
    report = SoakReport(steps=steps)
    engine.clock = reference.clock = FakeClock()
    pending: dict[str, str | None] = {"talker": None, "flow": None}

    def schedule_for(node: str):
        def schedule(_):
            fault, pending[node] = pending[node], None
            return fault

        return schedule

    for node in pending:
        inject_faults(engine, node, schedule_for(node))
    report.device_bytes, report.host_rss = (live_device_bytes(),), (host_rss(),)
    started = time.perf_counter()
    voices = list(engine.voices.voices.values())
    tracked: dict[str, Stream] = {}
    finished = 0

    def settle() -> None:
        """Count, and check against `reference`, the tracked streams that finished; forget them."""
        nonlocal finished
        for rid in [rid for rid, stream in tracked.items() if stream.phase.finished]:
            stream = tracked.pop(rid)
            report.outcomes[stream.phase.value] += 1
            if stream.phase is Phase.FAILED:
                report.failures[type(stream.failure).__name__] += 1
            if stream.phase is Phase.DONE and finished % verify_every == 0:
                report.checked += 1
                if not same_output(stream, serve_alone(reference, stream.request)):
                    report.mismatches.append(rid)
            finished += 1

    resume_at: dict[str, int] = {}
    for step in range(steps):
        if step == steps // 10:
            report.device_bytes += (live_device_bytes(),)
            report.host_rss += (host_rss(),)
        live = [rid for rid, s in engine.streams.items() if not s.phase.finished]
        if rng.random() < rates.arrive and len(live) < rates.max_live:
            rid = f"r{report.submitted}"
            text = tuple(
                int(t)
                for t in rng.integers(
                    0, engine.model.config.text_vocab_size, rng.integers(1, rates.max_text + 1)
                )
            )
            request = TTSRequest(
                rid, text, voices[rng.integers(len(voices))], int(rng.integers(1, rates.max_frames + 1)),
                int(rng.integers(2**32)),
            )  # fmt: skip
            tracked[rid] = engine.submit(request)
            report.submitted += 1
        if rng.random() < rates.bad:
            calls = bad_requests(engine, rng, live)
            before = engine_state(engine)
            try:
                calls[rng.integers(len(calls))]()
                report.bad_accepted += 1
            except (ValueError, TypeError):
                report.bad_refused += 1
            report.bad_changed_state += engine_state(engine) != before
        if live and rng.random() < rates.cancel:
            engine.cancel(live[rng.integers(len(live))])
        unpaused = [rid for rid in live if rid in engine.streams and not engine.streams[rid].paused]
        if unpaused and rng.random() < rates.pause:
            rid = unpaused[rng.integers(len(unpaused))]
            engine.pause(rid)
            engine.offload(rid)
            resume_at[rid] = step + int(rng.integers(1, 40))
        for rid in [rid for rid, at in resume_at.items() if at <= step]:
            del resume_at[rid]
            if rid in engine.streams:
                engine.resume(rid)
        draw, node, kind = fault_rng.random(), fault_rng.integers(2), fault_rng.integers(len(FAULT_KINDS))
        if draw < rates.fault:
            pending[("talker", "flow")[node]] = FAULT_KINDS[kind]
            report.faults_injected += 1
        engine.step()
        report.batch_sizes.update(record.bucket.bs for record in engine.records)  # before they age out
        settle()
    pending.update(talker=None, flow=None)
    for rid in list(engine.streams):
        engine.resume(rid)
    engine.run_until_idle()
    settle()
    report.wall_s = time.perf_counter() - started
    engine.finished.clear()  # what a client-facing server hands back and forgets
    reference.finished.clear()
    report.device_bytes += (live_device_bytes(),)
    report.host_rss += (host_rss(),)

    settle()
    managers: tuple[BoundedKVManager, ...] = (engine.talker, engine.flow)
    report.leaked_slots = sum(m.config.max_slots - m.free_slots for m in managers)
    report.leaked_readers = sum(m.readers(i) for m in managers for i in range(m.bank.num_sources))
    report.leaked_records = sum(len(m.request_ids) for m in managers)
    return report


def reference_engine(engine: Engine) -> Engine:
    """An idle engine on fresh caches sharing `engine`'s model and programs, with the same voices."""
    talker = BoundedKVManager(engine.talker.spec, num_sources=engine.talker.bank.num_sources)
    flow = BoundedKVManager(engine.flow.spec, num_sources=engine.flow.bank.num_sources)
    reference = Engine(
        engine.model,
        talker=talker,
        flow=flow,
        programs=engine.programs,
        settings=EngineSettings(max_batch=engine.max_batch, decode_steps=engine.settings.decode_steps),
        history=1,
    )
    reference.warm_up()
    return reference


def add_voices(engines: list[Engine], count: int, seed: int) -> None:
    config = engines[0].model.config
    rng = np.random.default_rng(seed)
    for index in range(count):
        frames = int(rng.integers(config.min_voice_frames, config.max_voice_frames + 1))
        for engine in engines:
            engine.add_voice(index, frames=frames, seed=seed + index)


def format_report(report: SoakReport) -> str:
    (d0, _, d1), (h0, hw, h1) = report.device_bytes, report.host_rss
    lines = [
        f"steps {report.steps}, requests {report.submitted}: {dict(report.outcomes)}; "
        f"failures {dict(report.failures) or 'none'}; {report.wall_s:.1f} s",
        f"faults injected {report.faults_injected}; malformed requests refused {report.bad_refused}, "
        f"accepted {report.bad_accepted}, changed state {report.bad_changed_state}",
        f"mismatches {len(report.mismatches)} of {report.checked} checked against the request served alone",
        f"leaked: slots {report.leaked_slots}, source readers {report.leaked_readers}, "
        f"request records {report.leaked_records}",
        f"live device bytes {d0:,} -> {d1:,} ({d1 - d0:+,}); host RSS {h0 / 2**20:.1f} MiB at the start, "
        f"{hw / 2**20:.1f} warm, {h1 / 2**20:.1f} at the end ({(h1 - hw) / 2**20:+.1f} since warm)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> SoakReport:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=8, help="0: no snapshots")
    parser.add_argument("--verify-every", type=int, default=1, help="check every Nth finished request")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    deployment = load_deployment(args.config)
    snapshot_every = args.snapshot_every or None
    deployment = dataclasses.replace(
        deployment, engine=dataclasses.replace(deployment.engine, snapshot_every=snapshot_every)
    )
    engine = Engine.from_deployment(deployment, progress=False, history=64)
    reference = reference_engine(engine)
    add_voices([engine, reference], deployment.workload.voices, seed=args.seed + 1000)
    report = soak(engine, reference, steps=args.steps, seed=args.seed, verify_every=args.verify_every)
    print(json.dumps(report.as_dict(), default=list) if args.json else format_report(report))
    return report


if __name__ == "__main__":
    main()
