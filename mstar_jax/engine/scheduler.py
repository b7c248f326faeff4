"""Batch formation: which rows run in the next talker step and the next flow step.

Pure policy over the streams' host state, read as their `StreamTable`'s columns (no device work, no
resources): the engine admits what this
returns, drops rows the resources refuse, and runs the rest.

- Talker: decode rows first (they hold the latency of audio already promised), then prefill chunks
  (new requests), first come first served, at most `max_batch` rows. Decode and prefill rows together
  make a combined step, as many prefill rows as its bucket has room for.
- Flow: every stream with a whole chunk of new frames, or with its last (short) chunk once the
  talker is done, first come first served.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mstar_jax.engine.request import Stream
from mstar_jax.serving.rows import Counters, DecodeRow, decode_rows
from mstar_jax.serving.stream import DECODE, FLUSH, Phase
from mstar_jax.serving.table import StreamTable

__all__ = ["TALKER_COUNTERS", "FlowRow", "TalkerRow", "flow_rows", "talker_rows"]

TALKER_COUNTERS = Counters(
    written="talker_written", in_flight="codes_in_flight", made="codes_read", limit="frames", last="last_code"
)
"""The talker's count columns in the streams' table (`serving/rows.py`)."""


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
    table: StreamTable,
    *,
    now: float,
    max_batch: int,
    prefill_tokens: int,
    prefill_room: int | None,
    bos: int,
    text_vocab: int,
    in_flight: int | None = None,
    decode_steps: int = 1,
) -> tuple[list[TalkerRow], list[TalkerRow]]:
    """The next talker step's decode rows and prefill rows, from the live streams' columns.

    Args:
      table: the live streams' state (`Stream`'s columns), read in arrival order.
      now: the engine clock (held streams wait until their `hold_until`).
      max_batch: most rows in one step.
      prefill_tokens: most prompt tokens per prefill row (the largest prefill bucket).
      prefill_room: most prefill rows beside decode rows (the combined bucket's room at `max_batch`);
        None: decode and prefill rows run as two programs, each of up to `max_batch` rows.
      bos: the token after the text.
      text_vocab: offset of codec tokens among the talker's input tokens.
      in_flight: the talker step dispatched but not read back (`Stream.feed`), if any.
      decode_steps: K, the one-token steps of a decode program: a decode row takes as many of them as
        its stream has frames left, at most K.

    Returns:
      (decode rows, prefill rows), first come first served; with a `prefill_room`, prefill rows are
      capped at it when decode rows run.
    """
    slots, c = table.order(), table.columns
    phase, codes, frames = c["phase"][slots], c["codes_read"][slots], c["frames"][slots]
    # What can run: not ended, paused or held, nor flushing (every code scheduled), a code still to come.
    held = c["paused"][slots] | (c["hold_until"][slots] > now)
    runnable = (phase < FLUSH.code) & ~held & (codes < frames)
    decoding = phase == DECODE.code
    decode = slots[runnable & decoding][:max_batch]
    prefill = slots[runnable & ~decoding][:max_batch]  # no step takes more (rows beyond wait for the next)
    if prefill_room is not None:
        room = max_batch - len(decode)
        prefill = prefill[: min(room, prefill_room) if len(decode) else room]
    prefill_rows = []
    for slot, done in zip(prefill.tolist(), c["prefilled"][prefill].tolist(), strict=True):
        stream = table.streams[slot]
        prefill_rows.append(
            TalkerRow(stream, (*stream.request.text, bos)[done : done + prefill_tokens], False)
        )
    return decode_rows(
        table, decode, TALKER_COUNTERS, decode_steps=decode_steps, in_flight=in_flight, offset=text_vocab
    ), prefill_rows


def flow_rows(table: StreamTable, *, now: float, max_batch: int, chunk: int) -> list[FlowRow]:
    """The next flow step's rows, from the live streams' columns: whole chunks, or the last frames of a
    finished talker."""
    slots, c = table.order(), table.columns
    codes, start = c["codes_read"][slots], c["flow_written"][slots]
    ready = codes - start
    runnable = (c["phase"][slots] < Phase.DONE.code) & ~c["paused"][slots] & (c["hold_until"][slots] <= now)
    whole = (ready >= chunk) | ((ready > 0) & (codes >= c["frames"][slots]))  # or the talker is done
    taken = np.flatnonzero(runnable & whole)[:max_batch]
    rows = []
    for slot, first, count in zip(*(a[taken].tolist() for a in (slots, start, ready)), strict=True):
        stream = table.streams[slot]
        rows.append(FlowRow(stream, first, tuple(stream.codes[first : first + min(chunk, count)])))
    return rows
