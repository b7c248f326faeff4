"""Child process of `test_sharded_model.py`: the streaming TTS model's steps on meshes of 8 simulated CPU
devices, against the same steps on one device. Prints one JSON line: per mesh, whether every request's
codes match, the largest mel difference, and the collectives in the compiled sharded steps.

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the parent sets it).
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
from jax.sharding import NamedSharding

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.models.streaming_tts.voices import VoiceBank
from mstar_jax.resources.kv.bounded import sharding as sh
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

CONFIG = StreamingTTSConfig(
    text_vocab_size=16, codec_vocab_size=16, d_model=32, talker_layers=2, talker_heads=4, talker_kv_heads=2,
    talker_head_dim=8, talker_ffn_dim=32, min_voice_frames=3, max_voice_frames=6, talker_sink_extra=2,
    talker_window=6, query_window=7, flow_d_model=16, flow_layers=1, flow_heads=2, flow_head_dim=8,
    flow_chunk=4, flow_window=5, flow_steps=2, mel_bins=4, max_slots=8,
)  # fmt: skip
MESHES = {"2x2": (2, 2), "4x2": (4, 2), "8x1": (8, 1), "2x1": (2, 1)}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DECODES = 9  # past the talker's 6-entry ring
REQUESTS = 6


def managers(model: StreamingTTSModel, data: int):
    specs = {spec.resource_key: spec for spec in CONFIG.resource_specs()}
    talker = BoundedKVManager(specs["talker_kv"], data_shards=data)
    flow = BoundedKVManager(specs["flow_kv"], data_shards=data)
    voice = VoiceBank(model, talker, flow).add(0, frames=4, seed=3)
    if model.mesh is not None:
        for manager in (talker, flow):
            place = lambda tree, spec: jax.device_put(tree, NamedSharding(model.mesh, spec))  # noqa: E731
            manager.cache, manager.bank = (
                place(manager.cache, sh.CACHE_SPEC),
                place(manager.bank, sh.BANK_SPEC),
            )
    return talker, flow, voice


def run(model, manager, fn, params, rids, positions, spans, arrays, tokens):
    """One step of `rids` (inputs `arrays`, one row each) laid out as the manager plans it."""
    for rid in rids:
        manager.ingest_request(rid)
    step = BoundedKVStep(
        tuple(Segment(r, "main", s) for r, s in zip(rids, spans, strict=True)),
        dict(zip(rids, positions, strict=True)),
        dict(zip(rids, spans, strict=True)),
    )
    ctx = StepContext(list(rids), "walk", 0, capture=False)
    assert manager.admit(step, ctx).ok
    width = max(np.bincount([manager.shard_of(r) for r in rids], minlength=manager.data_shards))
    ctx.slot_lease = SlotLease(0, BucketKey("walk", int(width), tokens))
    rows, row_of = manager.plan_rows(step, ctx)
    plan = manager.plan(step, ctx)
    placed = []
    for array in arrays:
        full = np.zeros((rows, *array.shape[1:]), array.dtype)
        full[[row_of[r] for r in rids]] = array
        placed.append(full)
    manager.cache, out = fn(params, manager.cache, manager.bank, plan, *placed)
    manager.commit(step, ctx)
    out = jax.device_get(out)
    return jax.tree.map(lambda x: x[[row_of[r] for r in rids]], out), (params, plan, placed)


def collectives(fn, args) -> dict[str, int]:
    text = fn.lower(*args).compile().as_text()
    return {name: len(re.findall(rf"\b{name}(?:-start)?\(", text)) for name in COLLECTIVES}


def serve(mesh_shape):
    mesh = None if mesh_shape is None else sh.make_mesh(*mesh_shape)
    model = StreamingTTSModel(CONFIG, implementation="xla", mesh=mesh)
    talker, flow, voice = managers(model, 1 if mesh_shape is None else mesh_shape[0])
    talker_step = jax.jit(model.talker_step, donate_argnums=1)
    flow_step = jax.jit(model.flow_step, donate_argnums=1)
    rng = np.random.default_rng(0)
    rids = [f"r{i}" for i in range(REQUESTS)]
    seeds = np.arange(1, REQUESTS + 1, dtype=np.uint32)
    prompt = rng.integers(0, CONFIG.text_vocab_size, (REQUESTS, 4)).astype(np.int32)
    lengths = np.full(REQUESTS, 4, np.int32)
    codes, args = run(
        model, talker, talker_step, model.talker_params, rids, [voice.position(0)] * REQUESTS, [4] * REQUESTS,
        (prompt, lengths, seeds), 4,
    )  # fmt: skip
    history = [codes]
    for i in range(DECODES):
        tokens = model.code_tokens(history[-1][:, None])
        codes, args = run(
            model, talker, talker_step, model.talker_params, rids, [voice.position(4 + i)] * REQUESTS,
            [1] * REQUESTS, (tokens, np.ones(REQUESTS, np.int32), seeds), 1,
        )  # fmt: skip
        history.append(codes)
    found = {"talker": collectives(talker_step, (args[0], talker.cache, talker.bank, args[1], *args[2]))}
    mels = []
    frames = np.stack(history[1:9], axis=1)  # 8 frames per request, two chunks of 4
    for chunk in range(2):
        (mel, _), args = run(
            model, flow, flow_step, model.flow_params, rids, [voice.position(4 * chunk)] * REQUESTS,
            [4] * REQUESTS, (frames[:, 4 * chunk : 4 * chunk + 4], seeds), 4,
        )  # fmt: skip
        mels.append(mel)
    found["flow"] = collectives(flow_step, (args[0], flow.cache, flow.bank, args[1], *args[2]))
    return np.stack(history, axis=1), np.concatenate(mels, axis=1), found


def main() -> None:
    codes, mel, _ = serve(None)
    results = {}
    for name, shape in MESHES.items():
        got_codes, got_mel, found = serve(shape)
        results[name] = {
            "codes_equal": bool(np.array_equal(got_codes, codes)),
            "codes": int(codes.size),
            "max_mel_diff": float(np.abs(got_mel - mel).max()),
            "collectives": found,
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
