"""Slot pools per data shard: the slot axis layout, least-loaded placement, and a sharded manager whose
every shard plans exactly what an unsharded manager of that shard's size plans (docs/design.md §10)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mstar_jax.resources.kv.bounded.cache import BoundedKVCache
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.padding import pad_step
from mstar_jax.resources.kv.bounded.slots import SlotPools
from mstar_jax.resources.step import (
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    Segment,
    SlotLease,
    StepContext,
)

CFG = BoundedKVConfig(
    num_layers=1, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=4, min_source_len=2,
    retention=SinkWindow(3, 4), max_slots=6,
)  # fmt: skip


def test_the_slot_axis_holds_each_shards_slots_then_its_padding_slot():
    pools = SlotPools(6, 3)
    assert (pools.per_shard, pools.axis_length) == (2, 9)
    assert [pools.shard_of(g) for g in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [pools.local(g) for g in range(9)] == [0, 1, 2] * 3  # local 2: each shard's padding slot
    assert pools.snapshot() == ((1, 0), (4, 3), (7, 6))  # padding slots 2, 5 and 8 are never free
    assert [pools.take() for _ in range(4)] == [0, 3, 6, 1]  # the least loaded shard, lowest first
    pools.give(3)
    assert pools.take() == 3  # the last one given back is reused first
    assert (len(pools), pools.free_in(0), pools.free_in(1), pools.free_in(2)) == (2, 0, 1, 1)
    pools.reset(held={4})
    assert pools.snapshot() == ((1, 0), (3,), (7, 6))


def test_one_shard_is_the_single_device_layout():
    pools = SlotPools(4)
    assert (pools.axis_length, [pools.take() for _ in range(4)]) == (5, [0, 1, 2, 3])


@pytest.mark.parametrize("shards", [0, 4, 1.0, True])
def test_slots_must_split_evenly(shards):
    with pytest.raises(ValueError, match=r"max_slots=6 must split evenly over data_shards="):
        SlotPools(6, shards)


def manager(shards: int, slots: int = 6) -> BoundedKVManager:
    config = dataclasses.replace(CFG, max_slots=slots)
    m = BoundedKVManager(BoundedKVSpec("kv", {"node"}, config), num_sources=2, data_shards=shards)
    rng = np.random.default_rng(0)
    layers = [rng.standard_normal((1, 2, 3, 8)).astype(np.float32)]
    m.register_source(0, layers, layers)
    return m


def step(entries, *, bucket_rows: int) -> tuple[BoundedKVStep, StepContext]:
    step = BoundedKVStep(
        tuple(Segment(rid, "main", span) for rid, _, span in entries),
        {rid: pos for rid, pos, _ in entries},
        {rid: 2 for rid, _, _ in entries},
    )
    rids = [rid for rid, _, _ in entries]
    return step, StepContext(
        rids, "walk", 0, False, slot_lease=SlotLease(0, BucketKey("walk", bucket_rows, 2))
    )


def test_a_sharded_cache_and_admission_spread_over_the_shards():
    m = manager(3)
    assert BoundedKVCache.slot_shape(CFG, 3)[0] == m.cache.k[0].shape[0] == 9
    for rid in "abcdefg":
        m.ingest_request(rid)
    assert m.admit(*step([(rid, Pos(3, 0, 0), 1) for rid in "abcd"], bucket_rows=2)).ok
    assert [m.shard_of(rid) for rid in "abcd"] == [0, 1, 2, 0]
    assert m.padding_slot == 2  # local, on every shard
    outcome = m.admit(*step([(rid, Pos(3, 0, 0), 1) for rid in "efg"], bucket_rows=2))
    assert isinstance(outcome.reason, AllocationFailed)  # 2 free, 3 needed
    assert outcome.reason.pages_short == 1
    assert m.free_slots == 2
    assert m.admit(*step([(rid, Pos(3, 0, 0), 1) for rid in "ef"], bucket_rows=2)).ok  # shard 0 is full
    assert (m.shard_of("e"), m.shard_of("f")) == (1, 2)


def test_every_shard_plans_what_an_unsharded_manager_of_its_size_plans():
    sharded, alone = manager(3), [manager(1, slots=2) for _ in range(3)]
    for m in (sharded, *alone):
        for rid in "abcde":
            m.ingest_request(rid)
    # Placement: a, d on shard 0; b, e on shard 1; c on shard 2 (least loaded, in arrival order).
    placed = {0: "ad", 1: "be", 2: "c"}
    written = dict.fromkeys("abcde", 0)
    for spans in ({"a": 2, "b": 1, "c": 2, "d": 1, "e": 2}, {"a": 1, "b": 2, "c": 1, "d": 2, "e": 1}):
        entries = [(rid, Pos(3, written[rid], 0), span) for rid, span in spans.items()]
        sharded_step = step(entries, bucket_rows=2)
        assert sharded.admit(*sharded_step).ok
        table = sharded.plan(*sharded_step).table
        assert table.shape[0] == 6
        rows, row_of = sharded.plan_rows(*sharded_step)
        assert rows == 6
        for shard, rids in placed.items():
            assert [row_of[rid] for rid in rids] == list(range(2 * shard, 2 * shard + len(rids)))
            own = step([e for e in entries if e[0] in rids], bucket_rows=2)
            assert alone[shard].admit(*own).ok
            np.testing.assert_array_equal(table[2 * shard : 2 * shard + 2], alone[shard].plan(*own).table)
            alone[shard].commit(*own)
        sharded.commit(*sharded_step)
        written = {rid: written[rid] + spans[rid] for rid in written}


def test_a_shard_with_more_requests_than_the_bucket_holds_is_refused_before_anything_is_claimed():
    m = manager(2)
    for rid in "abc":
        m.ingest_request(rid)
    entries = [(rid, Pos(3, 0, 0), 1) for rid in "abc"]  # a, c would go to shard 0
    refused = m.admit(*step(entries, bucket_rows=1))
    assert not refused.ok
    assert isinstance(refused.reason, AdmitRuntimeError)  # terminal: no retry admits it
    assert refused.reason.message == (
        "bounded KV step: data shard 0 has 2 of the step's requests ['a', 'c']; "
        "the bucket holds 1 rows per shard"
    )
    assert m.free_slots == 6
    assert m._slots.snapshot() == manager(2)._slots.snapshot()
    assert all(m.slot_of(rid) is None for rid in "abc")
    # Those already holding slots are counted where they are: a (shard 0) and b (shard 1) fit one row
    # each, and c, new, would join a.
    admitted = step(entries[:2], bucket_rows=1)
    assert m.admit(*admitted).ok
    m.commit(*admitted)
    moved = [(rid, Pos(3, 1 if rid != "c" else 0, 0), 1) for rid in "abc"]
    assert m.admit(*step(moved, bucket_rows=1)).reason.message.startswith(
        "bounded KV step: data shard 0 has 2 of the step's requests ['a', 'c']"
    )
    assert m.slot_of("c") is None
    assert m.free_slots == 4


def test_offload_and_reload_keep_each_shards_count():
    m = manager(2)
    for rid in "ab":
        m.ingest_request(rid)
    admitted = step([(rid, Pos(3, 0, 0), 1) for rid in "ab"], bucket_rows=1)
    assert m.admit(*admitted).ok
    m.commit(*admitted)
    assert m.offload("a") == m.cache.nbytes // 8
    assert (m._slots.free_in(0), m._slots.free_in(1)) == (3, 2)
    assert m.reload("a")
    assert m.shard_of("a") == 0  # the least loaded shard again


def test_a_light_load_takes_the_shards_in_turn():
    pools = SlotPools(8, 4)
    shards = []
    for _ in range(6):  # one request at a time, each gone before the next arrives
        slot = pools.take()
        shards.append(pools.shard_of(slot))
        pools.give(slot)
    assert shards == [0, 1, 2, 3, 0, 1]


def test_preview_says_where_the_next_takes_go(rng):
    pools = SlotPools(12, 4)
    held = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            pools.give(held.pop(int(rng.integers(len(held)))))
        elif len(pools):
            count = int(rng.integers(1, len(pools) + 1))
            expected = pools.preview(count)
            taken = [pools.take() for _ in range(count)]
            assert [pools.shard_of(slot) for slot in taken] == expected
            held += taken
    assert pools.preview(len(pools) + 5) == pools.preview(len(pools))  # no further than the free slots


def test_fewer_kv_heads_than_model_shards_are_stored_as_copies():
    m = BoundedKVManager(BoundedKVSpec("kv", {"node"}, CFG), num_sources=2, data_shards=2, model_shards=4)
    assert m.stored_heads == 4
    assert m.cache.k[0].shape == (8, 1, 4, CFG.slot_capacity, 8)  # 2 pools of (3 + 1 padding) slots
    rng = np.random.default_rng(1)
    k = [rng.standard_normal((1, 2, 3, 8)).astype(np.float32)]  # 2 heads, as the model computes them
    m.register_source(1, k, k)
    bank = np.asarray(m.bank.k[0])[1, 0, :, :3]
    for head in range(4):  # stored head j is a copy of head j // 2
        np.testing.assert_array_equal(bank[head], k[0][0, head // 2])
    with pytest.raises(ValueError, match=r"kv_heads=2 cannot be split over model=3 shards"):
        BoundedKVManager(BoundedKVSpec("kv", {"node"}, CFG), model_shards=3)


def test_a_process_hands_out_only_its_own_shards_slots():
    pools = SlotPools(6, 3, local=[2, 1])
    assert pools.local_shards == (1, 2)
    assert pools.snapshot() == ((), (4, 3), (7, 6))  # shard 0 belongs to another process
    assert (len(pools), pools.free_in(0)) == (4, 0)
    assert pools.preview(5) == [1, 2, 1, 2]  # as far as its own slots last
    assert [pools.take() for _ in range(4)] == [3, 6, 4, 7]
    assert len(pools) == 0
    pools.reset(held={3})
    assert pools.snapshot() == ((), (4,), (7, 6))


@pytest.mark.parametrize("local", [[], [3], [-1], [0.0]])
def test_local_shards_must_be_shard_indices(local):
    with pytest.raises(
        ValueError, match=r"local_data_shards=.* must be a non-empty collection of shard indices in \[0, 3\)"
    ):
        SlotPools(6, 3, local=local)


def test_a_manager_of_a_process_admits_into_its_own_shards_only():
    config = dataclasses.replace(CFG, max_slots=4)
    m = BoundedKVManager(
        BoundedKVSpec("kv", {"node"}, config), num_sources=2, data_shards=2, local_data_shards=[1]
    )
    layers = [np.ones((1, 2, 3, 8), np.float32)]
    m.register_source(0, layers, layers)
    assert (m.local_data_shards, m.free_slots) == ((1,), 2)
    for rid in ("a", "b", "c"):
        m.ingest_request(rid)
    entries = [(rid, Pos(3, 0, 0), 1) for rid in ("a", "b", "c")]
    assert m.placement(["a", "b", "c"]) == {"a": 1, "b": 1}  # "c" finds no room on shard 1
    full = m.admit(*step(entries, bucket_rows=2))
    assert isinstance(full.reason, AllocationFailed)
    assert m.free_slots == 2  # nothing claimed
    s, ctx = step(entries[:2], bucket_rows=2)
    assert m.admit(s, ctx).ok
    assert {m.shard_of(rid) for rid in ("a", "b")} == {1}
    rows, row_of = m.plan_rows(s, ctx)
    assert rows == 4
    assert sorted(row_of.values()) == [2, 3]  # shard 0's rows stay padding
    table = m.plan(s, ctx).table
    np.testing.assert_array_equal(table[:2], m.plan(*step([], bucket_rows=2)).table[:2])


def test_row_groups_lay_each_shard_out_group_by_group():
    """A combined step's groups (decode rows, then prefill rows): each shard's part of the table is its
    rows of each group in turn, each group padded to its size, and plans what an unsharded manager of
    the shard's size plans of the same rows padded by `pad_step`."""
    sharded, alone = manager(3), [manager(1, slots=2) for _ in range(3)]
    for m in (sharded, *alone):
        for rid in "abcde":
            m.ingest_request(rid)
    placed = {0: "ad", 1: "be", 2: "c"}  # least loaded, in arrival order
    first = [(rid, Pos(3, 0, 0), 1) for rid in "abcde"]
    assert sharded.admit(*step(first, bucket_rows=2)).ok
    sharded.commit(*step(first, bucket_rows=2))
    for m, rids in zip(alone, placed.values(), strict=True):
        own = step([e for e in first if e[0] in rids], bucket_rows=2)
        assert m.admit(*own).ok
        m.commit(*own)
    decode, prefill = "abc", "de"  # groups of 2 and 1 rows per shard: 3 rows a shard
    entries = [(rid, Pos(3, 1, 0), 1 if rid in decode else 2) for rid in decode + prefill]
    s, ctx = step(entries, bucket_rows=2)
    ctx.row_groups = ((len(decode), 2), (len(prefill), 1))
    assert sharded.admit(s, ctx).ok
    rows, row_of = sharded.plan_rows(s, ctx)
    assert rows == 9
    assert row_of == {"a": 0, "b": 3, "c": 6, "d": 2, "e": 5}
    table = sharded.plan(s, ctx).table
    for shard, rids in placed.items():
        mine = [e for e in entries if e[0] in rids]
        groups = [[e for e in mine if e[0] in decode], [e for e in mine if e[0] in prefill]]
        padded = pad_step(
            BoundedKVStep(
                tuple(Segment(rid, "main", span) for rid, _, span in groups[0] + groups[1]),
                {rid: pos for rid, pos, _ in mine}, {rid: 2 for rid, _, _ in mine},
            ),
            BucketKey("walk", 2, 2),
            groups=[(len(groups[0]), 2), (len(groups[1]), 1)],
        )  # fmt: skip
        assert alone[shard].admit(padded.step, padded.ctx).ok
        np.testing.assert_array_equal(
            table[3 * shard : 3 * shard + 3], alone[shard].plan(padded.step, padded.ctx).table
        )


def test_a_group_with_more_of_a_shards_rows_than_its_size_is_refused():
    m = manager(3)
    for rid in "abcd":
        m.ingest_request(rid)
    entries = [(rid, Pos(3, 0, 0), 1) for rid in "abcd"]  # a and d on shard 0
    s, ctx = step(entries, bucket_rows=2)
    assert m.admit(s, ctx).ok
    ctx.row_groups = ((2, 1), (2, 1))  # group 1 (c, d): c on shard 2, d on shard 0 — fits
    assert m.plan_rows(s, ctx)[1] == {"a": 0, "b": 2, "c": 5, "d": 1}
    ctx.row_groups = ((3, 1), (1, 1))  # group 0 (a, b, c) fits; so does (d)
    assert m.plan_rows(s, ctx)[1]["d"] == 1
    ctx.row_groups = ((4, 1), (0, 1))  # a and d both in group 0 of one row on shard 0
    with pytest.raises(ValueError, match=r"data shard 0 has 2 of the step's requests \['a', 'd'\]"):
        m.plan_rows(s, ctx)
