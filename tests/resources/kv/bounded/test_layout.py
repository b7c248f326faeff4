"""Host layout of the bounded KV cache: hand-computed rows, a brute-force stream simulation, properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.sink_window_attention import reference
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.resources.kv.bounded import layout

POISON = -1


def _plan(*, reverse=False, sink_capacity=0, slot=0, source=0, step_tokens=None, inc=False, **row):
    """One request's table row from scalars."""
    return layout.plan_table(
        slot=[slot],
        source=[source],
        step_tokens=[row["span"] if step_tokens is None else step_tokens],
        window_includes_step=[inc],
        sink_capacity=sink_capacity,
        reverse=reverse,
        **{name: [value] for name, value in row.items()},
    )[0]


def _reads(row):
    return [(int(row[tbl.read_start(i)]), int(row[tbl.read_len(i)])) for i in range(tbl.NUM_READS)]


def _writes(row):
    return [tuple(int(row[c]) for c in tbl.write_cols(i)) for i in range(tbl.NUM_WRITES)]


# --- hand-computed rows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("calls", "reads", "writes"),
    [
        # n = 302: lo = max(100, 302 - 302) = 100; source sink (0, 100), window in the source (100, 202).
        # Write [302, 352): ring slot (302 - 100) % 302 = 202; reversed, position 302 holds token 49.
        (0, [(0, 100), (0, 0), (100, 202), (0, 0), (0, 0)], [(0, 0, 0), (49, 202, 50), (0, 0, 0)]),
        # n = 352: the ring holds [302, 352) at 202..251; the write goes on at 252.
        (1, [(0, 100), (0, 0), (100, 202), (202, 50), (0, 0)], [(0, 0, 0), (49, 252, 50), (0, 0, 0)]),
        # n = 402: the ring holds 100 entries, up to its end (302); the write wraps to (402 - 100) % 302 = 0.
        (2, [(0, 100), (0, 0), (100, 202), (202, 100), (0, 0)], [(0, 0, 0), (49, 0, 50), (0, 0, 0)]),
        # n = 452: lo = 452 - 302 = 150, so the source part shrinks to (150, 152); the ring read wraps:
        # [302, 402) at 202..301, then [402, 452) at 0..49.
        (3, [(0, 100), (0, 0), (150, 152), (202, 100), (0, 50)], [(0, 0, 0), (49, 50, 50), (0, 0, 0)]),
    ],
)
def test_dit_rows(calls, reads, writes):
    # Token2wav DiT (facts §4.3): P = 151, source 2P = 302, sink 100, window 302, reversed, span 50.
    row = _plan(source_len=302, written=50 * calls, span=50, sink=100, window=302, reverse=True)
    assert _reads(row) == reads
    assert _writes(row) == writes
    assert row[tbl.STREAM_LEN] == 302 + 50 * calls
    assert row[tbl.SINK_KEPT] == 100
    assert row[tbl.WINDOW_START] == max(100, 302 + 50 * calls - 302)


@pytest.mark.parametrize(
    ("calls", "ring_reads", "write_slot"),
    [
        (0, [(0, 0), (0, 0)], 0),  # n = 302: nothing written yet; write [302, 352) at ring slot 0
        (1, [(0, 50), (0, 0)], 50),  # n = 352: read [302, 352); write at (352 - 302) % 100 = 50
        (2, [(0, 100), (0, 0)], 0),  # n = 402: the full ring; write wraps to 0
        (3, [(50, 50), (0, 50)], 50),  # n = 452: window [352, 452) starts at slot 50 and wraps
    ],
)
def test_enc2_rows(calls, ring_reads, write_slot):
    # enc2: source 302, sink 302 (the whole source), window 100, span 50.
    row = _plan(source_len=302, written=50 * calls, span=50, sink=302, window=100)
    assert _reads(row) == [(0, 302), (0, 0), (0, 0), *ring_reads]
    assert _writes(row) == [(0, 0, 0), (0, write_slot, 50), (0, 0, 0)]


