"""The engine: requests in, batches per graph walk through the resources and captured programs, audio out."""

from mstar_jax.engine.engine import FLOW_KV, TALKER_KV, Engine, StepRecord
from mstar_jax.engine.programs import SettingsMismatchError, TTSPrograms, tts_buckets
from mstar_jax.engine.request import AudioChunk, Phase, Stream, TTSRequest

__all__ = [
    "FLOW_KV",
    "TALKER_KV",
    "AudioChunk",
    "Engine",
    "Phase",
    "SettingsMismatchError",
    "StepRecord",
    "Stream",
    "TTSPrograms",
    "TTSRequest",
    "tts_buckets",
]
