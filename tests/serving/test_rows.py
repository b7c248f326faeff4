"""A feeding node's bookkeeping over a `StreamTable` (`serving/rows.py`) against a loop over plain streams.

Each case builds the same random streams twice: once attached to a table, once as plain objects. A step of
random decode and prefill rows is dispatched and read back through `count_dispatched` and `count_read` on
the table, and through the per-row rules (the engine's before the table) on the plain objects; every
stream's fields must then agree.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from mstar_jax.serving.decoder import COUNTERS, DecoderStream
from mstar_jax.serving.rows import DecodeRow, count_dispatched, count_read, decode_rows
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase
from mstar_jax.serving.table import StreamTable

FIELDS = ("phase", "written", "prefilled", "tokens_in_flight", "feed", "last_step_at", "faults", "generated")
SERIAL, NOW = 9, 3.5


@dataclasses.dataclass(frozen=True)
class _Request:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


def _pair(rng: np.random.Generator, rid: str) -> tuple[DecoderStream, DecoderStream]:
    """The same random stream twice: a decoding one (tokens read, some in flight) or one reading its
    prompt."""
    request = _Request(rid, tuple(range(int(rng.integers(1, 9)))), int(rng.integers(2, 12)))
    if rng.random() < 0.6:
        generated = int(rng.integers(1, request.max_new_tokens))
        fields = {
            "phase": DECODE, "prefilled": len(request.prompt), "written": 20, "generated": generated,
            "tokens": rng.integers(0, 99, generated).tolist(),
            "tokens_in_flight": int(rng.integers(0, request.max_new_tokens - generated)),
        }  # fmt: skip
    else:
        fields = {
            "phase": Phase.of_code(int(rng.integers(2))),
            "prefilled": int(rng.integers(len(request.prompt))),
        }
    fields["faults"] = int(rng.integers(3))
    pair = tuple(
        DecoderStream(request, **{**fields, "tokens": list(fields.get("tokens", []))}) for _ in range(2)
    )
    if rng.random() < 0.5:
        feed = (SERIAL - int(rng.integers(2)), int(rng.integers(40)))
        for stream in pair:
            stream.feed = feed
    return pair


def _row(rng: np.random.Generator, stream: DecoderStream, decode_steps: int) -> DecodeRow:
    if stream.phase is DECODE:
        left = stream.request.max_new_tokens - stream.generated - stream.tokens_in_flight
        return DecodeRow(stream, (0,), True, -1, int(rng.integers(1, min(decode_steps, left) + 1)))
    size = int(rng.integers(1, len(stream.request.prompt) - stream.prefilled + 1))
    return DecodeRow(stream, tuple(stream.request.prompt[stream.prefilled :][:size]), False)


def _dispatched_oracle(step, decode_steps: int) -> list[int]:
    emits = []
    for row, index in zip(step.rows, step.indices, strict=True):
        s = row.stream
        s.written += row.span
        s.last_step_at = NOW
        if not row.decode:
            s.prefilled += row.span
            s.phase = PREFILL
        emits.append(row.steps if row.decode else int(s.prefilled == len(s.request.prompt)))
        if emits[-1]:
            s.tokens_in_flight += emits[-1]
            s.feed = (step.serial, index * decode_steps + emits[-1] - 1)
            s.phase = DECODE
        if s.generated + s.tokens_in_flight >= s.request.max_new_tokens:
            s.phase = FLUSH
    return emits


def _read_oracle(step, decode_steps: int) -> list[int]:
    taken = []
    for i, (row, index, emits) in enumerate(zip(step.rows, step.indices, step.emits, strict=True)):
        s = row.stream
        if s.phase.finished or not emits:
            continue
        if s.feed == (step.serial, index * decode_steps + emits - 1):
            s.feed = None
        s.tokens_in_flight -= emits
        s.faults = 0
        taken.append(i)
    return taken


def _fields(stream: DecoderStream) -> dict:
    return {name: getattr(stream, name) for name in FIELDS}


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_dispatch_and_read_back_match_the_per_row_rules(seed, decode_steps):
    rng = np.random.default_rng(seed)
    table = StreamTable(DecoderStream, capacity=2)
    pairs = [_pair(rng, f"r{i}") for i in range(int(rng.integers(1, 30)))]
    for served, _ in pairs:
        served.prompt_len = len(served.request.prompt)
        table.attach(served)
    chosen = rng.permutation(len(pairs))[: int(rng.integers(1, len(pairs) + 1))].tolist()
    indices = rng.permutation(64)[: len(chosen)].tolist()  # rows placed anywhere in the program
    rows = [_row(np.random.default_rng([seed, i]), pairs[i][0], decode_steps) for i in chosen]
    plain_rows = [row._replace(stream=pairs[i][1]) for row, i in zip(rows, chosen, strict=True)]
    node = types.SimpleNamespace(name="node")
    step = types.SimpleNamespace(node=node, serial=SERIAL, rows=rows, indices=indices, emits=())
    plain = types.SimpleNamespace(node=node, serial=SERIAL, rows=plain_rows, indices=indices, emits=())

    step.emits = count_dispatched(table, step, COUNTERS, decode_steps=decode_steps, now=NOW)
    plain.emits = _dispatched_oracle(plain, decode_steps)
    assert step.emits.tolist() == plain.emits
    for served, alone in pairs:
        assert _fields(served) == _fields(alone)

    # Some streams end before the read-back: detached (the engine's way) and finished (the oracle's).
    for i in chosen:
        if rng.random() < 0.25:
            table.detach(pairs[i][0])
            pairs[i][0].phase = pairs[i][1].phase = Phase.CANCELLED
    taken, slots = count_read(table, step, COUNTERS, decode_steps=decode_steps)
    assert [rows[i].stream._slot for i in taken.tolist()] == slots.tolist()
    assert taken.tolist() == _read_oracle(plain, decode_steps)
    for served, alone in pairs:
        assert _fields(served) == _fields(alone)


def test_a_step_with_an_ended_stream_is_not_dispatched():
    table, stream = StreamTable(DecoderStream), _pair(np.random.default_rng(0), "gone")[0]
    step = types.SimpleNamespace(
        node=types.SimpleNamespace(name="talker"), rows=[DecodeRow(stream, (1,), False)]
    )
    with pytest.raises(RuntimeError, match="a talker step was dispatched with a stream that has ended"):
        count_dispatched(table, step, COUNTERS, decode_steps=1, now=0.0)


def test_decode_rows_of_no_slot_are_none():
    table = StreamTable(DecoderStream)
    assert decode_rows(table, np.zeros(0, np.int64), COUNTERS, decode_steps=8, in_flight=None) == []
