"""Child process of `test_mesh_engine.py`: one workload served by the engine on one device and on meshes
of 8 simulated CPU devices. Prints one JSON line: per mesh, whether each request's codes equal the
single-device engine's, the largest audio difference, compilations after warm-up, and the report's mesh.

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the parent sets it).
"""

from __future__ import annotations

import collections
import json
import re
import tempfile
from collections.abc import Callable

import numpy as np

from mstar_jax.compile import assert_no_compilations
from mstar_jax.deployment import parse_deployment
from mstar_jax.engine.faults import inject_faults
from mstar_jax.models.streaming_tts import Engine, TTSRequest
from mstar_jax.models.streaming_tts.report import summarize

# Eight KV heads in both caches and eight slots, so every split of 8 devices divides them.
MODEL = {
    "text_vocab_size": 16, "codec_vocab_size": 16, "d_model": 32, "talker_layers": 2, "talker_heads": 8,
    "talker_kv_heads": 8, "talker_head_dim": 4, "talker_ffn_dim": 32, "min_voice_frames": 3,
    "max_voice_frames": 6, "talker_sink_extra": 2, "talker_window": 6, "query_window": 7,
    "flow_d_model": 32, "flow_layers": 1, "flow_heads": 8, "flow_head_dim": 4, "flow_chunk": 4,
    "flow_window": 5, "flow_steps": 2, "mel_bins": 4, "max_slots": 8,
}  # fmt: skip
# The talker with 2 KV heads: on 4 model shards each holds a copy of one.
REPLICATED = {**MODEL, "talker_kv_heads": 2}
# (data, model, model config) per case, each against the one-device engine: data shards alone, both axes,
# and more model shards than the talker has KV heads. (Decode blocks on a mesh without pipelining run in
# test_multiprocess_engine.py, on the same 4 x 2 mesh across two processes.)
MESHES = {"8x1": (8, 1, "MODEL"), "4x2": (4, 2, "MODEL"), "2x4_replicated_kv": (2, 4, "REPLICATED")}
REQUESTS = 6
PIPELINED = {"4x2_pipelined": (4, 2, 1), "8x1_pipelined_decode_steps_4": (8, 1, 4)}
"""Meshes whose engine is pipelined: (data, model, K), against the one-device synchronous K = 1 engine."""


def serve(
    data: int,
    model: int,
    config: dict,
    share: tuple[int, int] = (0, 1),
    decode_steps: int = 1,
    pipelined: bool = False,
    snapshot_every: int | None = None,
    faults: tuple[str, Callable[[int], str | None]] | None = None,
    offload_at: int | None = None,
    cache_dir: str | None = None,
    late_after: int | None = None,
    max_batch: int = 2,
) -> tuple[Engine, dict[str, tuple[list[int], np.ndarray]]]:
    """The workload's requests `i` with `i % count == index` for `share = (index, count)`, served on a
    `data x model` mesh decoding `decode_steps` frames a dispatch (`pipelined` or not), snapshotting every
    `snapshot_every` steps, with `faults = (node, schedule)` injected (`inject_faults`), and after
    `offload_at` steps its first request still holding a talker slot offloaded (reloaded when it is
    next admitted), its programs kept in and loaded from `cache_dir` (`compile.persistent_cache_dir`)
    where given, and the last process's requests submitted only after `late_after` steps (where given;
    the others' at once), at most `max_batch` rows a step; each request's codes and audio."""
    deployment = parse_deployment({
        "model": {"name": "streaming_tts", "config": config},
        "compile": {
            "batch_sizes": [1, 2], "token_counts": [1, 4], "persistent_cache_dir": cache_dir,
            "persistent_cache_min_compile_secs": 0.0,
        },
        "engine": {
            "max_batch": max_batch, "decode_steps": decode_steps, "pipelined": pipelined,
            "snapshot_every": snapshot_every,
        },
        "mesh": {"data": data, "model": model},
    })  # fmt: skip
    engine = Engine.from_deployment(deployment, progress=False, max_workers=2)
    if faults is not None:
        inject_faults(engine, *faults)
    voices = [engine.add_voice(i, frames=3 + i, seed=10 + i) for i in range(2)]
    rng = np.random.default_rng(0)
    requests = []
    for i in range(REQUESTS):
        text = rng.integers(0, 16, 3 + i).tolist()
        frames = int(rng.integers(5, 15))
        if i % share[1] == share[0]:
            requests.append(TTSRequest(f"r{i}", text, voices[i % 2], frames, seed=i))
    submit_after = late_after if late_after is not None and share[0] == share[1] - 1 else 0
    streams, steps = [], 0  # `run_until_idle`'s loop, every process stepping as often (`busy_anywhere`)
    while engine.busy_anywhere(bool(engine.streams) or len(streams) < len(requests)):
        if steps == submit_after:
            streams = [engine.submit(request) for request in requests]
        if offload_at is None and late_after is None:  # a few rounds at a time: in lockstep, every
            steps += engine.run_until_idle(max_steps=3)  # process stops after as many
            continue
        engine.step()
        steps += 1
        if steps == offload_at:  # this process's own: nothing the others take part in
            held = [s for s in streams if engine.nodes["talker"].holds(s.request_id)]
            with assert_no_compilations("an offload after warm-up"):  # warm-up compiled what it runs
                engine.offload(held[0].request_id)
    return engine, {s.request_id: (s.codes, s.audio) for s in streams}


COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def collectives(hlo: str) -> dict[str, int]:
    """How many of each collective a compiled program's HLO holds."""
    found = re.findall(rf"= \S+ ({'|'.join(COLLECTIVES)})(?:-start)?\(", hlo)
    return dict(sorted(collections.Counter(found).items()))


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        print(json.dumps(served_on_meshes(cache)))


def served_on_meshes(cache: str) -> dict:
    """Every case's findings. The engines share one `compile.persistent_cache_dir`: a program two cases
    have in common (the same mesh, walk and bucket) is compiled once, and loaded from the executable
    store by the other, which serves every request all the same."""
    configs = {"MODEL": MODEL, "REPLICATED": REPLICATED}
    alone = {name: serve(1, 1, config, cache_dir=cache)[1] for name, config in configs.items()}
    results = {}
    cases = {name: (data, model, config, 1, False) for name, (data, model, config) in MESHES.items()}
    cases |= {name: (data, model, "MODEL", k, True) for name, (data, model, k) in PIPELINED.items()}
    for name, (data, model, config, k, pipelined) in cases.items():
        engine, served = serve(
            data, model, configs[config], decode_steps=k, pipelined=pipelined, cache_dir=cache
        )
        reference = alone[config]
        report = summarize(engine, wall_secs=1.0, capture_secs=1.0, warmup_compilations=0)
        results[name] = {
            "done": report["streams"]["done"],
            "codes_equal": all(served[rid][0] == codes for rid, (codes, _) in reference.items()),
            "max_audio_diff": max(
                float(np.abs(served[rid][1] - audio).max()) for rid, (_, audio) in reference.items()
            ),
            "compilations": engine.compilations,
            "mesh": report["mesh"],
            "decode_tokens": sorted(
                {r.bucket.num_tokens for r in engine.records if r.walk == "talker_decode"}
            ),
            "overlap": engine.stats.pipeline(),
            "walks": sorted({r.walk for r in engine.records}),
            "collectives": {
                walk: sorted({json.dumps(collectives(p.as_text())) for p in step.programs.values()})
                for walk, step in engine.programs.steps.items()
            },
        }
    return results


if __name__ == "__main__":
    main()
