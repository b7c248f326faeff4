"""The engine: requests in, batches per graph node through the resources and captured programs, outputs
out. `ServingEngine` serves any `mstar_jax.serving.ServedModel`; `Engine` is it built for the streaming
TTS model (`TTSServing`)."""

from mstar_jax.engine.engine import ServingEngine, StepRecord
from mstar_jax.engine.programs import SettingsMismatchError, TTSPrograms, tts_buckets
from mstar_jax.engine.request import AudioChunk, Phase, Stream, TTSRequest
from mstar_jax.engine.tts import Engine, TTSServing
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV

__all__ = [
    "FLOW_KV",
    "TALKER_KV",
    "AudioChunk",
    "Engine",
    "Phase",
    "ServingEngine",
    "SettingsMismatchError",
    "StepRecord",
    "Stream",
    "TTSPrograms",
    "TTSRequest",
    "TTSServing",
    "tts_buckets",
]
