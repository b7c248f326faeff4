"""A bounded cache's plan of a step, from the manager's records: where each row sits in the table, and
the table itself (`BoundedKVManager.plan_rows` and `plan` are these, given the manager's state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.admission import refuse, step_tokens_of
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.columns import StepColumns
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVStep
from mstar_jax.resources.kv.bounded.slots import SlotPools
from mstar_jax.resources.step import AdmitOutcome, AdmitRuntimeError, BucketKey, Segment, StepContext

__all__ = [
    "block_tables", "plan", "plan_columns", "row_fields", "shard_overflow", "slot_fields", "table_rows",
    "table_rows_of",
]  # fmt: skip


def table_rows(
    segments: Sequence[Segment],
    real: Sequence[str],
    bucket_rows: int | None,
    *,
    slots: SlotPools,
    requests: Mapping[str, Any],
    groups: Sequence[tuple[int, int]] | None = None,
    shards: Mapping[str, int] | None = None,
) -> tuple[int, dict[str, int]]:
    """The plan table's row count and each real request's row.

    On one data shard, row `i` is segment `i`, padded to the bucket's rows. Over several, the table is
    shard-major: shard `d` owns rows `[d * b, (d + 1) * b)`, `b` the bucket's rows per shard (or the
    most any shard has), its requests in segment order, then its padding rows. With row `groups` (a
    combined bucket's decode rows, then its prefill rows) each shard's rows are its requests of each
    group in turn, each group padded to its own rows: shard `d` of `b = sum(sizes)` rows holds group `g`
    at `[d * b + offset_g, d * b + offset_g + size_g)`.

    Args:
      segments: the step's rows, padding included.
      real: the real rows' request ids, in segment order.
      bucket_rows: the bucket's rows (per data shard), or None for an unbucketed step.
      slots, requests: the manager's slot pools and request records.
      groups: the step's row groups (`StepContext.row_groups`: consecutive segments, each group's
        count and its rows per shard); None: one group of `bucket_rows`.
      shards: each real request's data shard, where admission would place it (default: its slot's).

    Raises:
      ValueError: a data shard has more of a group's requests than the group's rows per shard.
    """
    padded = groups is None or len(segments) == sum(size or 0 for _, size in groups)
    if slots.shards == 1 and padded:  # `pad_step` put every row where it runs
        index = {seg.request_id: i for i, seg in enumerate(segments)}
        return max(len(segments), bucket_rows or 0), {rid: index[rid] for rid in real}
    real_ids = set(real)
    if groups is None:
        groups = ((len(segments), bucket_rows),)
    offset, start = 0, 0
    placed = []  # per group: its first row in a shard, and its requests on each shard
    for count, size in groups:
        by_shard: list[list[str]] = [[] for _ in range(slots.shards)]
        for seg in segments[start : start + count]:
            if seg.request_id in real_ids:
                rid = seg.request_id
                by_shard[slots.shard_of(requests[rid].slot) if shards is None else shards[rid]].append(rid)
        start += count
        width = size or max(1, *map(len, by_shard))
        for shard, rids in enumerate(by_shard):
            if len(rids) > width:
                raise ValueError(
                    f"data shard {shard} has {len(rids)} of the step's requests {rids}; the bucket holds "
                    f"{width} rows per shard"
                )
        placed.append((offset, by_shard))
        offset += width
    return slots.shards * offset, {
        rid: shard * offset + begin + j
        for begin, by_shard in placed
        for shard, rids in enumerate(by_shard)
        for j, rid in enumerate(rids)
    }


def shard_overflow(
    step: BoundedKVStep,
    ctx: StepContext,
    need_slot: Sequence[str],
    *,
    slots: SlotPools,
    requests: Mapping[str, Any],
    padding: Any,
) -> AdmitOutcome | None:
    """The refusal of a bucketed step over several data shards that would put more of its rows on a
    shard than the bucket holds per shard (`table_rows`), its first-time requests `need_slot` placed
    where `claim_slots` would place them; None when every shard's rows fit (or the slots are too few:
    `claim_slots` refuses that). `padding(request_id, ctx)` says which rows are padding."""
    bucket = None if ctx.slot_lease is None else ctx.slot_lease.bucket
    if slots.shards == 1 or bucket is None or len(need_slot) > len(slots):
        return None
    real = [seg.request_id for seg in step.segments or () if not padding(seg.request_id, ctx)]
    shards = dict(zip(need_slot, slots.preview(len(need_slot)), strict=True))
    for rid in real:
        if rid not in shards:  # it holds its slot
            shards[rid] = slots.shard_of(requests[rid].slot)
    try:
        table_rows(
            step.segments or (), real, bucket.bs, slots=slots, requests=requests, groups=ctx.row_groups,
            shards=shards,
        )  # fmt: skip
    except ValueError as error:
        return refuse(AdmitRuntimeError(f"bounded KV step: {error}"))
    return None


def table_rows_of(
    segments: Sequence[Segment],
    columns: StepColumns,
    bucket_rows: int | None,
    *,
    slots: SlotPools,
    requests: Mapping[str, Any],
    groups: Sequence[tuple[int, int]] | None = None,
) -> tuple[int, np.ndarray]:
    """`table_rows` of a step admitted as `columns`: the row count and each real row's row, in order."""
    if slots.shards == 1 and (groups is None or len(segments) == sum(size or 0 for _, size in groups)):
        return max(len(segments), bucket_rows or 0), columns.rows  # each row where `pad_step` put it
    rids = columns.request_ids
    rows, row_of = table_rows(segments, rids, bucket_rows, slots=slots, requests=requests, groups=groups)
    return rows, np.fromiter((row_of[rid] for rid in rids), np.int64, len(rids))