@pytest.mark.parametrize(
    ("calls", "sink_read", "sink_write"),
    [
        (0, (0, 0), (0, 0, 25)),  # n = 151: write [151, 176) at offsets 0..24
        (1, (0, 25), (0, 25, 25)),  # n = 176: read 25 written sink entries; write [176, 201) at 25
        (2, (0, 50), (0, 0, 0)),  # n = 201 = sink: the sink is full and the window is 0: no write
        (5, (0, 50), (0, 0, 0)),
    ],
)
def test_enc1_rows(calls, sink_read, sink_write):
    # enc1: source P = 151, sink P + 50 = 201, window 0, sink capacity 50, span 25.
    row = _plan(source_len=151, written=25 * calls, span=25, sink=201, window=0, sink_capacity=50)
    assert _reads(row) == [(0, 151), sink_read, (0, 0), (0, 0), (0, 0)]
    assert _writes(row) == [sink_write, (0, 0, 0), (0, 0, 0)]


def test_module_docstring_ring():
    # sink 2, source 0, window 5, sink capacity 2, n = 13: the window is 8..12, 8 at 2 + (8 - 2) % 5 = 3.
    row = _plan(source_len=0, written=13, span=2, sink=2, window=5, sink_capacity=2)
    assert _reads(row) == [(0, 0), (0, 2), (0, 0), (3, 4), (2, 1)]
    # Write [13, 15) at 2 + (13 - 2) % 5 = 3, evicting 8 and 9.
    assert _writes(row) == [(0, 0, 0), (0, 3, 2), (0, 0, 0)]


def test_window_includes_step_reads_window_minus_span():
    # Waypoint-style ring: sink 0, window 8 counting the step. n = 20, span 3: read the newest 5, [15, 20),
    # at (15 % 8, ...) = 7 then wrap: (7, 1), (0, 4). The write [20, 23) lands at 4..6.
    row = _plan(source_len=0, written=20, span=3, sink=0, window=8, inc=True)
    assert _reads(row) == [(0, 0), (0, 0), (0, 0), (7, 1), (0, 4)]
    assert row[tbl.WINDOW_START] == 15
    assert _writes(row) == [(0, 0, 0), (0, 4, 3), (0, 0, 0)]
    # A span wider than the window reads nothing but the sink and keeps only the last 8 new entries:
    # [22, 30) of [20, 30), the first at 22 % 8 = 6; token 2 onwards.
    row = _plan(source_len=0, written=20, span=10, sink=0, window=8, inc=True)
    assert _reads(row) == [(0, 0)] * 5
    assert _writes(row) == [(0, 0, 0), (2, 6, 2), (4, 0, 6)]


def test_write_straddling_sink_and_ring_reversed():
    # source 2, sink 5, window 4, capacity 3, n = 3, span 6 (tokens 0..5 join as 5, 4, ..., 0):
    # [3, 5) into the sink at offsets 1..2 starting with token 5; [5, 9) into the ring at 3 + 0,
    # starting with token 3.
    row = _plan(source_len=2, written=1, span=6, sink=5, window=4, sink_capacity=3, reverse=True)
    assert _writes(row) == [(5, 1, 2), (3, 3, 4), (0, 0, 0)]
    assert _reads(row) == [(0, 2), (0, 1), (0, 0), (0, 0), (0, 0)]


def test_padding_rows_are_empty():
    rows = layout.padding_rows(3, padding_slot=7)
    assert rows.shape == (3, tbl.ROW_INTS)
    assert rows.dtype == np.int32
    assert (rows[:, tbl.SLOT] == 7).all()
    assert not rows[:, tbl.SOURCE :].any()
    rows[0, 0] = 1  # writable: the manager fills real rows in place
    assert layout.padding_rows(0, 0).shape == (0, tbl.ROW_INTS)


