"""`batch` on a mesh: a step keeps at most a bucket's rows per data shard, the first ones, and of an agreed
bucket only the rows of its walk; a combined step's inputs hold each shard's rows of each group."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mstar_jax.compile import CombinedRows
from mstar_jax.engine import batch
from mstar_jax.models.streaming_tts.batch import step_inputs
from mstar_jax.models.streaming_tts.model import TALKER_DECODE, TALKER_MIXED, TALKER_PREFILL
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext
from mstar_jax.serving.decoder import DecodeRow
from mstar_jax.serving.model import RowWalks

SLOTS_CFG = BoundedKVConfig(
    num_layers=1, num_heads=1, head_dim=8, rows_per_request=1, max_source_len=0,
    retention=SinkWindow(1, 4), max_slots=2,
)  # fmt: skip


def rows(*rids: str) -> list[DecodeRow]:
    return [talker_row(rid, (0,), decode=True) for rid in rids]


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


@dataclasses.dataclass(frozen=True)
class _Request:
    seed: int


@dataclasses.dataclass(frozen=True)
class _SeededStream:
    request_id: str
    request: _Request


def talker_row(rid: str, tokens: tuple[int, ...], *, decode: bool, feed: int = -1) -> DecodeRow:
    return DecodeRow(_SeededStream(rid, _Request(seed=100 + ord(rid[0]))), tokens, decode=decode, feed=feed)


MIXED = BucketKey(TALKER_MIXED, 2, 4, cg_key_info=CombinedRows(decode_rows=2, prefill_rows=1))
WALKS = RowWalks(TALKER_DECODE, TALKER_PREFILL, TALKER_MIXED)


def test_a_combined_steps_inputs_on_a_mesh_hold_each_shards_rows_of_each_group():
    """Two shards of 2 decode rows then 1 prefill row: the table's rows are [a, -, p | b, c, q]; the
    decode arrays hold [a, - | b, c], the prefill arrays [p | q], the seeds follow the table."""
    a, b, c = (talker_row(r, (7,), decode=True, feed=f) for r, f in (("a", 3), ("b", -1), ("c", 5)))
    p, q = talker_row("p", (1, 2, 3), decode=False), talker_row("q", (4,), decode=False)
    layout = (6, {"a": 0, "p": 2, "b": 3, "c": 4, "q": 5})
    feed, ids, lengths, p_ids, p_lengths, seeds = step_inputs(MIXED, [a, p, b, c, q], layout)
    np.testing.assert_array_equal(feed, [3, -1, -1, 5])
    np.testing.assert_array_equal(ids[:, 0], [7, 0, 7, 7])
    np.testing.assert_array_equal(lengths, [1, 0, 1, 1])
    np.testing.assert_array_equal(p_ids, [[1, 2, 3, 0], [4, 0, 0, 0]])
    np.testing.assert_array_equal(p_lengths, [3, 1])
    np.testing.assert_array_equal(seeds, [100 + ord(r) if r else 0 for r in ("a", "", "p", "b", "c", "q")])
    assert batch.row_indices(MIXED, [a, p, b, c, q], layout) == [0, 2, 3, 4, 5]


def test_one_device_lays_a_combined_step_out_as_its_groups():
    a, p = talker_row("a", (7,), decode=True), talker_row("p", (1, 2), decode=False)
    _, _, lengths, _, p_lengths, seeds = step_inputs(MIXED, [a, p])
    np.testing.assert_array_equal(lengths, [1, 0])
    np.testing.assert_array_equal(p_lengths, [2])
    np.testing.assert_array_equal(seeds, [100 + ord("a"), 0, 100 + ord("p")])
    assert batch.row_indices(MIXED, [p, a]) == [2, 0]


def test_an_agreed_bucket_keeps_the_rows_of_its_walk_and_each_groups_rows_per_shard():
    d1, d2, d3 = (talker_row(r, (0,), decode=True) for r in ("d1", "d2", "d3"))
    p1, p2 = (talker_row(r, (1, 2), decode=False) for r in ("p1", "p2"))
    placement = {"d1": 0, "d2": 0, "d3": 0, "p1": 1, "p2": 1}
    kept = batch.fit_bucket(MIXED, [d1, p1, d2, d3, p2], placement, WALKS)
    assert [r.stream.request_id for r in kept] == ["d1", "d2", "p1"]  # d3, p2 beyond their groups' rows
    decode = BucketKey(TALKER_DECODE, 2, 1)
    kept = batch.fit_bucket(decode, [d1, p1, d2], placement, WALKS)
    assert [r.stream.request_id for r in kept] == ["d1", "d2"]
    prefill = BucketKey(TALKER_PREFILL, 2, 4)
    kept = batch.fit_bucket(prefill, [d1, p1, p2], placement, WALKS)
    assert [r.stream.request_id for r in kept] == ["p1", "p2"]


def test_processes_agree_on_the_combined_walk_only_where_both_kinds_meet():
    from mstar_jax.models.streaming_tts import tts_buckets

    buckets = tts_buckets(batch_sizes=(1, 2), token_counts=(1, 4), flow_chunk=4)
    assert batch.agreed_rows_bucket(buckets, WALKS, 2, 1, decode=True).graph_walk == TALKER_MIXED
    assert batch.agreed_rows_bucket(buckets, WALKS, 2, 0, decode=True) == BucketKey(TALKER_DECODE, 2, 1)
    assert batch.agreed_rows_bucket(buckets, WALKS, 1, 1, decode=False) == BucketKey(TALKER_PREFILL, 1, 4)
    # A process of prefill rows alone brings more than a combined step's room (1) beside another's
    # decode rows: the step runs as many as its room holds.
    beside = batch.agreed_rows_bucket(buckets, WALKS, 2, 2, decode=True)
    assert (beside.graph_walk, beside.bs, beside.cg_key_info.prefill_rows) == (TALKER_MIXED, 2, 1)
    assert batch.agreed_rows_bucket(buckets, WALKS, 2, 2, decode=False) == BucketKey(TALKER_PREFILL, 2, 4)
    with pytest.raises(ValueError, match=r"^max_prefill_rows_in_combined=-1 must be None or an int >= 0"):
        tts_buckets(batch_sizes=(1, 2), token_counts=(1, 4), flow_chunk=4, max_prefill_rows_in_combined=-1)


def test_row_indices_on_one_device_are_each_rows_place_in_its_padded_group():
    """For rows in any order: a plain bucket's row i sits at i; a combined one's decode rows from 0 and
    its prefill rows from the decode group's end, each in its order (by brute force over the groups)."""
    rng = np.random.default_rng(0)
    mixed = BucketKey(TALKER_MIXED, 8, 4, cg_key_info=CombinedRows(decode_rows=5, prefill_rows=3))
    plain = BucketKey(TALKER_DECODE, 8, 1)
    for _ in range(20):
        decode = rng.random(int(rng.integers(1, 9))) < 0.6
        if decode.sum() > 5 or (~decode).sum() > 3:
            continue
        rows = [talker_row(f"r{i}", (0,), decode=bool(d)) for i, d in enumerate(decode)]
        want, seen = [], {True: 0, False: 0}
        for row in rows:
            want.append(seen[row.decode] + (0 if row.decode else 5))
            seen[row.decode] += 1
        assert batch.row_indices(mixed, rows) == want
        assert batch.row_indices(plain, rows) == list(range(len(rows)))


