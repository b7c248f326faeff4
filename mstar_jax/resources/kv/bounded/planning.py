"""A bounded cache's plan of a step, from the manager's records: where each row sits in the table, and
the table itself (`BoundedKVManager.plan_rows` and `plan` are these, given the manager's state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.admission import step_tokens_of
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVStep
from mstar_jax.resources.kv.bounded.slots import SlotPools
from mstar_jax.resources.step import BucketKey, Segment

__all__ = ["plan", "table_rows"]


def table_rows(
    segments: Sequence[Segment],
    real: Sequence[str],
    bucket_rows: int | None,
    *,
    slots: SlotPools,
    requests: Mapping[str, Any],
) -> tuple[int, dict[str, int]]:
    """The plan table's row count and each real request's row.

    On one data shard, row `i` is segment `i`, padded to the bucket's rows. Over several, the table is
    shard-major: shard `d` owns rows `[d * b, (d + 1) * b)`, `b` the bucket's rows per shard (or the
    most any shard has), its requests in segment order, then its padding rows.

    Args:
      segments: the step's rows, padding included.
      real: the real rows' request ids, in segment order.
      bucket_rows: the bucket's rows (per data shard), or None for an unbucketed step.
      slots, requests: the manager's slot pools and request records.

    Raises:
      ValueError: a data shard has more of the step's requests than the bucket's rows per shard.
    """
    if slots.shards == 1:
        index = {seg.request_id: i for i, seg in enumerate(segments)}
        return max(len(segments), bucket_rows or 0), {rid: index[rid] for rid in real}
    by_shard: list[list[str]] = [[] for _ in range(slots.shards)]
    for rid in real:
        by_shard[slots.shard_of(requests[rid].slot)].append(rid)
    width = bucket_rows or max(1, *map(len, by_shard))
    for shard, rids in enumerate(by_shard):
        if len(rids) > width:
            raise ValueError(
                f"data shard {shard} has {len(rids)} of the step's requests {rids}; the bucket holds "
                f"{width} rows per shard"
            )
    return slots.shards * width, {
        rid: shard * width + j for shard, rids in enumerate(by_shard) for j, rid in enumerate(rids)
    }


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
) -> BoundedKVPlan:
    """The plan table of `step`'s real rows `real`, at their rows `row_of` of a `rows`-row table (padding
    rows plan empty, on each shard's padding slot); slots are local to each request's data shard.

    The plan's `num_tokens` is the bucket's token count for a bucketed step (its arrays are the bucket's
    width), else the most step tokens a row declares (None with no real rows).
    """
    table = layout.padding_rows(rows, padding_slot)
    if real:
        records = [requests[seg.request_id] for seg in real]
        positions = [step.positions[seg.request_id] for seg in real]
        ints = lambda values: np.fromiter(values, np.int32, len(real))  # noqa: E731
        table[[row_of[seg.request_id] for seg in real]] = layout.plan_table(
            slot=ints(slots.local(r.slot) for r in records),
            source=ints(p.source for p in positions),
            source_len=ints(p.source_len for p in positions),
            written=ints(p.written for p in positions),
            span=ints(seg.span for seg in real),
            step_tokens=ints(step_tokens_of(step, seg) for seg in real),
            sink=ints(r.policy.sink for r in records),
            window=ints(r.policy.window for r in records),
            window_includes_step=np.fromiter(
                (r.policy.window_includes_step for r in records), bool, len(real)
            ),
            sink_capacity=config.sink_capacity,
            reverse=config.reverse_step_order,
        )
    table.setflags(write=False)
    width = (
        bucket.num_tokens
        if bucket is not None
        else max((step_tokens_of(step, s) for s in real), default=None)
    )
    return BoundedKVPlan(table, num_tokens=width)