def test_slot_offsets_and_retained_positions():
    # source 2, sink 5, window 4, capacity 3: positions 2..4 at 0..2; 5 at 3 + 0; 10 at 3 + (10 - 5) % 4 = 4.
    offsets = layout.slot_offsets([2, 4, 5, 8, 9, 10], source_len=2, sink=5, window=4, sink_capacity=3)
    np.testing.assert_array_equal(offsets, [0, 2, 3, 6, 3, 4])
    # Window 0: nothing past the sink is stored.
    offsets = layout.slot_offsets([3, 6], source_len=2, sink=5, window=0, sink_capacity=3)
    np.testing.assert_array_equal(offsets, [1, layout.NOT_STORED])
    # n = 12: [0, 5) ∪ [max(5, 12 - 4), 12) = 0..4, 8..11; counting a span of 3 in the window: 11 only.
    kw = {"source_len": 2, "written": 10, "sink": 5, "window": 4}
    np.testing.assert_array_equal(
        layout.retained_positions(span=3, window_includes_step=False, **kw), [0, 1, 2, 3, 4, 8, 9, 10, 11]
    )
    np.testing.assert_array_equal(
        layout.retained_positions(span=3, window_includes_step=True, **kw), [0, 1, 2, 3, 4, 11]
    )


# --- errors -----------------------------------------------------------------------------------------------

GOOD = {
    "slot": [0, 1],
    "source": [0, 0],
    "source_len": [4, 4],
    "written": [3, 3],
    "span": [2, 2],
    "step_tokens": [2, 4],
    "sink": [6, 6],
    "window": [8, 8],
    "window_includes_step": [False, True],
    "sink_capacity": 2,
    "reverse": False,
}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"written": [3, -1]}, ValueError, r"written\[1\]=-1 must be >= 0"),
        ({"span": [3, 2]}, ValueError, r"span\[0\]=3 exceeds step_tokens\[0\]=2"),
        ({"sink": [6, 7]}, ValueError, r"row 1: sink\[1\]=7 .* sink_capacity=2"),
        ({"sink_capacity": -1}, ValueError, "sink_capacity=-1"),
        ({"slot_tokens": 9}, ValueError, r"window\[0\]=8 exceeds slot_tokens=9"),
        ({"written": [2**31 - 4, 0]}, ValueError, "row 0: .*int32"),
        ({"slot": [0, 1, 2]}, ValueError, "lengths {'slot': 3, 'source': 2"),
        ({"source": [[0], [0]]}, ValueError, "source must be a scalar or 1-D"),
        ({"window": [8.0, 8.0]}, TypeError, "window must hold integers"),
    ],
)
def test_plan_table_refuses_bad_rows(change, error, match):
    layout.plan_table(**GOOD)
    with pytest.raises(error, match=match):
        layout.plan_table(**{**GOOD, **change})


def test_other_errors():
    with pytest.raises(ValueError, match="count=-1"):
        layout.padding_rows(-1, 0)
    with pytest.raises(ValueError, match="padding_slot=-2"):
        layout.padding_rows(1, -2)
    with pytest.raises(ValueError, match=r"positions\[1\]=1 is below source_len\[1\]=2"):
        layout.slot_offsets([2, 1], source_len=2, sink=5, window=4, sink_capacity=3)
    with pytest.raises(ValueError, match="sink_capacity=2"):
        layout.slot_offsets([2], source_len=2, sink=5, window=4, sink_capacity=2)
    with pytest.raises(ValueError, match="span=-1"):
        layout.retained_positions(
            source_len=0, written=0, span=-1, sink=0, window=0, window_includes_step=False
        )


def test_scalars_broadcast_over_the_batch():
    rows = layout.plan_table(**{**GOOD, "sink": 6, "window": 8, "source": 1})
    np.testing.assert_array_equal(rows, layout.plan_table(**{**GOOD, "source": [1, 1]}))


# --- brute-force stream simulation --------------------------------------------------------------------------