def test_rows_fitted_to_where_admission_places_them_are_admitted_as_fitted():
    """Two shards with 3 and 6 free slots: four new requests would go to shards 1, 1, 1, 0. Fitted once
    to a bucket of one row a shard, the first and the last are kept, but admitted alone those two both
    go to shard 1 (the least loaded), and the step is refused; fitted until nothing more drops, only
    the first is kept, and its step is admitted."""
    manager = BoundedKVManager(
        BoundedKVSpec("kv", {"node"}, dataclasses.replace(SLOTS_CFG, max_slots=16)), num_sources=1,
        data_shards=2,
    )  # fmt: skip
    for shard in (0,) * 5 + (1,) * 2:
        manager._slots.take(shard)
    new = [talker_row(f"n{i}", (0,), decode=False) for i in range(1, 5)]
    ids = [row.stream.request_id for row in new]
    for rid in ids:
        manager.ingest_request(rid)
    assert manager.placement(ids) == {"n1": 1, "n2": 1, "n3": 1, "n4": 0}

    def admit(kept):
        rids = [row.stream.request_id for row in kept]
        step = BoundedKVStep(
            tuple(Segment(rid, "main", 1) for rid in rids), {rid: Pos(0, 0, 0) for rid in rids}
        )
        ctx = StepContext(rids, "walk", 0, False, slot_lease=SlotLease(0, BucketKey("walk", 1, 1)))
        outcome = manager.admit(step, ctx)
        if outcome.ok:
            manager.abort_step(step, ctx)
        return outcome

    once, _ = batch.fit_shards(new, manager.placement(ids), most=1)
    assert [row.stream.request_id for row in once] == ["n1", "n4"]
    assert "data shard 1 has 2 of the step's requests ['n1', 'n4']" in admit(once).reason.message
    kept, width, placement = batch.fit_placed(manager, new, most=1)
    assert ([row.stream.request_id for row in kept], width, placement) == (["n1"], 1, {"n1": 1})
    assert admit(kept).ok
