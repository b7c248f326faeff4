"""A step's real rows as columns: one NumPy array per field, read from the step and the manager's records
in one pass, so that admission checks, plans and commits every row at once.

`gather` reads them (None for a step that arrays cannot express: an unknown or offloaded request, a row
without a position, a field that is not an int); `admissible` is `check_segment` over every row at once,
True only where every row passes. Anything else goes row by row (`check_segment`), which says why: the
columns are a fast path, never a second set of rules.

`CommittedRows` is the persistent batch: the rows of the last step committed as columns, with what
their records hold after it. The next step of the same requests in the same order (a decode block after
a decode block, a flow chunk after a flow chunk), while no record changed since, reads their records'
state from it as arrays instead of record by record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVStep,
    PositionColumns,
    StreamPosition,
)
from mstar_jax.resources.step import Segment, StepContext

__all__ = [
    "MAX_POSITION", "CommittedRows", "StepColumns", "admissible", "commit", "first_steps", "gather",
    "pending", "unclaimed",
]  # fmt: skip

_INTS = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64})
"""The value types `is_int(value, numpy=True)` accepts that a step's fields hold in practice (`bool` is
not among them); any other type sends the step row by row."""
_ABSENT = object()
MAX_POSITION = 2**31 - 1
"""The most a step's end (source_len + written + step tokens) may be: a plan's positions are int32."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CommittedRows:
    """The rows of the last step committed as columns, and what their records hold after it.

    Valid only while no record changed since (the manager drops it wherever one may have).

    Attributes:
      request_ids, records: each row's request and its record, in the step's order.
      written: entries each has committed.
      source_len, source: the source each one's stream started on.
      fields: `row_fields` of the rows without their positions (`slot`, local to its data shard,
        `sink`, `window`, `window_includes_step`), which stay as long as the request holds its slot.
    """

    request_ids: tuple[str, ...]
    records: tuple[Any, ...]
    written: np.ndarray
    source_len: np.ndarray
    source: np.ndarray
    fields: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StepColumns:
    """A step's real rows, in segment order.

    Attributes:
      step: the step they were read from (a plan or commit of another step object reads it again).
      segments, records: each row's segment and its request's record.
      source_len, written, source: each row's declared position.
      span, step_tokens: what each row writes and the tokens it brings.
      rows: each row's index among the step's segments, padding included.
      committed: the persistent batch these rows are (`CommittedRows`), or None: their records are
        read one by one.
    """

    step: BoundedKVStep
    segments: tuple[Segment, ...]
    records: tuple[Any, ...]
    source_len: np.ndarray
    written: np.ndarray
    source: np.ndarray
    span: np.ndarray
    step_tokens: np.ndarray
    rows: np.ndarray
    committed: CommittedRows | None = None

    @property
    def request_ids(self) -> list[str]:
        return [seg.request_id for seg in self.segments]

    def admitted(self, request_id: str) -> tuple[StreamPosition, int]:
        """The (position, span) admit accepted for `request_id`'s row (`RequestRecord.admitted`)."""
        i = self.request_ids.index(request_id)
        position = StreamPosition(int(self.source_len[i]), int(self.written[i]), int(self.source[i]))
        return position, int(self.span[i])


def pending(request_id: str, record: Any) -> tuple[StreamPosition, int] | None:
    """The (position, span) admit accepted for the request of `record`, not yet committed or aborted
    (None: no step is pending)."""
    admitted = record.admitted
    return admitted.admitted(request_id) if isinstance(admitted, StepColumns) else admitted


def gather(
    step: BoundedKVStep,
    ctx: StepContext,
    requests: Mapping[str, Any],
    committed: CommittedRows | None = None,
) -> StepColumns | None:
    """The real rows of `step` (those not `ctx.padding_rows()`) as columns; None where a row is not a
    plain case (its request unknown or offloaded, no position, a field not an int, a request twice).

    Positions given as `PositionColumns` of exactly the real rows, in order, are read as they are: no
    Python object per row; and when they are the rows of `committed` (the persistent batch, valid), their
    records are its records."""
    padding = ctx.padding_rows()
    segments = step.segments or ()
    if padding:
        kept = [i for i, seg in enumerate(segments) if seg.request_id not in padding]
        segments = tuple(segments[i] for i in kept)
        rows = np.array(kept, np.int64)
    else:
        rows = np.arange(len(segments))
    rids = tuple([seg.request_id for seg in segments])
    positions = step.positions
    fast = type(positions) is PositionColumns and not step.step_tokens and positions.request_ids == rids
    if fast and committed is not None and committed.request_ids == rids:
        records = committed.records  # every one holds its slot: nothing changed since it committed
    else:
        committed, records = None, tuple([requests.get(rid) for rid in rids])
        if None in records or any(record.host_copy is not None for record in records):
            return None
    spans = [seg.span for seg in segments]
    if fast:
        if not {*map(type, spans)} <= _INTS:
            return None
        try:
            spans = np.array(spans, np.int64)
        except OverflowError:  # beyond int64: refused row by row, with its value
            return None
        return StepColumns(
            step, segments, records, positions.source_len, positions.written, positions.source,
            spans, np.maximum(spans, 1), rows, committed,
        )  # fmt: skip
    positions = [positions.get(rid) for rid in rids]
    if None in positions or len(set(rids)) < len(rids):
        return None
    tokens = step.step_tokens
    declared = [tokens.get(rid, _ABSENT) for rid in rids] if tokens else []
    given = [t for t in declared if t is not _ABSENT]
    values = [value for position in positions for value in position]
    if not {*map(type, values), *map(type, spans), *map(type, given)} <= _INTS:
        return None
    if declared:
        step_tokens = [max(s, 1) if t is _ABSENT else t for s, t in zip(spans, declared, strict=True)]
    else:
        step_tokens = [max(s, 1) for s in spans]
    try:
        table = np.array(values, np.int64).reshape(len(rids), 3)
        spans, step_tokens = np.array(spans, np.int64), np.array(step_tokens, np.int64)
    except OverflowError:  # beyond int64: refused row by row, with its value
        return None
    return StepColumns(
        step, segments, records, table[:, 0], table[:, 1], table[:, 2], spans, step_tokens, rows
    )


