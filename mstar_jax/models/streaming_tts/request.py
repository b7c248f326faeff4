"""A speech request and its stream: what a client submits, and what it reads back as audio arrives.

A request goes through the talker (its text, then one codec frame per step) and the flow decoder
(chunks of frames to mel and samples). `Stream` is the client's handle: a state, the audio chunks in
order, per-request timings, and an optional callback per chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mstar_jax.checks import INT32_MAX, brief, check_int
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.serving.chunks import ChunkProgress
from mstar_jax.serving.decoder import DecoderProgress
from mstar_jax.serving.nodes import NodeStream
from mstar_jax.serving.stream import (
    Phase,
    ReplayMismatchError,
    RequestCancelledError,
    RequestError,
    StateLostError,
    StepFailedError,
)

__all__ = [
    "FLOW",
    "TALKER",
    "AudioChunk",
    "Phase",
    "ReplayMismatchError",
    "RequestCancelledError",
    "RequestError",
    "StateLostError",
    "StepFailedError",
    "Stream",
    "TTSRequest",
]


@dataclasses.dataclass(frozen=True)
class TTSRequest:
    """What a client asks for: speak `text` in `voice` for `frames` codec frames.

    Attributes:
      request_id: unique among live requests.
      text: i32[tokens] text token ids (at least one).
      voice: the registered voice to speak with (its index in the source banks and its length).
      frames: codec frames to generate (12.5 per second of audio).
      seed: sampling seed; the same request with the same seed gives the same audio.
    """

    request_id: str
    text: tuple[int, ...]
    voice: Voice
    frames: int
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} must be a non-empty str")
        text = np.asarray(self.text)
        if text.ndim > 1:
            raise ValueError(
                f"request {self.request_id!r}: text={brief(self.text)} must be one sequence of token ids, "
                f"got shape {text.shape}"
            )
        text = text.reshape(-1)
        if not text.size:
            raise ValueError(f"request {self.request_id!r}: text is empty; it needs at least one token")
        if not np.issubdtype(text.dtype, np.integer):  # a float token would be truncated silently
            raise ValueError(
                f"request {self.request_id!r}: text={brief(self.text)} must be integer token ids, "
                f"got dtype {text.dtype}"
            )
        object.__setattr__(self, "text", tuple(int(t) for t in text))
        check_int(f"request {self.request_id!r}: frames", self.frames, minimum=1, maximum=INT32_MAX)
        if not isinstance(self.voice, Voice):
            raise TypeError(
                f"request {self.request_id!r}: voice={self.voice!r} must be a Voice (VoiceBank.add)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"request {self.request_id!r}: seed={self.seed!r} must be an int in [0, 2**32)")


class AudioChunk(NamedTuple):
    """One flow chunk's output for one request (a NamedTuple: one is made per request per flow step).

    Attributes:
      first_frame: index of its first codec frame in the request's output.
      codes: i32[T] the codec frames it decodes.
      mel: f32[T, M] their mel frames.
      samples: f32[T * samples_per_frame] audio.
    """

    first_frame: int
    codes: np.ndarray
    mel: np.ndarray
    samples: np.ndarray


TALKER, FLOW = "talker", "flow"
"""The model's two nodes: each keeps its progress in a stream under its name."""


@dataclasses.dataclass(eq=False)
class Stream(NodeStream):
    """A speech request's progress and output; `request` is its `TTSRequest` (`mstar_jax.serving.Stream`
    has the fields every request has: phase, failure, timings, pause, holds, faults).

    Its progress is kept per node (`progress`): the talker's is a `DecoderProgress` (its tokens are the
    codec frames), the flow decoder's a `ChunkProgress`; the properties below read them.

    Attributes:
      prompt: what the talker reads before its first frame: the text, then BOS.
      outputs: the audio chunks decoded so far, in order (also `chunks`).
      on_output: called with each new chunk (from the engine's thread).
    """

    prompt: tuple[int, ...] = ()
    on_output: Callable[[AudioChunk], None] | None = None

    def __post_init__(self):
        super().__post_init__()
        self.progress.setdefault(TALKER, DecoderProgress())
        self.progress.setdefault(FLOW, ChunkProgress())

    @property
    def codes(self) -> list[int]:
        """The codec frames generated so far (a fault's replay never takes one back)."""
        return self.progress[TALKER].tokens

    @property
    def chunks(self) -> list[AudioChunk]:
        """The audio chunks decoded so far, in order."""
        return self.outputs

    @property
    def first_audio_at(self) -> float | None:
        """Clock stamp of its first chunk (None until then)."""
        return self.first_output_at

    @property
    def prefilled(self) -> int:
        """Prompt tokens (text, then BOS) the talker has read."""
        return self.progress[TALKER].prefilled

    @property
    def talker_written(self) -> int:
        """Entries committed to the talker's cache."""
        return self.progress[TALKER].written

    @property
    def flow_written(self) -> int:
        """Entries committed to the flow decoder's cache."""
        return self.progress[FLOW].written

    @property
    def prompt_len(self) -> int:
        """Tokens the talker reads before its first frame: the text and BOS."""
        return len(self.request.text) + 1

    @property
    def talker_done(self) -> bool:
        """Every frame's code is generated and read back."""
        return self.progress[TALKER].finished

    @property
    def frames_decoded(self) -> int:
        """Frames whose audio reached `chunks` (a pipelined engine's flow may be further on)."""
        return self.progress[FLOW].delivered

    @property
    def audio(self) -> np.ndarray:
        """All samples decoded so far."""
        if not self.outputs:
            return np.zeros(0, np.float32)
        return np.concatenate([chunk.samples for chunk in self.outputs])
