"""A feeding node's rows (`DecodeRow`) and their bookkeeping over its streams' `StreamTable`: decode rows,
then what a step's dispatch and its read-back change, every row at once. Shared by the models whose
streams are `FedStream`s (the TTS talker, `GreedyDecoder`); each names its own count columns in a
`Counters`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mstar_jax.serving.model import InFlight
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, FedStream
from mstar_jax.serving.table import StreamTable, slots_of

__all__ = ["Counters", "DecodeRow", "count_dispatched", "count_read", "decode_rows", "dispatched_slots"]


class DecodeRow(NamedTuple):
    """One stream's part of a step: `tokens` written at its end; `feed` >= 0: the token is the step in
    flight's output there (its index in them, flattened; `tokens` is then a placeholder). A decode row
    of a block (`serving/steps.py`) takes `steps` one-token steps from its one input token.

    A NamedTuple: the engine builds one per stream per step, which a frozen dataclass makes four times
    as costly (its `__init__` sets each field through `object.__setattr__`)."""

    stream: FedStream
    tokens: tuple[int, ...]
    decode: bool
    feed: int = -1
    steps: int = 1

    @property
    def span(self) -> int:
        """Entries the row writes: a decode row's steps, a prefill row's tokens."""
        return self.steps if self.decode else len(self.tokens)


class Counters(NamedTuple):
    """The names of a feeding node's count columns in its streams' table.

    Attributes:
      written: entries committed to the node's caches.
      in_flight: tokens of steps dispatched and not read back.
      made: tokens read back since the stream started or last rewound.
      limit: tokens the stream ends at.
      last: the newest token read back (the next step's input when none is fed).
    """

    written: str
    in_flight: str
    made: str
    limit: str
    last: str


def decode_rows(
    table: StreamTable,
    slots: np.ndarray,
    counters: Counters,
    *,
    decode_steps: int,
    in_flight: int | None,
    offset: int = 0,
) -> list[DecodeRow]:
    """A decode row for each stream at `slots`: its input token fed from the step `in_flight` where its
    newest token is there, else its last token from the host, `offset` added; a block of at most
    `decode_steps` steps, and none past its limit."""
    c = table.columns
    left = c[counters.limit][slots] - c[counters.made][slots] - c[counters.in_flight][slots]
    steps = np.minimum(decode_steps, left)
    fed = c["feed_step"][slots] == (-2 if in_flight is None else in_flight)
    tokens = np.where(fed, offset, offset + c[counters.last][slots])
    feed = np.where(fed, c["feed_index"][slots], -1)
    streams, new = table.streams, tuple.__new__  # NamedTuple's own __new__, without its keyword handling
    return [
        new(DecodeRow, (streams[slot], (token,), True, row_feed, row_steps))
        for slot, token, row_feed, row_steps in zip(
            slots.tolist(), tokens.tolist(), feed.tolist(), steps.tolist(), strict=True
        )
    ]


def dispatched_slots(table: StreamTable, step: InFlight) -> np.ndarray:
    """The table slots of the streams of a step being dispatched, its rows' order.

    Raises:
      RuntimeError: a row's stream has left the table (the engine dispatches live streams only).
    """
    slots = slots_of(row.stream for row in step.rows)
    if (slots < 0).any():
        raise RuntimeError(f"a {step.node.name} step was dispatched with a stream that has ended")
    return slots


def count_dispatched(
    table: StreamTable, step: InFlight, counters: Counters, *, decode_steps: int, now: float
) -> np.ndarray:
    """Advance the rows (`DecodeRow`s) of a step just dispatched: entries written, prompt read (a prefill
    row's stream is in PREFILL), tokens coming (a decode row's block gives one a step, a prompt's last
    chunk the first: the stream is in DECODE, its feed at its newest), FLUSH once its limit is scheduled.

    Returns:
      i64[rows]: the tokens each row emits (`InFlight.emits`).

    Raises:
      RuntimeError: as `dispatched_slots`.
    """
    slots, c = dispatched_slots(table, step), table.columns
    c["last_step_at"][slots] = now
    n = len(slots)
    decode = np.fromiter([row.decode for row in step.rows], bool, n)
    span = np.fromiter([row.span for row in step.rows], np.int64, n)
    c[counters.written][slots] += span
    prefill = slots[~decode]
    c["prefilled"][prefill] += span[~decode]
    c["phase"][prefill] = PREFILL.code
    emits = np.where(decode, span, c["prefilled"][slots] == c["prompt_len"][slots])
    emitting = emits > 0
    coming, emit = slots[emitting], emits[emitting]
    c[counters.in_flight][coming] += emit
    c["feed_step"][coming] = step.serial
    c["feed_index"][coming] = np.asarray(step.indices, np.int64)[emitting] * decode_steps + emit - 1
    c["phase"][coming] = DECODE.code
    scheduled = c[counters.made][slots] + c[counters.in_flight][slots] >= c[counters.limit][slots]
    c["phase"][slots[scheduled]] = FLUSH.code  # its last token is coming: no step needs it as input
    return emits


def count_read(
    table: StreamTable, step: InFlight, counters: Counters, *, decode_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Account a step's outputs read back: a stream's tokens are no longer in flight, its feed is cleared
    if it was this step's, its faults reset.

    Returns:
      (indices into `step.rows`, table slots) of the rows whose tokens their stream takes: those
      emitting whose stream is still served.
    """
    slots, emits = slots_of(row.stream for row in step.rows), np.asarray(step.emits, np.int64)
    taken = np.flatnonzero((slots >= 0) & (emits > 0))
    slots, emits, c = slots[taken], emits[taken], table.columns
    newest = np.asarray(step.indices, np.int64)[taken] * decode_steps + emits - 1
    read = (c["feed_step"][slots] == step.serial) & (c["feed_index"][slots] == newest)
    c["feed_step"][slots[read]], c["feed_index"][slots[read]] = -1, -1
    c[counters.in_flight][slots] -= emits
    c["faults"][slots] = 0
    return taken, slots
