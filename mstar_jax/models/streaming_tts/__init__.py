"""The streaming TTS model: a talker (text -> codec frames) and a chunked flow decoder (frames -> mel)."""

from mstar_jax.models.streaming_tts.config import DTYPES, StreamingTTSConfig
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.models.streaming_tts.settings import StreamingTTSSettings

__all__ = ["DTYPES", "FLOW_KV", "TALKER_KV", "StreamingTTSConfig", "StreamingTTSSettings"]
