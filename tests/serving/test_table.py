"""`StreamTable` and `Column`: a stream's hot fields in slot-indexed arrays while it is served.

The oracle is the same streams' fields kept on plain Python objects, driven by the same random operations.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase, Stream
from mstar_jax.serving.table import Column, StreamTable, slots_of


@dataclasses.dataclass(frozen=True)
class _Request:
    request_id: str


@dataclasses.dataclass(eq=False)
class _CountingStream(Stream):
    written: int = Column(np.int64, 0)
    level: float = Column(np.float32, 0.5)
    label: str = "plain"  # not a column: stays on the object


def _stream(rid: str, **fields) -> _CountingStream:
    return _CountingStream(_Request(rid), **fields)


def test_phase_codes_follow_declaration_order_and_finished_phases_sort_last():
    assert [phase.code for phase in Phase] == list(range(len(Phase)))
    assert all(Phase.of_code(phase.code) is phase for phase in Phase)
    assert PREFILL.code < DECODE.code < FLUSH.code < Phase.DONE.code
    assert {phase for phase in Phase if phase.code >= Phase.DONE.code} == {p for p in Phase if p.finished}


def test_a_stream_never_attached_keeps_its_fields_on_the_object():
    stream = _stream("a", written=3)
    assert (stream.written, stream.level, stream.phase, stream.paused) == (3, 0.5, Phase.WAITING, False)
    stream.phase, stream.faults = DECODE, 2
    assert (stream.__dict__["phase"], stream.__dict__["faults"]) == (DECODE, 2)
    assert slots_of([stream]).tolist() == [-1]
    assert vars(_stream("b"))["written"] == 0  # the dataclass's __init__ sets the default on the object


def test_attach_moves_the_fields_into_the_arrays_and_detach_moves_them_back():
    table = StreamTable(_CountingStream, capacity=2)
    stream = _stream("a", written=7, paused=True)
    stream.phase = PREFILL
    slot = table.attach(stream)
    assert (slot, table.streams[0], len(table)) == (0, stream, 1)
    assert not {"written", "paused", "phase"} & set(vars(stream))  # the table holds them now
    assert (table["written"][0], table["paused"][0], table["phase"][0]) == (7, True, PREFILL.code)
    # Reads and writes through the object and through the arrays see one value.
    stream.written += 5
    table["level"][slot] = 0.25
    table["phase"][slot] = FLUSH.code
    assert (stream.written, stream.level, stream.phase) == (12, 0.25, FLUSH)
    assert (type(stream.written), type(stream.level), type(stream.paused)) == (int, float, bool)
    stream.label = "changed"
    assert "label" not in table.columns
    table.detach(stream)
    assert (len(table), table.streams, slots_of([stream]).tolist()) == (0, [None, None], [-1])
    assert (stream.written, stream.level, stream.phase, stream.paused, stream.label) == (
        12, 0.25, FLUSH, True, "changed"
    )  # fmt: skip
    stream.written = 1  # on the object again
    assert (stream.written, table["written"][0]) == (1, 12)
    assert dataclasses.replace(stream, label="x").written == 1  # dataclass machinery still sees the fields


def test_a_freed_slot_is_reused_lowest_first_and_the_table_doubles_when_full():
    table = StreamTable(_CountingStream, capacity=2)
    a, b, c = (_stream(rid, written=i) for i, rid in enumerate("abc"))
    assert [table.attach(s) for s in (a, b, c)] == [0, 1, 2]
    assert {len(table.streams)} | {len(column) for column in table.columns.values()} == {4}
    assert [a.written, b.written, c.written] == [0, 1, 2]  # survived the growth
    table.detach(a)
    d = _stream("d", written=9)
    assert table.attach(d) == 0
    assert table.order().tolist() == [1, 2, 0]  # arrival order, not slot order
    assert slots_of([b, d, a]).tolist() == [1, 0, -1]


def test_attaching_twice_is_refused_and_detaching_elsewhere_changes_nothing():
    table, other = StreamTable(_CountingStream), StreamTable(_CountingStream)
    stream = _stream("twice", written=4)
    table.attach(stream)
    with pytest.raises(ValueError, match=r"stream 'twice' is already in a table, at slot 0"):
        table.attach(stream)
    with pytest.raises(ValueError, match="already in a table"):
        other.attach(stream)
    other.detach(stream)  # not its table
    assert (stream._table, table["written"][0], len(table), len(other)) == (table, 4, 1, 0)
    table.detach(stream)
    table.detach(stream)  # already detached: nothing
    assert (stream.written, len(table)) == (4, 0)


@pytest.mark.parametrize("capacity", [0, -3, 2.0, "8", True, None, math.nan, np.float64(4)])
def test_a_bad_capacity_is_refused_naming_it(capacity):
    with pytest.raises(ValueError, match=re.escape(f"StreamTable capacity={capacity!r} must be an int >= 1")):
        StreamTable(_CountingStream, capacity=capacity)


@pytest.mark.parametrize("seed", range(4))
def test_random_attach_detach_and_writes_match_plain_objects(seed):
    """Every live stream's fields, and the arrival order, equal those of plain objects put through the
    same operations (through the descriptor and through the arrays, across growths)."""
    rng = np.random.default_rng(seed)
    table = StreamTable(_CountingStream, capacity=1)
    live: dict[str, _CountingStream] = {}  # arrival order
    oracle: dict[str, dict] = {}
    names = iter(f"r{i}" for i in range(10_000))
    for _ in range(300):
        op = rng.integers(4)
        if op == 0 or not live:
            rid = next(names)
            written = int(rng.integers(100))
            stream = _stream(rid, written=written)
            stream.phase = Phase.of_code(int(rng.integers(4)))
            oracle[rid] = {"written": written, "level": 0.5, "phase": stream.phase, "paused": False}
            table.attach(stream)
            live[rid] = stream
            continue
        rid = list(live)[rng.integers(len(live))]
        stream = live[rid]
        if op == 1:
            table.detach(stream)
            del live[rid]
            assert {k: getattr(stream, k) for k in oracle[rid]} == oracle[rid]
        elif op == 2:  # through the object
            stream.written += 3
            stream.paused = not stream.paused
            oracle[rid]["written"] += 3
            oracle[rid]["paused"] = not oracle[rid]["paused"]
        else:  # through the arrays, every live stream at once
            slots = slots_of(live.values())
            table["written"][slots] *= 2
            table["phase"][slots] = DECODE.code
            for other in live:
                oracle[other]["written"] *= 2
                oracle[other]["phase"] = DECODE
        order = table.order()
        assert [table.streams[slot].request_id for slot in order.tolist()] == list(live)
        assert not order.flags.writeable
        for other, stream in live.items():
            assert {k: getattr(stream, k) for k in oracle[other]} == oracle[other]
    assert len(table) == len(live)