def plan(
    step: BoundedKVStep,
    real: Sequence[Segment],
    rows: int,
    row_of: Mapping[str, int],
    bucket: BucketKey | None,
    *,
    requests: Mapping[str, Any],
    slots: SlotPools,
    padding_slot: int,
    config: BoundedKVConfig,
    fields: Mapping[str, np.ndarray] | None = None,
    columns: StepColumns | None = None,
) -> BoundedKVPlan:
    """The plan table of `step`'s real rows `real`, at their rows `row_of` of a `rows`-row table (padding
    rows plan empty, on each shard's padding slot); slots are local to each request's data shard.

    The plan's `num_tokens` is the bucket's token count for a bucketed step (its arrays are the bucket's
    width), else the most step tokens a row declares (None with no real rows). A block of one-token
    steps (`step.steps` > 1) plans one table per step (`block_tables`), each of width 1. `fields`: the
    real rows' `row_fields`, where the caller has them (else read from the records and the step). With
    the step admitted as `columns` (`real` its segments), `row_of` may be each real row's row, in order,
    and the rows' spans and step tokens are read from them.
    """
    if step.steps > 1:
        table = block_tables(
            step, real, rows, row_of, requests=requests, slots=slots, padding_slot=padding_slot,
            config=config, fields=fields, columns=columns,
        )  # fmt: skip
        return BoundedKVPlan(table, num_tokens=1, steps=step.steps)
    table = layout.padding_rows(rows, padding_slot)
    if real:
        fields = fields or _fields_of(step, real, requests, slots)
        if columns is None:
            span, tokens = _ints(seg.span for seg in real), _ints(step_tokens_of(step, seg) for seg in real)
        else:
            span, tokens = columns.span, columns.step_tokens
        table[_rows_of(real, row_of)] = layout.plan_table(
            **fields, span=span, step_tokens=tokens, sink_capacity=config.sink_capacity,
            reverse=config.reverse_step_order,
        )  # fmt: skip
    table.setflags(write=False)
    if bucket is not None:
        width = bucket.num_tokens
    elif columns is not None:
        width = int(columns.step_tokens.max()) if real else None
    else:
        width = max((step_tokens_of(step, s) for s in real), default=None)
    return BoundedKVPlan(table, num_tokens=width)


def plan_columns(
    step: BoundedKVStep,
    columns: StepColumns,
    slot_fields: Mapping[str, np.ndarray],
    bucket: BucketKey | None,
    *,
    groups: Sequence[tuple[int, int]] | None,
    requests: Mapping[str, Any],
    slots: SlotPools,
    padding_slot: int,
    config: BoundedKVConfig,
) -> BoundedKVPlan:
    """`plan` of a step admitted as `columns` (every row holds its slot), its rows laid out by
    `table_rows_of`; `slot_fields` are the rows' `slot_fields`."""
    rows, row_of = table_rows_of(
        step.segments or (), columns, None if bucket is None else bucket.bs, slots=slots, requests=requests,
        groups=groups,
    )  # fmt: skip
    fields = {
        **slot_fields, "source": columns.source.astype(np.int32),
        "source_len": columns.source_len.astype(np.int32), "written": columns.written.astype(np.int32),
    }  # fmt: skip
    return plan(
        step, columns.segments, rows, row_of, bucket, requests=requests, slots=slots,
        padding_slot=padding_slot, config=config, fields=fields, columns=columns,
    )  # fmt: skip


