"""The engine loop, pipelined against synchronous: one workload, the same programs, both ways.

A synchronous engine reads every step's outputs back before it plans the next, so the host's work
(forming the batch, admission, planning, inputs, bookkeeping) and the device's never overlap. A
pipelined one (`EngineSettings(pipelined=True)`) dispatches step t + 1 before it reads step t. Prints,
from one run, for a closed workload of `--streams` requests arriving at once at batch `--batch`:

  1. steps/s, frames/s and time to first audio (median over the streams), each way, and pipelined ÷
     synchronous;
  2. the host's own time: per step and per row (the step's wall time less the time it waits on the
     device, which is what a faster device would not shorten), and the host's share of each step;
  3. the fraction of the synchronous engine's host time the pipelined one hides behind the device:
     (synchronous step time - pipelined step time) / synchronous host time per step;
  4. with decode blocks of K steps a dispatch (`--steps`, default 1 and 8; `EngineSettings.decode_steps`):
     frames/s and time to first audio at each K ÷ K = 1's, each way.

Every engine (each way, each K) gets the same requests and must give every request the same codes
(checked). Runs are
interleaved in a fresh random order every repeat (`benchmarks.timing`); figures are medians with their
min–max over the repeats. On a CPU host the "device" is the same two cores the host runs on, so the
overlap is far smaller than on an accelerator, which computes while the host plans.

Run: python -m benchmarks.engine [--quick] [--repeats N] [--batch B] [--streams N] [--steps K ...]
     [--trace DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label, ratios
from benchmarks.trace_summary import add_trace_argument, write_trace
from mstar_jax.compile import cap_batch_sizes
from mstar_jax.engine import dispatch as dispatch_module
from mstar_jax.models.streaming_tts import Engine, TTSPrograms, TTSRequest, tts_buckets
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.settings import EngineSettings

VOICES = 4
TOKEN_COUNTS = (1, 8, 16)


@dataclasses.dataclass
class Served:
    """One run's figures."""

    wall: float
    steps: int
    frames: int
    first_audio: list[float]
    waited: float  # seconds the host spent blocked on the device's outputs
    rows: int  # real rows over every step
    codes: dict[str, list[int]]


def config_for(batch: int) -> StreamingTTSConfig:
    """The default deployment's model, its caches holding `batch` streams."""
    return StreamingTTSConfig(
        text_vocab_size=256, codec_vocab_size=256, d_model=64, talker_layers=2, talker_heads=4,
        talker_kv_heads=2, talker_head_dim=16, talker_ffn_dim=128, min_voice_frames=8, max_voice_frames=24,
        talker_sink_extra=4, talker_window=32, query_window=33, flow_d_model=64, flow_layers=2, flow_heads=4,
        flow_head_dim=16, flow_chunk=8, flow_window=16, flow_steps=2, mel_bins=16, max_slots=batch,
    )  # fmt: skip


class WaitClock:
    """Counts the seconds the engine blocks reading outputs back (`dispatch.host_local`)."""

    def __init__(self):
        self.seconds = 0.0
        self._read = dispatch_module.host_local

    def __call__(self, tree):
        start = time.perf_counter()
        out = jax.block_until_ready(self._read(tree))
        self.seconds += time.perf_counter() - start
        return out


def requests(config: StreamingTTSConfig, voices, streams: int, seed: int = 0) -> list[TTSRequest]:
    rng = np.random.default_rng(seed)
    return [
        TTSRequest(
            f"r{i}",
            rng.integers(0, config.text_vocab_size, int(rng.integers(8, 25))).tolist(),
            voices[i % len(voices)],
            int(rng.integers(24, 97)),
            seed=i,
        )
        for i in range(streams)
    ]