def admissible(
    columns: StepColumns,
    ctx: StepContext,
    *,
    config: BoundedKVConfig,
    num_sources: int,
    source_lengths: Mapping[int, int],
) -> bool:
    """True when every row passes `check_segment` (False: at least one may not; ask it which, and why)."""
    records = columns.records
    source_len, written, source = columns.source_len, columns.written, columns.source
    span, step_tokens = columns.span, columns.step_tokens
    lengths = np.array([source_lengths.get(i, -1) for i in range(max(num_sources, 1))], np.int64)
    inside = (source >= 0) & (source < num_sources)
    registered = np.where(inside, lengths[np.where(inside, source, 0)], -1)
    if columns.committed is not None:  # the persistent batch: every row has started
        carried = columns.committed
        committed, started, started_on = carried.written, carried.source_len, carried.source
    else:
        committed = np.array([r.written for r in records], np.int64)
        started = np.array([-1 if r.source_len is None else r.source_len for r in records], np.int64)
        started_on = np.array([-1 if r.source is None else r.source for r in records], np.int64)
    lease = ctx.slot_lease
    width = lease.bucket.num_tokens if lease is not None and lease.bucket is not None else None
    ok = (
        (source_len >= 0) & (written >= 0) & inside
        & (source_len >= config.min_source_len) & (source_len <= config.max_source_len)
        & ((source_len == 0) | ((registered >= 0) & (source_len <= registered)))
        & ((started < 0) | ((started == source_len) & (started_on == source)))
        & (written == committed) & (step_tokens >= 1) & (span >= 0) & (span <= step_tokens)
        & ((columns.step.steps == 1) | (span <= columns.step.steps))
    )  # fmt: skip
    if width is not None:
        ok &= step_tokens <= width
    # Each term first, so that their sum cannot wrap int64; the plan's positions are int32.
    fits = (source_len <= MAX_POSITION) & (written <= MAX_POSITION) & (step_tokens <= MAX_POSITION)
    ok &= fits & (source_len + written + step_tokens <= MAX_POSITION)
    return bool(ok.all())


def unclaimed(columns: StepColumns) -> tuple[list[str], tuple[list[int], list[int]] | None]:
    """The requests of admitted `columns` that hold no slot yet, and their `(source_len, source)` as
    lists (`claim_slots`' `sources`; None when there are none)."""
    if columns.committed is not None:  # the persistent batch: every row holds its slot
        return [], None
    need = [i for i, record in enumerate(columns.records) if record.slot is None]
    if not need:
        return [], None
    rids = [columns.segments[i].request_id for i in need]
    return rids, (columns.source_len[need].tolist(), columns.source[need].tolist())


def first_steps(columns: StepColumns, slots: Any) -> list[int]:
    """The data shard of each row taking its request's first step (`SlotPools.shard_of` its slot)."""
    return [slots.shard_of(columns.records[i].slot) for i in np.flatnonzero(columns.written == 0).tolist()]


def commit(columns: StepColumns, fields: dict[str, np.ndarray]) -> CommittedRows:
    """Record that the step admitted as `columns` ran (each record's `written` advances by its span, its
    admission is cleared) and return its rows as the persistent batch, with their plan `fields`."""
    written = columns.written + columns.span
    for record, entries in zip(columns.records, written.tolist(), strict=True):
        record.written = entries
        record.admitted = None
    # Every row's stream started on the source it declares (admit checked, or claimed it so).
    rids = tuple([seg.request_id for seg in columns.segments])
    return CommittedRows(rids, columns.records, written, columns.source_len, columns.source, fields)