def _expected_retained(n, sink, window, span, includes_step):
    """R by definition, one position at a time: the first `sink` and the newest W before the step."""
    w = max(0, window - span) if includes_step else window
    return [i for i in range(n) if i < sink or i >= n - w]


def _simulate(seed, reverse, streams=3, steps=24):
    """Runs `streams` requests side by side for `steps` steps, checking every read and write."""
    rng = np.random.default_rng(seed)
    source_len = rng.integers(0, 40, streams)
    sink = rng.integers(0, 50, streams) * (seed % 5 != 0)  # every 5th seed: sink 0
    window = rng.integers(0, 30, streams) * (seed % 7 != 1)  # window 0
    if seed % 3 == 2:
        window = rng.integers(1, 4, streams)  # windows of 1..3: a wrap nearly every step
    includes_step = rng.random(streams) < 0.5
    bucket = int(rng.integers(1, 20))
    sink_capacity = int(max(0, (sink - source_len).max()) + rng.integers(0, 3))
    own_tokens = sink_capacity + window  # each row's part of its slot
    slot_tokens = int(own_tokens.max()) + 1
    # Token ids: source position i of stream b is 1000 * b + i, written entries count up from 10**6.
    source = np.full((streams, 1, 1, 40, 1), POISON, np.float64)
    cache = np.full((streams, 1, 1, slot_tokens, 1), POISON, np.float64)
    stream = []
    for b in range(streams):
        source[b, 0, 0, : source_len[b], 0] = 1000 * b + np.arange(source_len[b])
        stream.append(list(1000 * b + np.arange(source_len[b])))
    written, next_id = np.zeros(streams, np.int64), 10**6
    for _ in range(steps):
        span = rng.integers(0, bucket + 1, streams)
        step_tokens = rng.integers(span, bucket + 1)
        rows = layout.plan_table(
            slot=np.arange(streams),
            source=np.arange(streams),
            source_len=source_len,
            written=written,
            span=span,
            step_tokens=step_tokens,
            sink=sink,
            window=window,
            window_includes_step=includes_step,
            sink_capacity=sink_capacity,
            reverse=reverse,
            slot_tokens=slot_tokens,
        )
        for b, row in enumerate(rows):
            n = int(source_len[b] + written[b])
            want = _expected_retained(n, sink[b], window[b], span[b], includes_step[b])
            ids, positions = reference.retained_keys_reference(row, cache, source, 0)
            assert POISON not in ids, "read an entry this stream never wrote"
            assert ids[0, :, 0].tolist() == [stream[b][i] for i in want]
            assert positions.tolist() == want
            assert row[tbl.STEP_TOKENS] == step_tokens[b]

            token_ids = next_id + np.arange(step_tokens[b])
            next_id += step_tokens[b]
            order = token_ids[: span[b]][::-1] if reverse else token_ids[: span[b]]
            stream[b].extend(order.tolist())
            for step_offset, slot_start, length in _writes(row):
                tokens = step_offset - np.arange(length) if reverse else step_offset + np.arange(length)
                assert ((tokens >= 0) & (tokens < span[b])).all()
                assert slot_start >= 0
                assert slot_start + length <= own_tokens[b]
                cache[b, 0, 0, slot_start : slot_start + length, 0] = token_ids[tokens]
            written[b] += span[b]

            # Storage invariant: every entry retained after the step sits where slot_offsets says.
            n = int(source_len[b] + written[b])
            kept = [i for i in _expected_retained(n, sink[b], window[b], 0, False) if i >= source_len[b]]
            offsets = layout.slot_offsets(
                kept, source_len=source_len[b], sink=sink[b], window=window[b], sink_capacity=sink_capacity
            )
            assert cache[b, 0, 0, offsets, 0].tolist() == [stream[b][i] for i in kept]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("seed", range(30))
def test_layout_against_brute_force_stream(seed, reverse):
    _simulate(seed, reverse)


# --- properties ---------------------------------------------------------------------------------------------