def serve(model, programs, config, *, batch: int, streams: int, pipelined: bool) -> Served:
    """A fresh engine serving the workload to the end (decoding as many steps a dispatch as `programs`)."""
    specs = {s.resource_key: s for s in config.resource_specs()}
    talker, flow = (BoundedKVManager(specs[k], num_sources=VOICES) for k in ("talker_kv", "flow_kv"))
    settings = EngineSettings(max_batch=batch, pipelined=pipelined, decode_steps=programs.decode_steps)
    engine = Engine(model, talker=talker, flow=flow, programs=programs, settings=settings)
    engine.warm_up()
    voices = [engine.add_voice(i, frames=8 + 4 * i, seed=i) for i in range(VOICES)]
    clock = WaitClock()
    dispatch_module.host_local = clock
    try:
        start = time.perf_counter()
        submitted = [engine.submit(r) for r in requests(config, voices, streams)]
        steps = engine.run_until_idle()
        wall = time.perf_counter() - start
    finally:
        dispatch_module.host_local = clock._read
    if engine.compilations:
        raise RuntimeError(f"{engine.compilations} programs compiled while serving")
    return Served(
        wall=wall, steps=steps, frames=sum(s.request.frames for s in submitted),
        first_audio=[s.first_audio_at - s.submitted_at for s in submitted], waited=clock.seconds,
        rows=sum(r.rows for r in engine.records), codes={s.request_id: list(s.codes) for s in submitted},
    )  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="batch 16, 32 streams, 3 repeats (labelled)")
    parser.add_argument("--repeats", type=int, default=None, help="runs each way (default 7, quick 3)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 64, quick 16)")
    parser.add_argument("--streams", type=int, default=None, help="requests (default 4 x batch)")
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[8], help="decode steps per dispatch K besides 1 (default 8)"
    )
    add_trace_argument(parser, "serve the workload once more, pipelined at the largest K,")
    args = parser.parse_args(argv)
    ks = sorted({1, *args.steps})
    batch = args.batch or (16 if args.quick else 64)
    streams = args.streams or (2 if args.quick else 4) * batch
    repeats = args.repeats or (3 if args.quick else 7)
    label = quick_label(args.quick, f"batch {batch}, K {ks}, {streams} streams, {repeats} repeats")
    config = config_for(batch)
    model = StreamingTTSModel(config)
    specs = {s.resource_key: s for s in config.resource_specs()}
    talker, flow = (BoundedKVManager(specs[k], num_sources=VOICES) for k in ("talker_kv", "flow_kv"))
    print(f"benchmarks/engine.py{label}")
    print(f"backend: {jax.default_backend()}; batch {batch}, {streams} streams of 24..96 frames, all at once")
    print(f"timing: {ORDER_NOTE}; {repeats} repeats; median (min–max)")
    programs = {}
    for k in ks:
        buckets = tts_buckets(
            batch_sizes=cap_batch_sizes((1, 2, 4, 8, 16, 32, 64, 128), batch),
            token_counts=TOKEN_COUNTS, flow_chunk=config.flow_chunk, combined=k == 1, decode_steps=k,
        )  # fmt: skip
        started = time.perf_counter()
        programs[k] = TTSPrograms.capture(
            model, buckets, talker=talker, flow=flow, progress=False, max_workers=2
        )
        count = sum(len(s) for s in programs[k].steps.values())
        print(f"captured {count} programs for K={k} in {time.perf_counter() - started:.0f} s")

    every: dict[tuple[str, int], list[Served]] = {
        (m, k): [] for k in ks for m in ("synchronous", "pipelined")
    }

    def case(mode: str, k: int):
        def run() -> float:
            served = serve(
                model, programs[k], config, batch=batch, streams=streams, pipelined=mode == "pipelined"
            )
            every[mode, k].append(served)
            return served.wall

        return run

    walls = interleaved_times({key: case(*key) for key in every}, repeats, self_timed=True)
    first = every["synchronous", 1][0].codes
    for key, served in every.items():
        if any(r.codes != first for r in served):
            raise RuntimeError(
                f"the {key[0]} engine at K={key[1]} generated other codes than synchronous K=1"
            )
    runs = {mode: every[mode, 1] for mode in ("synchronous", "pipelined")}
    wall = {mode: walls[mode, 1] for mode in runs}
    per_step = {n: [r.wall / r.steps for r in rs[-repeats:]] for n, rs in runs.items()}
    host = {n: [(r.wall - r.waited) / r.steps for r in rs[-repeats:]] for n, rs in runs.items()}

    print(f"\n1. throughput and latency{label}")
    for name, served in runs.items():
        served = served[-repeats:]
        steps_s = describe([r.steps / r.wall for r in served], ".0f", repeats=False)
        frames_s = describe([r.frames / r.wall for r in served], ".0f", repeats=False)
        ttfa = describe([statistics.median(r.first_audio) for r in served], ".1f", scale=1e3, repeats=False)
        print(f"   {name:<12} {steps_s} steps/s, {frames_s} frames/s, first audio {ttfa} ms")
    ratio = describe(ratios(wall["pipelined"], wall["synchronous"]), ".3f")
    print(f"   pipelined ÷ synchronous wall time: {ratio}")

    print(f"\n2. the host's own time (a step's wall less its waits on the device){label}")
    for name, served in runs.items():
        served = served[-repeats:]
        us = describe(host[name], ".0f", scale=1e6, repeats=False)
        row = describe([(r.wall - r.waited) / r.rows for r in served], ".1f", scale=1e6, repeats=False)
        shares = [h / s for h, s in zip(host[name], per_step[name], strict=True)]
        share = describe(shares, ".2f", repeats=False)
        print(f"   {name:<12} {us} us a step, {row} us a row; host share of a step {share}")

    sync, pipe = per_step["synchronous"], per_step["pipelined"]
    hidden = [(s - p) / h for s, p, h in zip(sync, pipe, host["synchronous"], strict=True)]
    print(f"\n3. host time hidden behind the device by pipelining{label}")
    print(f"   (synchronous - pipelined step time) ÷ synchronous host time: {describe(hidden, '.2f')}")

    print(f"\n4. K decode steps per dispatch, against K = 1 the same way{label}")
    for (mode, k), served in every.items():
        served, base = served[-repeats:], every[mode, 1][-repeats:]
        frames_s = describe([r.frames / r.wall for r in served], ".0f", repeats=False)
        ttfa = describe([statistics.median(r.first_audio) for r in served], ".1f", scale=1e3, repeats=False)
        speed = describe(ratios(walls[mode, 1], walls[mode, k]), ".3f", repeats=False)
        waits = [statistics.median(r.first_audio) for r in served]
        base_waits = [statistics.median(r.first_audio) for r in base]
        later = describe(ratios(waits, base_waits), ".3f", repeats=False)
        print(
            f"   {mode:<12} K={k:<3} {frames_s} frames/s (× K=1 {speed}), first audio {ttfa} ms "
            f"(÷ K=1 {later})"
        )
    if args.trace is not None:
        k = ks[-1]
        write_trace(
            args.trace,
            lambda: serve(model, programs[k], config, batch=batch, streams=streams, pipelined=True),
        )


if __name__ == "__main__":
    main()
