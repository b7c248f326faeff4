"""Text to token ids for the speech model: UTF-8 bytes (a text model's tokenizer is its own, e.g.
`mstar_jax.models.gemma3.chat`).

Speech (`ByteTokenizer`): the streaming TTS model's text vocabulary is 256, so text becomes its UTF-8
bytes, one token each: `"hé"` is `[104, 195, 169]`. A request speaks `frames_for(n)` codec frames for
`n` bytes: `ceil(n * frames_per_byte / speed)`, at least 1 and at most `max_frames` (12.5 frames are a
second of audio at 24 kHz, 1,920 samples a frame).
"""

from __future__ import annotations

import math

from mstar_jax.checks import INT32_MAX, check_int, check_number

__all__ = ["ByteTokenizer"]

BYTES = 256


class ByteTokenizer:
    """UTF-8 bytes as the TTS model's text tokens, and the frames a text is spoken in (module doc).

    Args:
      text_vocab_size: the model's text vocabulary (at least 256).
      frames_per_byte: frames spoken per byte (> 0).
      max_frames: the most frames one request speaks.
    """

    def __init__(self, text_vocab_size: int, *, frames_per_byte: float, max_frames: int):
        check_int("text_vocab_size", text_vocab_size, minimum=BYTES)
        self.frames_per_byte = check_number("frames_per_byte", frames_per_byte, minimum=0.0, exclusive=True)
        self.max_frames = check_int("max_frames", max_frames, minimum=1, maximum=INT32_MAX)

    def encode(self, text: str) -> tuple[int, ...]:
        """The token ids of `text`: its UTF-8 bytes."""
        return tuple(text.encode("utf-8"))

    def frames_for(self, tokens: int, speed: float = 1.0) -> int:
        """Frames a text of `tokens` bytes is spoken in, at `speed` (1.0: normal)."""
        frames = tokens * self.frames_per_byte / speed  # may overflow to inf: capped before `ceil`
        return max(1, math.ceil(frames) if frames < self.max_frames else self.max_frames)
