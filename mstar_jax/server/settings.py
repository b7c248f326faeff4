"""How the server admits, buffers and stops: `ServerSettings`, frozen and validated at construction
(`mstar-jax serve` builds it from its flags, naming the flag of any refusal)."""

from __future__ import annotations

import dataclasses

from mstar_jax.checks import INT32_MAX, check_int, check_number

__all__ = ["ServerSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    """The front door's limits.

    Attributes:
      max_waiting: requests that may wait at once (submitted with no step run yet, or paused for a
        client that stopped reading; at least 1); one more is refused with 429 and `Retry-After`, so
        neither a burst nor readers that never read grow memory without bound.
      retry_after_s: the `Retry-After` a 429 says, in seconds.
      max_body_bytes: the largest request body read; a larger one is refused with 413.
      stream_buffer: outputs (audio chunks, tokens) buffered for one stream before the engine pauses it
        until its client has read half of them (a slow reader); steps already dispatched may add one
        or two more.
      offload_paused_after_s: seconds a stream paused for its reader keeps its device slots before the
        host offloads them to host memory (None: never), so a client that stops reading holds no
        device memory for long.
      shutdown_grace_s: after `SIGTERM`, seconds in-flight streams have to finish before they are
        cancelled, each with a typed, retryable error.
      max_input_bytes: the longest speech input, in UTF-8 bytes (each is one text token).
      frames_per_byte: codec frames spoken per input byte (12.5 frames are a second of audio).
      max_frames: the most frames one request speaks (its frames are capped here; at most 2**31 - 1,
        as a program counts them in int32).
      max_tokens: the largest `max_tokens` a text request may ask for (at most 2**31 - 1).
      default_max_tokens: `max_tokens` when a text request gives none.
      history: finished streams and step records the engine keeps for reports (the most recent), so
        memory stays flat however long the server runs.
      segment_bytes: a WebSocket's text is spoken in segments that end at a sentence's end, or once
        this many bytes are buffered (at least 4, a UTF-8 character's most, so a segment always holds
        one).
    """

    max_waiting: int = 64
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20
    stream_buffer: int = 16
    offload_paused_after_s: float | None = 1.0
    shutdown_grace_s: float = 10.0
    max_input_bytes: int = 4096
    frames_per_byte: float = 1.0
    max_frames: int = 1500
    max_tokens: int = 1024
    default_max_tokens: int = 16
    segment_bytes: int = 200
    history: int = 64

    def __post_init__(self):
        for name in (
            "max_waiting", "retry_after_s", "max_body_bytes", "stream_buffer", "max_input_bytes", "history",
        ):  # fmt: skip
            check_int(name, getattr(self, name), minimum=1)
        for name in ("max_frames", "max_tokens", "default_max_tokens"):  # a request's count: int32 on device
            check_int(name, getattr(self, name), minimum=1, maximum=INT32_MAX)
        check_int("segment_bytes", self.segment_bytes, minimum=4)  # the widest UTF-8 character's bytes
        check_number("shutdown_grace_s", self.shutdown_grace_s, minimum=0.0)
        check_number("offload_paused_after_s", self.offload_paused_after_s, minimum=0.0, allow_none=True)
        check_number("frames_per_byte", self.frames_per_byte, minimum=0.0, exclusive=True)
        if self.segment_bytes > self.max_input_bytes:
            raise ValueError(
                f"segment_bytes={self.segment_bytes} must be <= max_input_bytes={self.max_input_bytes} "
                "(a WebSocket's segment is one speech input)"
            )
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} must be <= max_tokens={self.max_tokens}"
            )
