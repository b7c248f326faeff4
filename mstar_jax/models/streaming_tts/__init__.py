"""The streaming TTS model: a talker (text -> codec frames) and a chunked flow decoder (frames -> mel)."""

from mstar_jax.models.streaming_tts.config import DTYPES, StreamingTTSConfig

__all__ = ["DTYPES", "StreamingTTSConfig"]
