"""The host's own work per row-token: the engine loop with the device's work taken away.

The TTS engine serves a closed workload at batch B with every captured program replaced by one that
returns at once (outputs of the bucket's shapes made once, the caches passed through), so a step's wall
time is the host's alone: forming the rows, admission, planning, the program's inputs, the step's
bookkeeping at dispatch and when its outputs are read. Each phase is timed by wrapping the engine's
parts; "rest" is the step's wall time outside them (the step transaction, the replay call, records,
reading outputs back, the loop). A row-token is one codec frame of one stream, the talker's token:
all host work, the flow decoder's included, is charged to the frames.

Prints, per batch (1, 64 and 256 unless `--batch`) and decode steps per dispatch K (1, 8 and 32 unless
`--steps`), synchronous and pipelined: microseconds per row-token in all and per phase, median
(min–max) over the repeats, the cases run in a fresh random order each repeat (`benchmarks.timing`),
and each K's total as a ratio to K = 1's at the same batch and mode, from the same run. K = 1 is one
decode step per dispatch, the engine before decode blocks (`EngineSettings.decode_steps`).

Run: python -m benchmarks.host [--quick] [--repeats N] [--batch B ...] [--steps K ...] [--frames F]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.engine import VOICES, config_for
from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label
from mstar_jax.compile import cap_batch_sizes
from mstar_jax.models.streaming_tts import Engine, TTSPrograms, TTSRequest, tts_buckets
from mstar_jax.models.streaming_tts.model import FLOW_CHUNK, SAMPLES_PER_FRAME, StreamingTTSModel
from mstar_jax.models.streaming_tts.programs import codes_width
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.settings import EngineSettings

PHASES = ("rows", "admit", "plan", "inputs", "commit", "dispatched", "read")
TOKEN_COUNTS = (1, 8, 16)


class InstantStep:
    """A captured step's stand-in whose replay returns at once: the caches as given, and outputs of
    the bucket's shapes made beforehand (zeros: codec frame 0, silent audio)."""

    def __init__(self, walk: str, keys, width: int, mel_bins: int, steps: int):
        def outputs(bucket):
            if walk != FLOW_CHUNK:
                return jnp.zeros((width, steps), jnp.int32)
            mel = jnp.zeros((bucket.bs, bucket.num_tokens, mel_bins), jnp.float32)
            return mel, jnp.zeros((bucket.bs, bucket.num_tokens * SAMPLES_PER_FRAME), jnp.float32)

        self.outputs = {bucket: jax.block_until_ready(outputs(bucket)) for bucket in keys}

    def replay(self, bucket, params, caches, banks, plans, *inputs):
        return caches, self.outputs[bucket]


def instant_programs(model: StreamingTTSModel, batch: int, decode_steps: int = 1) -> TTSPrograms:
    """Every walk's buckets up to `batch` rows, decode blocks of `decode_steps`, each program an
    `InstantStep`."""
    buckets = tts_buckets(
        batch_sizes=cap_batch_sizes((1, 2, 4, 8, 16, 32, 64, 128, 256), batch),
        token_counts=TOKEN_COUNTS,
        flow_chunk=model.config.flow_chunk,
        combined=decode_steps == 1,
        decode_steps=decode_steps,
    )
    width, bins = codes_width(buckets), model.config.mel_bins
    steps = {
        walk: InstantStep(walk, buckets[walk].keys(), width, bins, decode_steps) for walk in buckets.walks
    }
    return TTSPrograms(buckets=buckets, steps=steps, codes_width=width, settings=model.settings)


