"""`batch.fit_shards`: a mesh step keeps at most a bucket's rows per data shard, the first ones."""

from __future__ import annotations

import dataclasses

from mstar_jax.engine import batch


@dataclasses.dataclass(frozen=True)
class _Stream:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Row:
    stream: _Stream


def rows(*rids: str) -> list[_Row]:
    return [_Row(_Stream(rid)) for rid in rids]


def test_rows_beyond_the_largest_bucket_on_one_shard_wait_for_the_next_step():
    placement = {"a": 0, "b": 1, "c": 0, "d": 0, "e": 1}
    kept, width = batch.fit_shards(rows(*"abcde"), placement, most=2)
    assert [r.stream.request_id for r in kept] == ["a", "b", "c", "e"]  # d would be shard 0's third
    assert width == 2


def test_the_width_is_the_most_rows_any_shard_keeps():
    kept, width = batch.fit_shards(rows("a", "b"), {"a": 0, "b": 1}, most=4)
    assert (len(kept), width) == (2, 1)
    kept, width = batch.fit_shards(rows("a", "x"), {"a": 2}, most=1)  # x: no room, admission refuses it
    assert ([r.stream.request_id for r in kept], width) == (["a", "x"], 1)
