"""From a batch of rows to what a compiled program runs: its bucket, its padded step, its rows' places.

A bucket's rows come in groups, one per kernel: a plain bucket has one group of `bs` rows; a combined
bucket (`CombinedRows`) has its decode rows, then its prefill rows. Each group is padded to its size
with padding rows: segments of span 0 under reserved ids, which the bounded cache plans as empty
layouts (they read nothing and write nothing), and inputs of zeros. The plan table, the inputs and the
outputs all follow that order, so the real rows' outputs are read back group by group.

On a mesh the bounded caches lay a step out themselves (`BoundedKVManager.plan_rows`: shard-major, each
data shard's rows padded to the bucket's rows per shard; a combined bucket's shard holds its decode rows,
then its prefill rows, each group padded to its size), and a `Layout` of that places every row's inputs
and finds its outputs; padding rows are then not declared at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mstar_jax.compile import Buckets, CombinedRows
from mstar_jax.resources.kv.bounded.config import BoundedKVStep, PositionColumns, StreamPosition
from mstar_jax.resources.step import PAD, BucketKey, Segment
from mstar_jax.serving import transaction
from mstar_jax.serving.model import RowWalks, fit_shards, rows_bucket
from mstar_jax.serving.stream import Stream
from mstar_jax.serving.transaction import Declared

__all__ = [
    "PAD",
    "Layout",
    "agreed_rows_bucket",
    "declare",
    "fit_bucket",
    "fit_placed",
    "fit_shards",
    "row_groups",
    "row_indices",
    "row_outputs",
    "rows_bucket",
]

Layout = tuple[int, dict[str, int]]
"""A step's rows as the caches plan them on a mesh: how many, and each request's row."""


def agreed_rows_bucket(
    buckets: Buckets, walks: RowWalks, rows_per_shard: int, prefill_per_shard: int, *, decode: bool
) -> BucketKey:
    """The bucket of the most rows and prefill rows any data shard brings (`decode`: whether any are
    decode rows), at each walk's largest token count: what the processes of a multi-process mesh run,
    whatever each brings (`Lockstep.agreed_bucket`).

    Beside decode rows a combined step holds at most its largest room of prefill rows: a process whose
    rows are all prefill (it brings no decode row, so none were capped) runs that many, the rest wait.
    """
    combined = walks.combined if walks.combined in buckets else None
    if decode:
        room = buckets[combined].prefill_rows[-1] if combined is not None else 0
        prefill_per_shard = min(prefill_per_shard, room)
    if decode and prefill_per_shard:
        tokens = buckets.max_tokens(combined)
        return buckets.bucket_for(combined, rows_per_shard, tokens, prefill_rows=prefill_per_shard)
    walk = walks.decode if decode else walks.prefill
    return buckets.bucket_for(walk, rows_per_shard, buckets.max_tokens(walk))


def fit_placed(
    manager: Any, rows: Sequence, most: int, bucket: BucketKey | None = None, walks: RowWalks | None = None
) -> tuple[list, int, dict[str, int]]:
    """`fit_shards` of `rows` (after `fit_bucket`, where a bucket is agreed) by where `manager` places
    them, fitted again to what is kept until nothing more is dropped: `(kept, width, placement)`. A new
    request's shard depends on the new requests before it (`BoundedKVManager.placement`), so dropping
    one moves those after it; fitted once, the step admitted could put more rows on a shard than its
    bucket holds, which admission refuses for every row."""
    while True:
        placement = manager.placement([row.stream.request_id for row in rows])
        kept = rows if bucket is None else fit_bucket(bucket, rows, placement, walks)
        kept, width = fit_shards(kept, placement, most)
        if len(kept) == len(rows):
            return kept, width, placement
        rows = kept


def fit_bucket(
    bucket: BucketKey, rows: Sequence, placement: dict[str, int], walks: RowWalks | None = None
) -> list:
    """The rows of `rows` that `bucket` holds on a mesh: those of its walk (where the rows say their walk,
    `walks`: a decode bucket's decode rows, a prefill bucket's prefill rows), at most each row group's
    size per data shard (the first ones; `fit_shards`)."""
    if walks is not None and bucket.graph_walk in (walks.decode, walks.prefill):
        rows = [r for r in rows if r.decode == (bucket.graph_walk == walks.decode)]
    return [row for group, size in row_groups(bucket, rows) for row in fit_shards(group, placement, size)[0]]


def row_groups(bucket: BucketKey, rows: Sequence) -> list[tuple[list, int]]:
    """`rows` split per kernel, each with the bucket's row count for it (decode, then prefill)."""
    if isinstance(bucket.cg_key_info, CombinedRows):
        decode = [r for r in rows if r.decode]
        prefill = [r for r in rows if not r.decode]
        return [(decode, bucket.cg_key_info.decode_rows), (prefill, bucket.cg_key_info.prefill_rows)]
    return [(list(rows), bucket.bs)]


def declare(
    bucket: BucketKey,
    rows: Sequence,
    *,
    keys: Sequence[str],
    positions: Callable[[Sequence[Stream]], Sequence[StreamPosition]],
    pad: bool = True,
    steps: int = 1,
) -> tuple[Declared, list]:
    """The cache step of `rows` on the caches `keys`, padded to `bucket` (`pad_step`) and leased to it.

    Args:
      bucket: the bucket the rows run in.
      rows: the model's rows (each with a `stream` and a `span`; a combined bucket's also say `decode`).
      keys: the node's caches.
      positions: where each of the rows' streams stands in them (`ServedModel.positions`).
      pad: declare padding rows (False on a mesh, where the caches pad each data shard themselves).
      steps: the one-token steps of a decode block (`BoundedKVStep.steps`; 1: one step).

    Returns:
      (the declared step, the rows in bucket order).
    """
    groups = row_groups(bucket, rows)
    ordered = [row for group, _ in groups for row in group]
    streams = [row.stream for row in ordered]
    rids = [stream.request_id for stream in streams]
    # `tuple.__new__` makes each Segment without the NamedTuple's Python-level `__new__` (one per row).
    new = tuple.__new__
    step = BoundedKVStep(
        tuple([new(Segment, (rid, "main", row.span)) for rid, row in zip(rids, ordered, strict=True)]),
        PositionColumns(rids, positions(streams)),
        steps=steps,
    )
    sizes = [(len(group), size) for group, size in groups]
    return transaction.declare(keys, step, bucket, groups=sizes, pad=pad), ordered


def row_indices(bucket: BucketKey, rows: Sequence, layout: Layout | None = None) -> list[int]:
    """Where each of `rows` sits in the program's per-row outputs (each group is padded)."""
    if layout is not None:
        return [layout[1][row.stream.request_id] for row in rows]
    if not isinstance(bucket.cg_key_info, CombinedRows):
        return list(range(len(rows)))
    # A combined bucket: the decode rows from row 0, the prefill rows from the decode group's end.
    decode = np.fromiter((row.decode for row in rows), bool, len(rows))
    first = np.where(decode, 0, bucket.cg_key_info.decode_rows)
    nth = np.where(decode, np.cumsum(decode), np.cumsum(~decode)) - 1  # each row's place in its group
    return (first + nth).tolist()


def row_outputs(bucket: BucketKey, rows: Sequence, per_row: np.ndarray, layout: Layout | None = None) -> list:
    """The real rows' entries of a per-row output, in `rows` order."""
    return [per_row[i] for i in row_indices(bucket, rows, layout)]