def timed(phases: collections.Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return wrapper


def serve(
    model, config, *, batch: int, frames: int, pipelined: bool, decode_steps: int = 1
) -> tuple[float, dict[str, float]]:
    """A fresh engine on instant programs, decoding `decode_steps` frames a dispatch, serving `2 * batch`
    streams of `frames` frames, all at once; returns (microseconds per row-token, per phase)."""
    specs = {s.resource_key: s for s in config.resource_specs()}
    talker, flow = (BoundedKVManager(specs[k], num_sources=VOICES) for k in ("talker_kv", "flow_kv"))
    settings = EngineSettings(max_batch=batch, pipelined=pipelined, decode_steps=decode_steps)
    programs = instant_programs(model, batch, decode_steps)
    engine = Engine(model, talker=talker, flow=flow, programs=programs, settings=settings)
    voices = [engine.add_voice(i, frames=8 + 4 * i, seed=i) for i in range(VOICES)]
    rng = np.random.default_rng(0)
    phases: collections.Counter = collections.Counter()
    served = engine.served
    for name in ("rows", "inputs", "dispatched", "read"):
        setattr(served, name, timed(phases, name, getattr(served, name)))
    admission = engine._admission
    admission.admit = timed(phases, "admit", admission.admit)
    for node in engine.nodes.values():
        node.runner.plan = timed(phases, "plan", node.runner.plan)
        node.runner.commit = timed(phases, "commit", node.runner.commit)
    streams = [
        engine.submit(
            TTSRequest(f"r{i}", rng.integers(0, 256, 12).tolist(), voices[i % VOICES], frames, seed=i)
        )
        for i in range(2 * batch)
    ]
    start = time.perf_counter()
    engine.run_until_idle()
    wall = time.perf_counter() - start
    if engine.compilations:
        raise RuntimeError(f"{engine.compilations} programs compiled while serving")
    if any(s.failure for s in streams):
        raise RuntimeError(f"a stream failed: {next(s.failure for s in streams if s.failure)!r}")
    tokens = sum(len(s.codes) for s in streams)
    per_phase = {name: phases[name] / tokens * 1e6 for name in PHASES}
    per_phase["rest"] = (wall - sum(phases.values())) / tokens * 1e6
    return wall / tokens * 1e6, per_phase


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="batches 1 and 8, 16 frames, 2 repeats (labelled)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs of each case (default 5, quick 2)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batches (default 1 64 256)")
    parser.add_argument(
        "--steps", type=int, nargs="+", default=None, help="decode steps per dispatch K (default 1 8 32)"
    )
    parser.add_argument("--frames", type=int, default=None, help="frames per stream (default 64, quick 16)")
    args = parser.parse_args(argv)
    batches = args.batch or ([1, 8] if args.quick else [1, 64, 256])
    ks = sorted({1, *(args.steps or ([1, 8] if args.quick else [1, 8, 32]))})  # K = 1: the baseline
    frames = args.frames or (16 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 5)
    label = quick_label(args.quick, f"batches {batches}, K {ks}, {frames} frames, {repeats} repeats")
    print(f"benchmarks/host.py{label}")
    print(f"backend: {jax.default_backend()}; every program replaced by one that returns at once")
    print(f"timing: {ORDER_NOTE}; {repeats} repeats; median (min–max); 2 x batch streams of {frames} frames")
    config = config_for(max(batches) * 2)
    model = StreamingTTSModel(config)
    results: dict[tuple[int, bool, int], list[dict[str, float]]] = collections.defaultdict(list)

    def case(batch: int, pipelined: bool, k: int):
        def run() -> float:
            total, phases = serve(
                model, config, batch=batch, frames=frames, pipelined=pipelined, decode_steps=k
            )
            results[batch, pipelined, k].append({"total": total, **phases})
            return total

        return run

    cases = {(b, p, k): case(b, p, k) for b in batches for p in (False, True) for k in ks}
    interleaved_times(cases, repeats, self_timed=True)
    print(f"\nmicroseconds of host work per row-token{label}")
    print(f"   phases (medians): {', '.join(PHASES)}, and the rest of the step; ÷ K=1: the median total")
    print("   over K = 1's at the same batch and mode")
    for batch, pipelined, k in sorted(results):
        runs = results[batch, pipelined, k][-repeats:]
        total = describe([r["total"] for r in runs], ".2f", repeats=False)
        base = statistics.median(r["total"] for r in results[batch, pipelined, 1][-repeats:])
        ratio = statistics.median(r["total"] for r in runs) / base
        phases = ", ".join(
            f"{name} {statistics.median(r[name] for r in runs):.2f}" for name in (*PHASES, "rest")
        )
        mode = "pipelined" if pipelined else "synchronous"
        print(f"   batch {batch:>3} {mode:<11} K={k:<3} {total} (÷ K=1 {ratio:.3f}): {phases}")


if __name__ == "__main__":
    main()
