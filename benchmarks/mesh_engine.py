"""Section 4 of `benchmarks/mesh.py`: the engine serving one workload on a mesh ÷ on one device.

Every engine has the same global batch (`GLOBAL_BATCH` rows a step: one bucket of `GLOBAL_BATCH / data`
rows per data shard) and serves the same `REQUESTS` requests, from submission until every stream is done,
voices registered once beforehand; each engine is warmed up by one untimed run. A repeat times one run
on every engine, in a fresh random order every repeat (`benchmarks.timing`). The figure is frames/s ÷ one
device's in the same repeat.
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks.timing import Spread, interleaved_times, ratios
from mstar_jax.deployment import parse_deployment
from mstar_jax.models.streaming_tts import Engine, TTSRequest

GLOBAL_BATCH = 16
REQUESTS = 16
# A small streaming TTS model with 8 KV heads and 16 slots in both caches, so every mesh splits them.
MODEL = {
    "text_vocab_size": 64, "codec_vocab_size": 64, "d_model": 64, "talker_layers": 2, "talker_heads": 8,
    "talker_kv_heads": 8, "talker_head_dim": 8, "talker_ffn_dim": 128, "min_voice_frames": 4,
    "max_voice_frames": 8, "talker_sink_extra": 2, "talker_window": 16, "query_window": 17,
    "flow_d_model": 64, "flow_layers": 2, "flow_heads": 8, "flow_head_dim": 8, "flow_chunk": 4,
    "flow_window": 8, "flow_steps": 2, "mel_bins": 8, "max_slots": GLOBAL_BATCH,
}  # fmt: skip


def build(data: int, model: int) -> tuple[Engine, list]:
    """An engine on a `data x model` mesh (1 x 1: one device, no mesh) with its voices registered."""
    deployment = parse_deployment({
        "model": {"name": "streaming_tts", "config": MODEL},
        "compile": {"batch_sizes": [GLOBAL_BATCH // data], "token_counts": [1, 8]},
        "engine": {"max_batch": GLOBAL_BATCH},
        "mesh": {"data": data, "model": model},
    })  # fmt: skip
    engine = Engine.from_deployment(deployment, progress=False)
    return engine, [engine.add_voice(i, frames=4 + i, seed=i) for i in range(2)]


def drawn() -> list[tuple[list[int], int]]:
    """Each request's text tokens and frames (24..40), the same every time."""
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 64, 6).tolist(), int(rng.integers(24, 41))) for _ in range(REQUESTS)]


def workload(voices: list, tag: str) -> list[TTSRequest]:
    """The requests of `drawn`, ids tagged so that an engine serves them again."""
    return [
        TTSRequest(f"{tag}-{i}", text, voices[i % 2], frames, seed=i)
        for i, (text, frames) in enumerate(drawn())
    ]


def runner(engine: Engine, voices: list):
    """A zero-argument function serving the workload once; returns nothing (timed by the caller)."""
    runs = iter(range(1_000_000))

    def run() -> None:
        streams = [engine.submit(request) for request in workload(voices, f"run{next(runs)}")]
        engine.run_until_idle()
        failed = [s.request_id for s in streams if s.error]
        if failed:
            raise RuntimeError(f"requests {failed} failed: {streams[0].error}")

    return run


def frames() -> int:
    return sum(frames for _, frames in drawn())


def engine_section(meshes, repeats: int, cores: int | None) -> list[Spread]:
    """Print section 4's table; return the frames/s ratio of each mesh (after the 1-device baseline)."""
    shapes = [(1, 1), *meshes]
    engines = [build(data, model) for data, model in shapes]
    times = interleaved_times([runner(*built) for built in engines], repeats)
    throughput = [Spread.of(ratios(record, times[0], inverse=True)) for record in times]
    total = frames()
    print(
        f"\n## 4. The engine: one workload on each mesh ÷ on 1 device\n\n{REQUESTS} requests, {total} "
        f"frames, {GLOBAL_BATCH} rows a step at most on every mesh; talker and flow, 8 KV heads each. The "
        f"simulated devices share this host's {cores} cores: this is what the mesh costs the engine "
        "(partitioned programs, shard-major layouts, per-shard padding), not scaling.\n"
    )
    print(f"| mesh | rows per data shard | frames/s | ÷ 1 device, {repeats} repeats |")
    print("| --- | --- | --- | --- |")
    for (data, model), record, ratio in zip(shapes, times, throughput, strict=True):
        name = "1 device" if data * model == 1 else f"{data}x{model}"
        fps = total / statistics.median(record)
        print(f"| {name} | {GLOBAL_BATCH // data} | {fps:,.0f} | {ratio.format(repeats=False)} |")
    for engine, _ in engines:
        if engine.compilations:
            raise RuntimeError(f"an engine compiled {engine.compilations} times while timed")
    return throughput[1:]