@st.composite
def _rows(draw):
    span = draw(st.integers(0, 20))
    source_len, sink = draw(st.integers(0, 60)), draw(st.integers(0, 60))
    return {
        "slot": draw(st.integers(0, 9)),
        "source": draw(st.integers(0, 3)),
        "source_len": source_len,
        "written": draw(st.integers(0, 400)),
        "span": span,
        "step_tokens": span + draw(st.integers(0, 4)),
        "sink": sink,
        "window": draw(st.integers(0, 40)),
        "window_includes_step": draw(st.booleans()),
        "sink_capacity": max(0, sink - source_len) + draw(st.integers(0, 3)),
    }


def _one(row, reverse):
    return layout.plan_table(
        **{name: [value] for name, value in row.items() if name != "sink_capacity"},
        sink_capacity=row["sink_capacity"],
        reverse=reverse,
    )[0]


@settings(max_examples=200, deadline=None)
@given(_rows(), st.booleans())
def test_reads_are_the_retained_positions(row, reverse):
    table_row = _one(row, reverse)
    s, source_len, cap = row["sink"], row["source_len"], row["sink_capacity"]
    n = source_len + row["written"]
    want = _expected_retained(n, s, row["window"], row["span"], row["window_includes_step"])
    reads = _reads(table_row)
    assert all(start == 0 for start, length in reads if length == 0)
    source_read = [p for i in (0, 2) for p in range(reads[i][0], sum(reads[i]))]
    slot_read = [o for i in (1, 3, 4) for o in range(reads[i][0], sum(reads[i]))]
    assert source_read == [p for p in want if p < source_len]
    in_slot = [p for p in want if p >= source_len]
    offsets = layout.slot_offsets(
        in_slot, source_len=source_len, sink=s, window=row["window"], sink_capacity=cap
    )
    assert slot_read == offsets.tolist()
    assert all(0 <= o < cap + row["window"] for o in slot_read)
    assert len(set(slot_read)) == len(slot_read)
    # The head columns describe the same positions: key j sits at j below SINK_KEPT, else after WINDOW_START.
    kept, start = table_row[tbl.SINK_KEPT], table_row[tbl.WINDOW_START]
    assert [j if j < kept else start + j - kept for j in range(len(want))] == want


@settings(max_examples=200, deadline=None)
@given(_rows(), st.booleans())
def test_writes_store_exactly_the_surviving_entries(row, reverse):
    table_row = _one(row, reverse)
    s, w, span = row["sink"], row["window"], row["span"]
    n = row["source_len"] + row["written"]
    stored = {}
    for step_offset, slot_start, length in _writes(table_row):
        if length == 0:
            assert step_offset == slot_start == 0
        for t in range(length):
            assert slot_start + t not in stored, "two writes to one slot entry"
            stored[slot_start + t] = step_offset - t if reverse else step_offset + t
    # New position p survives the step if it is in the sink or among the newest `window` entries.
    survivors = [p for p in range(n, n + span) if p < s or (w > 0 and p >= n + span - w)]
    offsets = layout.slot_offsets(
        survivors, source_len=row["source_len"], sink=s, window=w, sink_capacity=row["sink_capacity"]
    )
    token = (lambda p: n + span - 1 - p) if reverse else (lambda p: p - n)
    assert stored == {int(o): token(p) for o, p in zip(offsets, survivors, strict=True)}
    assert all(0 <= o < row["sink_capacity"] + w for o in stored)


@settings(max_examples=80, deadline=None)
@given(st.lists(_rows(), min_size=1, max_size=8), st.booleans())
def test_batch_rows_are_planned_independently(rows, reverse):
    cap = max(row["sink_capacity"] for row in rows)
    rows = [{**row, "sink_capacity": cap} for row in rows]
    batch = layout.plan_table(
        **{name: [row[name] for row in rows] for name in rows[0] if name != "sink_capacity"},
        sink_capacity=cap,
        reverse=reverse,
    )
    np.testing.assert_array_equal(batch, np.stack([_one(row, reverse) for row in rows]))
