"""The streaming TTS model: a talker (text -> codec frames) and a chunked flow decoder (frames -> mel),
and its serving: `TTSServing` (the model's half of the engine's protocol), `Engine` (the engine built
for it), its requests, streams, voices and programs.

The serving names are imported on first use (PEP 562), so reading the model's config (a deployment's
check, the memory budget) loads neither the engine nor the model's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mstar_jax.models.streaming_tts.config import DTYPES, StreamingTTSConfig
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.models.streaming_tts.settings import StreamingTTSSettings

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from mstar_jax.models.streaming_tts.programs import SettingsMismatchError, TTSPrograms, tts_buckets
    from mstar_jax.models.streaming_tts.request import AudioChunk, Stream, TTSRequest
    from mstar_jax.models.streaming_tts.serving import Engine, TTSServing

__all__ = [
    "DTYPES",
    "FLOW_KV",
    "TALKER_KV",
    "AudioChunk",
    "Engine",
    "SettingsMismatchError",
    "Stream",
    "StreamingTTSConfig",
    "StreamingTTSSettings",
    "TTSPrograms",
    "TTSRequest",
    "TTSServing",
    "tts_buckets",
]


def __getattr__(name: str) -> Any:
    """Import the serving `name` from its module on first use, and keep it here for the next."""
    if name in ("SettingsMismatchError", "TTSPrograms", "tts_buckets"):
        from mstar_jax.models.streaming_tts import programs as module
    elif name in ("AudioChunk", "Stream", "TTSRequest"):
        from mstar_jax.models.streaming_tts import request as module
    elif name in ("Engine", "TTSServing"):
        from mstar_jax.models.streaming_tts import serving as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
