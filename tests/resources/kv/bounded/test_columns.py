"""The columns fast path of `BoundedKVManager` (`columns.py`) against its row-by-row rules: for random steps,
valid and broken in every field, `admissible` says yes exactly when `check_rows` refuses no row, and a
step admitted as columns plans the same tables and commits the same positions as the same step taken
row by row (another step object with the same rows)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mstar_jax.resources.kv.bounded import columns as cols
from mstar_jax.resources.kv.bounded.admission import check_rows
from mstar_jax.resources.kv.bounded.config import BoundedKVStep, PositionColumns
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.step import ADMIT_OK, StepNotAdmittedError, UnknownRequestError
from tests.resources.kv.bounded.test_manager import CFG, SOURCE_LENGTHS, declare, new_manager


@pytest.fixture
def manager():
    return new_manager()


# Field values a row may declare: plain ones, and every kind `check_segment` refuses.
BROKEN = {
    "source_len": [-1, 0, 5, 2.0, True, np.int64(3), None],
    "written": [-1, 7, 1.5, np.int32(0)],
    "source": [-1, 2, 3, np.int64(1)],
    "span": [-1, 3, 2.0, False, np.int64(1)],
    "tokens": [0, 3, 1.0, np.int64(2)],
}


def _manager_with_history(rng: np.random.Generator):
    """A manager where request a holds a slot (source 0, 3 tokens, 2 written), b is offloaded and c is
    new; every other id was never ingested."""
    manager = new_manager()
    for rid in ("a", "b", "c"):
        manager.ingest_request(rid)
    for rid, pos in (("a", Pos(3, 0, 0)), ("b", Pos(4, 0, 1))):
        step, ctx = declare([(rid, pos, 2)])
        assert manager.admit(step, ctx) == ADMIT_OK
        manager.commit(step, ctx)
    manager.offload("b")
    return manager


def _random_row(rng: np.random.Generator, rid: str) -> tuple[str, Pos | None, int, int | None]:
    base = {"a": (3, 2, 0), "b": (4, 2, 1), "c": (int(rng.integers(1, 5)), 0, int(rng.integers(0, 2)))}
    source_len, written, source = base.get(rid, (3, 0, 0))
    if rid == "c" and source == 0:
        source_len = min(source_len, SOURCE_LENGTHS[0])
    fields = {"source_len": source_len, "written": written, "source": source, "span": 1, "tokens": None}
    if rng.random() < 0.4:  # break (or merely retype) one field
        field = list(BROKEN)[rng.integers(len(BROKEN))]
        choices = BROKEN[field]
        fields[field] = choices[rng.integers(len(choices))]
    if fields["source_len"] is None:
        return rid, None, fields["span"], fields["tokens"]
    position = Pos(fields["source_len"], fields["written"], fields["source"])
    return rid, position, fields["span"], fields["tokens"]


SEEDS = range(60)


def _as_columns(step: BoundedKVStep, ids: list[str]) -> BoundedKVStep:
    """`step` with its positions as `PositionColumns`, where they can be (every row's, ints, each once)."""
    positions = [step.positions.get(rid) for rid in ids]
    ints = all(p is not None and all(type(v) in (int, np.int32, np.int64) for v in p) for p in positions)
    if not ints or len(set(ids)) < len(ids):
        return step
    return dataclasses.replace(step, positions=PositionColumns(ids, positions))


def _case(seed: int, position_columns: bool = False) -> tuple[bool, bool]:
    """One random step checked both ways; returns (admissible as columns, admitted)."""
    rng = np.random.default_rng(seed)
    manager = _manager_with_history(rng)
    ids = ["a", "c"][: int(rng.integers(1, 3))]
    if rng.random() < 0.25:  # an offloaded or unknown request, or one declared twice
        ids.append(["b", "ghost", "a"][rng.integers(3)])
    rows = [_random_row(rng, rid) for rid in ids]
    tokens = {rid: t for rid, _, _, t in rows if t is not None}
    step, ctx = declare([(rid, pos, span) for rid, pos, span, _ in rows], padding=1, tokens=tokens)
    if position_columns:
        step = _as_columns(step, ids)
    refusal, _ = check_rows(
        step, ctx, padding=manager._is_padding, config=manager.config, requests=manager._requests,
        num_sources=manager.bank.num_sources, source_lengths=manager._source_lengths,
    )  # fmt: skip
    columns = cols.gather(step, ctx, manager._requests)
    fast = columns is not None and cols.admissible(
        columns, ctx, config=manager.config, num_sources=manager.bank.num_sources,
        source_lengths=manager._source_lengths,
    )  # fmt: skip
    if fast:
        assert refusal is None
    # Every row of plain ints is read as columns; only a refusal's row may send the step row by row.
    plain = all(
        pos is not None and all(type(v) in (int, np.int32, np.int64) for v in (*pos, span))
        for _, pos, span, _ in rows
    )
    if refusal is None and plain and len(set(ids)) == len(ids):
        assert fast
    outcome = manager.admit(step, ctx)
    assert outcome.ok == (refusal is None)
    return fast, refusal is None


@pytest.mark.parametrize("position_columns", [False, True], ids=["dict", "PositionColumns"])
@pytest.mark.parametrize("seed", SEEDS)
def test_admissible_exactly_when_no_row_is_refused(seed, position_columns):
    _case(seed, position_columns)


def test_the_random_steps_are_admitted_and_refused_alike_often():
    outcomes = [_case(seed) for seed in SEEDS]
    assert sum(admitted for _, admitted in outcomes) >= len(outcomes) // 4
    assert sum(not admitted for _, admitted in outcomes) >= len(outcomes) // 4


@pytest.mark.parametrize("position_columns", [False, True], ids=["dict", "PositionColumns"])
@pytest.mark.parametrize("steps", [1, 2])
def test_a_step_admitted_as_columns_plans_and_commits_as_row_by_row(steps, position_columns):
    fast, slow = new_manager(), new_manager()
    for manager in (fast, slow):
        for rid in ("a", "c"):
            manager.ingest_request(rid)
    written = {"a": 0, "c": 0}
    for turn in range(4):
        rows = [("a", Pos(3, written["a"], 0), steps), ("c", Pos(4, written["c"], 1), 1 + turn % steps)]
        step, ctx = declare(rows, padding=1)
        step = dataclasses.replace(step, steps=steps)
        twin = dataclasses.replace(step)  # another object: the manager reads it row by row
        if position_columns:
            step = _as_columns(step, ["a", "c"])
            assert type(step.positions) is PositionColumns
        assert fast.admit(step, ctx) == ADMIT_OK
        assert slow.admit(twin, ctx) == ADMIT_OK
        assert fast._columns is not None
        assert fast._columns.step is step
        # Claimed alike by both paths, from sources of two lengths: two retention policies.
        for rid, (source, length) in {"a": (0, 3), "c": (1, 4)}.items():
            claimed = [
                (r.slot, r.source, r.source_len, r.policy) for r in (fast._requests[rid], slow._requests[rid])
            ]
            assert claimed[0] == claimed[1] == (claimed[1][0], source, length, CFG.retention_for(length))
        plans = fast.plan(step, ctx), slow.plan(twin, ctx)
        slow._columns = None  # plan the twin of an admitted step row by row too
        np.testing.assert_array_equal(plans[0].table, slow.plan(twin, ctx).table)
        np.testing.assert_array_equal(plans[0].table, plans[1].table)
        fast.commit(step, ctx)
        slow.commit(twin, ctx)
        for rid, _, span in rows:
            written[rid] += span
            assert fast.written(rid) == slow.written(rid) == written[rid]
        assert fast.placed == slow.placed


def test_a_request_removed_after_admission_is_not_planned_from_stale_columns(manager):
    manager.ingest_request("a")
    step, ctx = declare([("a", Pos(3, 0, 0), 1)])
    assert manager.admit(step, ctx) == ADMIT_OK
    manager.remove_request("a")
    with pytest.raises(UnknownRequestError, match="'a' was never ingested"):
        manager.plan(step, ctx)


def test_gather_leaves_a_step_with_a_value_beyond_int64_to_the_rows(manager):
    manager.ingest_request("a")
    step, ctx = declare([("a", Pos(3, 2**70, 0), 1)])
    assert cols.gather(step, ctx, manager._requests) is None
    outcome = manager.admit(step, ctx)
    assert not outcome.ok
    assert f"declares {2**70} written tokens; 0 were committed" in outcome.reason.message


def test_columns_read_the_declared_step_tokens_and_their_defaults(manager):
    for rid in ("a", "c"):
        manager.ingest_request(rid)
    step = BoundedKVStep(
        declare([("a", Pos(3, 0, 0), 2), ("c", Pos(4, 0, 1), 0)])[0].segments,
        positions={"a": Pos(3, 0, 0), "c": Pos(4, 0, 1)},
        step_tokens={"a": 2},
    )
    _, ctx = declare([("a", Pos(3, 0, 0), 2), ("c", Pos(4, 0, 1), 0)])
    columns = cols.gather(step, ctx, manager._requests)
    assert columns.step_tokens.tolist() == [2, 1]  # c brings max(span, 1)
    assert columns.request_ids == ["a", "c"]


def test_position_columns_are_the_mapping_they_stand_for():
    positions = PositionColumns(["a", "c"], np.array([[3, 2, 0], [4, 0, 1]], np.int32))
    assert positions == {"a": Pos(3, 2, 0), "c": Pos(4, 0, 1)}
    assert list(positions) == ["a", "c"]
    assert len(positions) == 2
    assert "c" in positions
    assert "b" not in positions
    assert type(positions["c"]) is Pos
    assert all(type(v) is int for v in positions["c"])
    assert positions.written.dtype == np.int64
    with pytest.raises(KeyError):
        positions["b"]
    step = BoundedKVStep(declare([("a", None, 1), ("c", None, 1)])[0].segments, positions=positions)
    assert step.positions is positions  # kept as columns, not copied into a dict
    assert PositionColumns([], []) == {}


@pytest.mark.parametrize(
    ("ids", "table", "error", "match"),
    [
        (["a"], [[3.0, 2.0, 0.0]], TypeError, "table must hold ints .* got dtype float64"),
        (["a"], [[3, float("nan"), 0]], TypeError, "got dtype float64"),
        (["a"], [["3", "2", "0"]], TypeError, "got dtype <U1"),
        (["a", "c"], [[3, 2, 0]], ValueError, r"table.shape=\(1, 3\); it must be \[2, 3\]"),
        (["a"], [[3, 2]], ValueError, r"table.shape=\(1, 2\); it must be \[1, 3\]"),
        (["a"], [], ValueError, r"table.shape=\(0,\); it must be \[1, 3\]"),
        (["a", "a"], [[3, 2, 0], [3, 2, 0]], ValueError, "names a request twice"),
    ],
)
def test_position_columns_refuse_a_bad_table(ids, table, error, match):
    with pytest.raises(error, match=match):
        PositionColumns(ids, table)


# -- the persistent batch (`CommittedRows`) ----------------------------------------------------------

REQUESTS = {"a": (3, 0), "b": (4, 1), "c": (2, 0)}  # each request's (source_len, source)


def _history_step(rng, last: list[str], live: list[str], written: dict, steps: int, started: set[str]):
    """A step over `live` requests: mostly the last step's rows again (the persistent batch's case), with
    a `started` request's position broken now and then; returns (rows, broken)."""
    if last and set(last) <= set(live) and rng.random() < 0.7:
        ids = list(last)
    else:
        ids = list(rng.permutation(live)[: int(rng.integers(1, len(live) + 1))])
    rows, broken = [], False
    for rid in ids:
        source_len, source = REQUESTS[rid]
        position = [source_len, written[rid], source]
        if rid in started and rng.random() < 0.08:  # another source length, count or source than it had
            field = int(rng.integers(3))
            position[field] += 1
            broken = True
        rows.append((rid, Pos(*position), int(rng.integers(0 if steps == 1 else 1, steps + 1))))
    return rows, broken


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("seed", range(12))
def test_the_persistent_batch_admits_plans_and_commits_as_row_by_row(seed, steps):
    """A random history of steps (the same rows again, most often), broken positions, removals, resets,
    offloads and reloads: the manager that reads repeated rows from the persistent batch refuses, plans
    and commits exactly as one that takes every step row by row, and as a brute-force count of writes."""
    rng = np.random.default_rng(seed)
    fast, slow = new_manager(), new_manager()
    written, live, last, reused = {}, [], [], 0
    for _ in range(60):
        op = rng.random()
        idle = [rid for rid in REQUESTS if rid not in live]
        if idle and (not live or op < 0.1):  # a new request (or one removed before, afresh)
            rid = idle[int(rng.integers(len(idle)))]
            for manager in (fast, slow):
                manager.ingest_request(rid)
            live.append(rid)
            written[rid] = 0
            continue
        if op < 0.15 and live:
            rid = live.pop(int(rng.integers(len(live))))
            for manager in (fast, slow):
                manager.remove_request(rid)
            continue
        if op < 0.2:
            rid = live[int(rng.integers(len(live)))]
            for manager in (fast, slow):
                manager.reset_request(rid)
            written[rid] = 0
            continue
        if op < 0.25:
            rid = live[int(rng.integers(len(live)))]
            if fast.slot_of(rid) is not None:
                assert fast.offload(rid) == slow.offload(rid)
            elif fast.is_offloaded(rid):
                assert fast.reload(rid) == slow.reload(rid)
            continue
        started = {rid for rid in live if slow._requests[rid].source_len is not None}
        rows, broken = _history_step(rng, last, live, written, steps, started)
        step, ctx = declare(rows, padding=int(rng.integers(2)))
        step = dataclasses.replace(step, steps=steps)
        ids = [rid for rid, _, _ in rows]
        step = dataclasses.replace(step, positions=PositionColumns(ids, [tuple(p) for _, p, _ in rows]))
        twin = dataclasses.replace(step)
        outcomes = fast.admit(step, ctx), slow.admit(twin, ctx)
        assert outcomes[0] == outcomes[1]
        if broken:
            assert not outcomes[0].ok
        if not outcomes[0].ok:
            continue
        reused += fast._columns is not None and fast._columns.committed is not None
        slow._columns = None  # the oracle plans and commits row by row
        np.testing.assert_array_equal(fast.plan(step, ctx).table, slow.plan(twin, ctx).table)
        fast.commit(step, ctx)
        slow.commit(twin, ctx)
        assert slow._committed is None
        last = ids
        for rid, _, span in rows:
            written[rid] += span
        for rid in live:
            if not slow.is_offloaded(rid):
                assert fast.written(rid) == slow.written(rid) == written[rid]
        assert fast.placed == slow.placed
        assert fast.free_slots == slow.free_slots
    assert reused >= 3  # the persistent batch was read, not only built


def test_the_persistent_batch_refuses_a_request_declaring_another_source(manager):
    """A request of the persistent batch declaring a source other than the one it started on is refused,
    with the row-by-row message, and nothing changes."""
    for rid in ("a", "b"):
        manager.ingest_request(rid)

    def step(a_position):
        entries = [("a", a_position, 1), ("b", Pos(4, 1, 1), 1)]
        plain, ctx = declare(entries)
        positions = PositionColumns(["a", "b"], [tuple(a_position), (4, 1, 1)])
        return dataclasses.replace(plain, positions=positions), ctx

    first, ctx = declare([("a", Pos(3, 0, 0), 1), ("b", Pos(4, 0, 1), 1)])
    first = dataclasses.replace(first, positions=PositionColumns(["a", "b"], [(3, 0, 0), (4, 0, 1)]))
    assert manager.admit(first, ctx) == ADMIT_OK
    manager.plan(first, ctx)
    manager.commit(first, ctx)
    assert manager._committed is not None
    for position, message in (
        (Pos(3, 1, 1), "declares source 1 of length 3, but its stream started on source 0 of length 3"),
        (Pos(2, 1, 0), "declares source 0 of length 2, but its stream started on source 0 of length 3"),
        (Pos(3, 2, 0), "declares 2 written tokens; 1 were committed"),
    ):
        bad, ctx = step(position)
        outcome = manager.admit(bad, ctx)
        assert not outcome.ok
        assert message in outcome.reason.message
        assert manager.written("a") == manager.written("b") == 1
    good, ctx = step(Pos(3, 1, 0))
    assert manager.admit(good, ctx) == ADMIT_OK
    assert manager._columns.committed is not None  # read from the persistent batch
    manager.plan(good, ctx)
    manager.commit(good, ctx)
    assert manager.written("a") == manager.written("b") == 2


def test_a_step_admitted_as_columns_commits_row_by_row_from_another_step_object(manager):
    """`RequestRecord.admitted` of a columns admission is its row of the columns (`columns.pending`): a
    commit of another object with the same rows finds it, and one with other rows is refused."""
    manager.ingest_request("a")
    step, ctx = declare([("a", Pos(3, 0, 0), 2)])
    assert manager.admit(step, ctx) == ADMIT_OK
    assert cols.pending("a", manager._requests["a"]) == (Pos(3, 0, 0), 2)
    other, _ = declare([("a", Pos(3, 0, 0), 1)])
    with pytest.raises(
        StepNotAdmittedError, match=r"admit accepted \(source=0, source_len=3, written=0, span=2\)"
    ):
        manager.commit(other, ctx)
    manager.commit(dataclasses.replace(step), ctx)
    assert manager.written("a") == 2
    assert cols.pending("a", manager._requests["a"]) is None
