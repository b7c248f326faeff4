"""Audio as the speech endpoints send it: 16-bit little-endian PCM, mono, at the model's 24 kHz.

`pcm` is the samples alone; `wav` is a streaming WAV header first (its sizes set to 0xFFFFFFFF, as
streaming servers write them, since the length is not known when the first chunk leaves), then the
same PCM. An `AudioChunk`'s float samples are clipped to [-1, 1] and scaled by 32767.
"""

from __future__ import annotations

import struct

import numpy as np

from mstar_jax.models.streaming_tts.model import SAMPLE_RATE

__all__ = ["SAMPLE_RATE", "pcm16", "wav_header"]

_UNKNOWN = 0xFFFFFFFF


def pcm16(samples: np.ndarray) -> bytes:
    """f32[N] samples as N little-endian int16 (2N bytes)."""
    clipped = np.clip(np.asarray(samples, np.float32), -1.0, 1.0)
    return (np.round(clipped * 32767.0)).astype("<i2").tobytes()


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV stream of unknown length."""
    return b"".join(
        [
            b"RIFF", struct.pack("<I", _UNKNOWN), b"WAVE", b"fmt ",
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16),
            b"data", struct.pack("<I", _UNKNOWN),
        ]
    )  # fmt: skip
