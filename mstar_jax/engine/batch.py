"""From a batch of rows to what a compiled program runs: its bucket, its padded step, its inputs.

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

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mstar_jax.compile import Buckets, CombinedRows
from mstar_jax.engine.scheduler import FlowRow
from mstar_jax.models.streaming_tts.model import FLOW_CHUNK, TALKER_DECODE, TALKER_MIXED, TALKER_PREFILL
from mstar_jax.resources.kv.bounded.config import BoundedKVStep, PositionColumns, StreamPosition
from mstar_jax.resources.step import PAD, BucketKey, Segment
from mstar_jax.serving import transaction
from mstar_jax.serving.stream import Stream
from mstar_jax.serving.transaction import Declared

__all__ = [
    "PAD",
    "Layout",
    "choose_bucket",
    "declare",
    "fit_bucket",
    "fit_shards",
    "row_groups",
    "row_indices",
    "row_outputs",
    "step_inputs",
    "talker_bucket",
]

Layout = tuple[int, dict[str, int]]
"""A step's rows as the caches plan them on a mesh: how many, and each request's row."""


def choose_bucket(
    buckets: Buckets,
    node: str,
    rows: Sequence,
    *,
    rows_per_shard: int | None = None,
    prefill_per_shard: int | None = None,
) -> tuple[str, BucketKey]:
    """The walk of `rows` and its tightest bucket.

    Talker rows run as decode (one token each), prefill (chunks), or both at once on the combined walk;
    flow rows run as chunks. On a mesh, `rows_per_shard` (the most rows any data shard gets) sizes the
    bucket instead of the row count, and `prefill_per_shard` (the most prefill rows any gets) the
    combined bucket's room.
    """
    size = len(rows) if rows_per_shard is None else rows_per_shard
    if node == "flow":
        return FLOW_CHUNK, buckets.bucket_for(FLOW_CHUNK, size, max([len(r.codes) for r in rows]))
    prefill = [r for r in rows if not r.decode]
    if prefill and len(prefill) < len(rows):
        tokens = max([len(r.tokens) for r in prefill])  # a prefill row's span: its tokens
        room = len(prefill) if prefill_per_shard is None else prefill_per_shard
        return TALKER_MIXED, buckets.bucket_for(TALKER_MIXED, size, tokens, prefill_rows=room)
    if not prefill:  # a block's rows take up to its K steps (K = 1: one step): a decode row's span
        return TALKER_DECODE, buckets.bucket_for(TALKER_DECODE, size, max([r.steps for r in rows]))
    return TALKER_PREFILL, buckets.bucket_for(TALKER_PREFILL, size, max([len(r.tokens) for r in rows]))


def talker_bucket(
    buckets: Buckets, rows_per_shard: int, prefill_per_shard: int, *, decode: bool
) -> BucketKey:
    """The talker bucket of the most rows and prefill rows any data shard brings (`decode`: whether any
    are decode rows), at each walk's largest token count: what the processes of a multi-process mesh
    run, whatever each brings (`Lockstep.agreed_bucket`).

    Beside decode rows a combined step holds at most its largest room of prefill rows: a process whose
    rows are all prefill (it brings no decode row, so none were capped) runs that many, the rest wait.
    """
    if decode:
        room = buckets[TALKER_MIXED].prefill_rows[-1] if TALKER_MIXED in buckets else 0
        prefill_per_shard = min(prefill_per_shard, room)
    if decode and prefill_per_shard:
        tokens = buckets.max_tokens(TALKER_MIXED)
        return buckets.bucket_for(TALKER_MIXED, rows_per_shard, tokens, prefill_rows=prefill_per_shard)
    walk = TALKER_DECODE if decode else TALKER_PREFILL
    return buckets.bucket_for(walk, rows_per_shard, buckets.max_tokens(walk))


def fit_shards(rows: Sequence, placement: dict[str, int], most: int) -> tuple[list, int]:
    """`rows` with at most `most` per data shard (the first ones, in order), and the most any shard
    keeps; rows without a placement (admission would refuse them anyway) are kept and counted apart."""
    kept, per_shard = [], collections.Counter()
    for row in rows:
        shard = placement.get(row.stream.request_id)
        if per_shard[shard] < most:
            per_shard[shard] += 1
            kept.append(row)
    return kept, max((n for shard, n in per_shard.items() if shard is not None), default=1)


def fit_placed(
    manager: Any, rows: Sequence, most: int, bucket: BucketKey | None = None
) -> tuple[list, int, dict[str, int]]:
    """`fit_shards` of `rows` (after `fit_bucket`, where a bucket is agreed) by where `manager` places
    them, fitted again to what is kept until nothing more is dropped: `(kept, width, placement)`. A new
    request's shard depends on the new requests before it (`BoundedKVManager.placement`), so dropping
    one moves those after it; fitted once, the step admitted could put more rows on a shard than its
    bucket holds, which admission refuses for every row."""
    while True:
        placement = manager.placement([row.stream.request_id for row in rows])
        kept = rows if bucket is None else fit_bucket(bucket, rows, placement)
        kept, width = fit_shards(kept, placement, most)
        if len(kept) == len(rows):
            return kept, width, placement
        rows = kept


def fit_bucket(bucket: BucketKey, rows: Sequence, placement: dict[str, int]) -> list:
    """The rows of `rows` that `bucket` holds on a mesh: those of its walk (a talker decode bucket's
    decode rows, a prefill bucket's prefill rows), at most each row group's size per data shard (the
    first ones; `fit_shards`)."""
    if bucket.graph_walk in (TALKER_DECODE, TALKER_PREFILL):
        rows = [r for r in rows if r.decode == (bucket.graph_walk == TALKER_DECODE)]
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


def step_inputs(bucket: BucketKey, rows: Sequence, layout: Layout | None = None) -> tuple[np.ndarray, ...]:
    """The program's inputs after `(params, cache, bank, plan)` (and a talker's `prev_codes`), padded
    to the bucket (host numpy).

    Talker walks: `feed i32[B], tokens i32[B, T], lengths i32[B], seeds u32[B]` (T = 1 for a decode
    block, whose one input token a row starts K steps); the combined walk: its
    decode rows' feed, tokens and lengths, its prefill rows' tokens and lengths, then every row's seed;
    the flow: `codes i32[B, T], seeds u32[B]`. `feed` is each row's `TalkerRow.feed` (-1 for padding).
    With a `layout` (a mesh), `B` is its row count and each request's row is where it says; the
    combined walk's decode and prefill arrays then hold each shard's rows of their group, shard-major,
    and its seeds follow the table's rows.
    """
    groups = row_groups(bucket, rows)

    table_rows_per_shard = sum(size for _, size in groups)
    shards = 1 if layout is None else layout[0] // table_rows_per_shard

    def block(group, size, tokens, offset=0):
        """One group's arrays, `size` rows a shard (every shard's, shard-major, on a mesh)."""
        ids = np.zeros((shards * size, tokens), np.int32)
        lengths = np.zeros(shards * size, np.int32)
        seeds = np.zeros(shards * size, np.uint32)
        feed = np.full(shards * size, -1, np.int32)
        if not group:
            return feed, ids, lengths, seeds
        if layout is None:
            where = np.arange(len(group))
        else:  # the group starts `offset` rows into each shard's part of the table
            placed = np.fromiter((layout[1][row.stream.request_id] for row in group), np.int64, len(group))
            shard, within = np.divmod(placed, table_rows_per_shard)
            where = shard * size + within - offset
        if isinstance(group[0], FlowRow):  # a group's rows are of one kind
            values = [row.codes for row in group]
        else:
            values = [row.tokens for row in group]
        counts = list(map(len, values))
        if min(counts) == max(counts):  # a block's rows all bring as many tokens: one assignment
            # `fromiter` over the flat values: NumPy reads a list of tuples element by element, checking
            # each one's type and shape, several times slower.
            flat = np.fromiter(itertools.chain.from_iterable(values), np.int32, len(values) * counts[0])
            ids[where, : counts[0]] = flat.reshape(len(values), counts[0])
        else:
            for i, row_values in zip(where.tolist(), values, strict=True):
                ids[i, : len(row_values)] = row_values
        lengths[where] = counts
        seeds[where] = [row.stream.request.seed for row in group]
        if not isinstance(group[0], FlowRow):  # a flow step reads no feed
            feed[where] = [row.feed for row in group]
        return feed, ids, lengths, seeds

    if bucket.graph_walk == FLOW_CHUNK:
        _, ids, _, seeds = block(*groups[0], bucket.num_tokens)
        return ids, seeds
    if bucket.graph_walk == TALKER_MIXED:
        (decode, d), (prefill, p) = groups
        d_feed, d_ids, d_len, d_seeds = block(decode, d, 1)
        _, p_ids, p_len, p_seeds = block(prefill, p, bucket.num_tokens, offset=d)
        seeds = np.concatenate([d_seeds.reshape(shards, d), p_seeds.reshape(shards, p)], axis=1)
        return d_feed, d_ids, d_len, p_ids, p_len, seeds.reshape(-1)
    return block(*groups[0], 1 if bucket.graph_walk == TALKER_DECODE else bucket.num_tokens)


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
