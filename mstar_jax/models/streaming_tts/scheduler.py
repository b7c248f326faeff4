"""Batch formation: which rows run in the next talker step and the next flow step.

Pure policy over the streams' host state (no device work, no resources): the engine admits what this
returns, drops rows the resources refuse, and runs the rest.

- Talker: decode rows first (they hold the latency of audio already promised), then prefill chunks
  (new requests), first come first served, at most `max_batch` rows. Decode and prefill rows together
  make a combined step, as many prefill rows as its bucket has room for.
- Flow: every stream with a whole chunk of new frames, or with its last (short) chunk once the
  talker is done, first come first served.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from mstar_jax.models.streaming_tts.request import Stream
from mstar_jax.serving.decoder import DecodeRow
from mstar_jax.serving.stream import DECODE, FLUSH

__all__ = ["FlowRow", "TalkerRow", "flow_rows", "talker_rows"]


TalkerRow = DecodeRow
"""One request's part of a talker step (`DecodeRow`): `tokens` (prompt tokens or the last frame's token)
written at the stream's current end; `decode` says which kernel runs it. `feed` >= 0: the last frame's
code is still on the device, in that row of the step in flight, and the program reads its token there
(`tokens` is then a placeholder)."""


class FlowRow(NamedTuple):
    """One request's part of a flow step: codec frames `[start, start + len(codes))` (a NamedTuple, as
    `DecodeRow` is)."""

    stream: Stream
    start: int
    codes: tuple[int, ...]

    @property
    def span(self) -> int:
        return len(self.codes)


def talker_rows(
    streams: Iterable[Stream],
    *,
    now: float,
    max_batch: int,
    prefill_tokens: int,
    prefill_room: int,
    bos: int,
    text_vocab: int,
    in_flight: int | None = None,
    decode_steps: int = 1,
) -> tuple[list[TalkerRow], list[TalkerRow]]:
    """The next talker step's decode rows and prefill rows.

    Args:
      streams: live streams, in arrival order.
      now: the engine clock (held streams wait until their `hold_until`).
      max_batch: most rows in one step.
      prefill_tokens: most prompt tokens per prefill row (the largest prefill bucket).
      prefill_room: most prefill rows beside decode rows (the combined bucket's room at `max_batch`).
      bos: the token after the text.
      text_vocab: offset of codec tokens among the talker's input tokens.
      in_flight: the talker step dispatched but not read back (`Stream.feed`), if any.
      decode_steps: K, the one-token steps of a decode program: a decode row takes as many of them as
        its stream has frames left, at most K.

    Returns:
      (decode rows, prefill rows); prefill rows are capped at `prefill_room` only when decode rows run.
    """
    decode, prefill = [], []
    for stream in streams:
        phase = stream.phase
        # Skip what cannot run (ended, paused, held) or has every code: inline, as this loop visits every
        # live stream every round.
        if (
            phase is FLUSH
            or (phase is not DECODE and phase.finished)
            or stream.paused
            or stream.hold_until > now
        ):
            continue
        codes, frames = stream.codes, stream.request.frames
        if len(codes) >= frames:
            continue
        if phase is not DECODE:
            if len(prefill) < max_batch:  # no step takes more (rows beyond wait for the next)
                prompt = (*stream.request.text, bos)
                chunk = prompt[stream.prefilled : stream.prefilled + prefill_tokens]
                prefill.append(TalkerRow(stream, chunk, False))
            continue
        if len(decode) == max_batch:
            continue
        steps = min(decode_steps, frames - len(codes) - stream.codes_in_flight)  # frames not scheduled
        feed = stream.feed
        if feed is not None and feed[0] == in_flight:
            decode.append(TalkerRow(stream, (text_vocab,), True, feed[1], steps))
        else:
            decode.append(TalkerRow(stream, (text_vocab + codes[-1],), True, -1, steps))
    room = max_batch - len(decode)
    if decode:
        room = min(room, prefill_room)
    return decode, prefill[:room]


def flow_rows(streams: Iterable[Stream], *, now: float, max_batch: int, chunk: int) -> list[FlowRow]:
    """The next flow step's rows: whole chunks, or the last frames of a finished talker."""
    rows = []
    for stream in streams:
        if stream.phase.finished or stream.paused or stream.hold_until > now:  # ended, paused or held
            continue
        codes, start = stream.codes, stream.flow_written
        ready = len(codes) - start
        if ready >= chunk or (ready > 0 and len(codes) >= stream.request.frames):  # the talker is done
            rows.append(FlowRow(stream, start, tuple(codes[start : start + min(chunk, ready)])))
        if len(rows) == max_batch:
            break
    return rows
