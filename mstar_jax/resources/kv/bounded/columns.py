"""A step's real rows as columns: one NumPy array per field, read from the step and the manager's records
in one pass, so that admission checks, plans and commits every row at once.

`gather` reads them (None for a step that arrays cannot express: an unknown or offloaded request, a row
without a position, a field that is not an int); `admissible` is `check_segment` over every row at once,
True only where every row passes. Anything else goes row by row (`check_segment`), which says why: the
columns are a fast path, never a second set of rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVStep, PositionColumns
from mstar_jax.resources.step import Segment, StepContext

__all__ = ["StepColumns", "admissible", "gather"]

_INTS = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64})
"""The value types `is_int(value, numpy=True)` accepts that a step's fields hold in practice (`bool` is
not among them); any other type sends the step row by row."""
_ABSENT = object()


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StepColumns:
    """A step's real rows, in segment order.

    Attributes:
      step: the step they were read from (a plan or commit of another step object reads it again).
      segments, records: each row's segment and its request's record.
      source_len, written, source: each row's declared position.
      span, step_tokens: what each row writes and the tokens it brings.
    """

    step: BoundedKVStep
    segments: tuple[Segment, ...]
    records: tuple[Any, ...]
    source_len: np.ndarray
    written: np.ndarray
    source: np.ndarray
    span: np.ndarray
    step_tokens: np.ndarray

    @property
    def request_ids(self) -> list[str]:
        return [seg.request_id for seg in self.segments]


def gather(step: BoundedKVStep, ctx: StepContext, requests: Mapping[str, Any]) -> StepColumns | None:
    """The real rows of `step` (those not `ctx.padding_rows()`) as columns; None where a row is not a
    plain case (its request unknown or offloaded, no position, a field not an int, a request twice).

    Positions given as `PositionColumns` of exactly the real rows, in order, are read as they are: no
    Python object per row."""
    padding = ctx.padding_rows()
    segments = step.segments or ()
    if padding:
        segments = tuple(seg for seg in segments if seg.request_id not in padding)
    rids = [seg.request_id for seg in segments]
    records = [requests.get(rid) for rid in rids]
    if None in records or any(record.host_copy is not None for record in records):
        return None
    spans = [seg.span for seg in segments]
    positions = step.positions
    if type(positions) is PositionColumns and not step.step_tokens and positions.request_ids == tuple(rids):
        if not {*map(type, spans)} <= _INTS:
            return None
        try:
            spans = np.array(spans, np.int64)
        except OverflowError:  # beyond int64: refused row by row, with its value
            return None
        return StepColumns(
            step, segments, tuple(records), positions.source_len, positions.written, positions.source,
            spans, np.maximum(spans, 1),
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
        step, segments, tuple(records), table[:, 0], table[:, 1], table[:, 2], spans, step_tokens
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
    lengths = np.full(max(num_sources, 1), -1, np.int64)
    for index, length in source_lengths.items():
        if 0 <= index < num_sources:
            lengths[index] = length
    inside = (source >= 0) & (source < num_sources)
    registered = np.where(inside, lengths[np.where(inside, source, 0)], -1)
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
    )  # fmt: skip
    if width is not None:
        ok &= step_tokens <= width
    return bool(ok.all())
