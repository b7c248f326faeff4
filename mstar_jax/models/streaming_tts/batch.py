"""The streaming TTS model's program inputs: its talker's and flow decoder's rows as host arrays padded
to a bucket (`engine/batch.py` pads the step and finds the rows' outputs)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from mstar_jax.engine.batch import Layout, row_groups
from mstar_jax.models.streaming_tts.model import FLOW_CHUNK, TALKER_DECODE, TALKER_MIXED
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.chunks import ChunkRow

__all__ = ["step_inputs"]


def step_inputs(bucket: BucketKey, rows: Sequence, layout: Layout | None = None) -> tuple[np.ndarray, ...]:
    """The program's inputs after `(params, cache, bank, plan)` (and a talker's `prev_codes`), padded
    to the bucket (host numpy).

    Talker walks: `feed i32[B], tokens i32[B, T], lengths i32[B], seeds u32[B]` (T = 1 for a decode
    block, whose one input token a row starts K steps); the combined walk: its
    decode rows' feed, tokens and lengths, its prefill rows' tokens and lengths, then every row's seed;
    the flow: `codes i32[B, T], seeds u32[B]`. `feed` is each row's `DecodeRow.feed` (-1 for padding).
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
        if not isinstance(group[0], ChunkRow):  # a flow step reads no feed
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