def _rows_of(real: Sequence[Segment], row_of: Mapping[str, int] | np.ndarray) -> np.ndarray:
    """Each real row's row of the table, in order (`row_of` as a mapping, or already that array)."""
    if isinstance(row_of, np.ndarray):
        return row_of
    return np.fromiter((row_of[seg.request_id] for seg in real), np.int64, len(real))


def block_tables(
    step: BoundedKVStep,
    real: Sequence[Segment],
    rows: int,
    row_of: Mapping[str, int],
    *,
    requests: Mapping[str, Any],
    slots: SlotPools,
    padding_slot: int,
    config: BoundedKVConfig,
    fields: Mapping[str, np.ndarray] | None = None,
    columns: StepColumns | None = None,
) -> np.ndarray:
    """i32[steps, rows, ROW_INTS]: the tables of a block's one-token steps. A request of span `s` takes
    the first `s` steps, step `j` planned as a one-token step after `written + j` entries; in the others
    its row is a padding row (it reads and writes nothing). One vectorised `plan_table` for every
    (request, step) pair."""
    table = layout.padding_rows(step.steps * rows, padding_slot).reshape(step.steps, rows, -1)
    spans = _ints(seg.span for seg in real).astype(np.int64) if columns is None else columns.span
    if spans.size and spans.max() > step.steps:
        r = int(np.argmax(spans > step.steps))
        raise ValueError(f"span[{r}]={spans[r]} exceeds the block's steps={step.steps}")
    if not spans.sum():
        table.setflags(write=False)
        return table
    fields = fields or _fields_of(step, real, requests, slots)
    owner = np.repeat(np.arange(len(real)), spans)  # each (request, step) pair's request
    nth = np.arange(owner.size) - np.repeat(np.cumsum(spans) - spans, spans)  # and its step
    fields = {name: values[owner] for name, values in fields.items()}
    fields["written"] = fields["written"] + nth
    ones = np.ones(owner.size, np.int32)
    table[nth, _rows_of(real, row_of)[owner]] = layout.plan_table(
        **fields, span=ones, step_tokens=ones, sink_capacity=config.sink_capacity,
        reverse=config.reverse_step_order,
    )  # fmt: skip
    table.setflags(write=False)
    return table


def _fields_of(step: BoundedKVStep, real: Sequence[Segment], requests: Mapping[str, Any], slots: SlotPools):
    """`row_fields` of the real rows `real`, read from their records and the step's positions."""
    positions = [step.positions[seg.request_id] for seg in real]
    return row_fields(
        [requests[seg.request_id] for seg in real], slots, source=_ints(p.source for p in positions),
        source_len=_ints(p.source_len for p in positions), written=_ints(p.written for p in positions),
    )  # fmt: skip


def _ints(values) -> np.ndarray:
    return np.fromiter(values, np.int32)


def row_fields(
    records: Sequence[Any],
    slots: SlotPools,
    *,
    source: np.ndarray,
    source_len: np.ndarray,
    written: np.ndarray,
) -> dict[str, np.ndarray]:
    """`plan_table`'s per-request fields of requests holding slots, their positions given as arrays."""
    return {
        **slot_fields(records, slots),
        "source": source.astype(np.int32, copy=False),
        "source_len": source_len.astype(np.int32, copy=False),
        "written": written.astype(np.int32, copy=False),
    }


def slot_fields(records: Sequence[Any], slots: SlotPools) -> dict[str, np.ndarray]:
    """`row_fields` that stay while each request holds its slot: the slot (local to its data shard)
    and the retention."""
    table = np.array([(r.slot, *r.policy) for r in records], np.int64).reshape(len(records), 4)
    return {
        "slot": (table[:, 0] % (slots.per_shard + 1)).astype(np.int32),
        "sink": table[:, 1].astype(np.int32),
        "window": table[:, 2].astype(np.int32),
        "window_includes_step": table[:, 3].astype(bool),
    }
