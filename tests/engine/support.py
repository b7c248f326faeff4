"""What the engine tests share: a tiny model's configuration, engines over one set of captured programs,
and requests whose text is drawn from a stable digest of their id (not `hash()`, salted per process).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from mstar_jax.engine import Phase
from mstar_jax.models.streaming_tts import Engine, TTSRequest
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import SAMPLES_PER_FRAME
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.settings import EngineSettings

CONFIG = StreamingTTSConfig(
    text_vocab_size=16, codec_vocab_size=16, d_model=32, talker_layers=2, talker_heads=2, talker_kv_heads=1,
    talker_head_dim=8, talker_ffn_dim=32, min_voice_frames=3, max_voice_frames=6, talker_sink_extra=2,
    talker_window=6, query_window=7, flow_d_model=16, flow_layers=1, flow_heads=2, flow_head_dim=8,
    flow_chunk=4, flow_window=5, flow_steps=2, mel_bins=4, max_slots=2,
)  # fmt: skip
SOURCES = 8
BATCH_SIZES, TOKEN_COUNTS = (2,), (1, 4)


def managers():
    specs = {spec.resource_key: spec for spec in CONFIG.resource_specs()}
    return (
        BoundedKVManager(specs["talker_kv"], num_sources=SOURCES),
        BoundedKVManager(specs["flow_kv"], num_sources=SOURCES),
    )


ENGINE_FIELDS = frozenset(field.name for field in dataclasses.fields(EngineSettings))


def engine_kwargs(**kwargs) -> dict:
    """`Engine`'s keyword arguments from flat ones: `EngineSettings` fields (max_batch 2 unless given)
    go into its `settings`, the others stay as they are."""
    fields = {"max_batch": 2} | {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_FIELDS}
    return {"settings": EngineSettings(**fields), **kwargs}


def make_engine(programs, **kwargs) -> tuple[Engine, list[Voice]]:
    model, captured = programs
    talker, flow = managers()
    engine = Engine(model, talker=talker, flow=flow, programs=captured, **engine_kwargs(**kwargs))
    engine.warm_up()
    voices = [engine.add_voice(0, frames=4, seed=1), engine.add_voice(1, frames=6, seed=2)]
    return engine, voices


def stable_seed(text: str) -> int:
    """A seed from `text` that is the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def request(rid: str, voice: Voice, frames: int, text_len: int = 5, seed: int = 0) -> TTSRequest:
    text = np.random.default_rng(stable_seed(rid)).integers(0, CONFIG.text_vocab_size, text_len)
    return TTSRequest(rid, text, voice, frames, seed)


def assert_complete(stream) -> None:
    frames = stream.request.frames
    assert stream.phase is Phase.DONE, stream.error
    assert len(stream.codes) == frames
    assert [c.first_frame for c in stream.chunks] == list(range(0, frames, CONFIG.flow_chunk))
    assert stream.audio.shape == (frames * SAMPLES_PER_FRAME,)
    assert np.isfinite(stream.audio).all()
