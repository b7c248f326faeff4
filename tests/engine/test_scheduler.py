"""Batch formation against a plain loop that applies the scheduler's rules as its docstrings state them.

`talker_rows` and `flow_rows` are tuned loops (inline tests, early caps); the oracle visits every stream
and caps at the end. Random states cover every phase, pauses, holds at and after the clock, codes in
flight, and feeds from the step in flight and from an older one.
"""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.models.streaming_tts.request import Stream, TTSRequest
from mstar_jax.models.streaming_tts.scheduler import FlowRow, TalkerRow, flow_rows, talker_rows
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase

NOW, BOS, TEXT_VOCAB, IN_FLIGHT = 10.0, 3, 100, 7


def _random_stream(rng: np.random.Generator, rid: str, in_flight: int | None) -> Stream:
    """A stream in a state an engine reaches: a decoding one's newest code is read, or on the device in
    the step in flight (`in_flight`)."""
    frames = int(rng.integers(1, 12))
    text = tuple(int(t) for t in rng.integers(0, 50, rng.integers(1, 9)))
    stream = Stream(TTSRequest(rid, text, Voice(int(rng.integers(3)), int(rng.integers(1, 5))), frames))
    phases = [Phase.WAITING, PREFILL, DECODE, FLUSH, Phase.DONE, Phase.CANCELLED]
    stream.phase = phases[rng.integers(len(phases))]
    stream.paused = bool(rng.random() < 0.15)
    stream.hold_until = NOW + 1 if rng.random() < 0.15 else float(rng.integers(0, NOW + 1))  # NOW: runs
    if stream.phase in (Phase.WAITING, PREFILL):
        stream.prefilled = int(rng.integers(0, stream.prompt_len))
    else:
        stream.prefilled = stream.prompt_len
        stream.codes.extend(rng.integers(0, 64, rng.integers(in_flight is None, frames + 1)).tolist())
        stream.codes_in_flight = int(rng.integers(0, frames - len(stream.codes) + 1))
        if not stream.codes:  # its first code is on the device
            stream.feed = (IN_FLIGHT, int(rng.integers(64)))
        elif rng.random() < 0.5:  # a code fed by the step in flight, or by one since read
            stream.feed = (IN_FLIGHT if rng.random() < 0.8 else IN_FLIGHT - 1, int(rng.integers(64)))
    stream.flow_written = int(rng.integers(0, len(stream.codes) + 1))
    return stream


def _oracle_talker(streams, *, max_batch, prefill_tokens, prefill_room, in_flight, decode_steps):
    decode, prefill = [], []
    for s in streams:
        if s.phase in (FLUSH, Phase.DONE, Phase.FAILED, Phase.CANCELLED) or s.paused or s.hold_until > NOW:
            continue
        if len(s.codes) >= s.request.frames:
            continue
        if s.phase is DECODE:
            steps = min(decode_steps, s.request.frames - len(s.codes) - s.codes_in_flight)
            if s.feed is not None and s.feed[0] == in_flight:
                decode.append(TalkerRow(s, (TEXT_VOCAB,), True, s.feed[1], steps))
            else:
                decode.append(TalkerRow(s, (TEXT_VOCAB + s.codes[-1],), True, -1, steps))
        else:
            prompt = (*s.request.text, BOS)
            prefill.append(TalkerRow(s, prompt[s.prefilled : s.prefilled + prefill_tokens], False))
    decode, prefill = decode[:max_batch], prefill[:max_batch]
    room = max_batch - len(decode)
    return decode, prefill[: min(room, prefill_room) if decode else room]


def _oracle_flow(streams, *, max_batch, chunk):
    rows = []
    for s in streams:
        if s.phase.finished or s.paused or s.hold_until > NOW:
            continue
        ready = len(s.codes) - s.flow_written
        if ready >= chunk or (ready > 0 and len(s.codes) >= s.request.frames):
            first = s.flow_written
            rows.append(FlowRow(s, first, tuple(s.codes[first : first + min(chunk, ready)])))
    return rows[:max_batch]


@pytest.mark.parametrize("seed", range(12))
def test_rows_equal_a_plain_loop_over_the_streams(seed):
    rng = np.random.default_rng(seed)
    in_flight = IN_FLIGHT if rng.random() < 0.7 else None
    live = [_random_stream(rng, f"r{i}", in_flight) for i in range(int(rng.integers(1, 80)))]
    for max_batch, room, steps in [(1, 0, 1), (4, 2, 8), (16, 16, 4), (64, 5, 32), (3, 0, 1)]:
        settings = {"max_batch": max_batch, "prefill_tokens": int(rng.integers(1, 6)), "prefill_room": room}
        expected = _oracle_talker(live, in_flight=in_flight, decode_steps=steps, **settings)
        got = talker_rows(
            live,
            now=NOW,
            bos=BOS,
            text_vocab=TEXT_VOCAB,
            in_flight=in_flight,
            decode_steps=steps,
            **settings,
        )
        assert got == expected
        for row in got[0] + got[1]:  # Python ints, as the batch builders expect
            assert all(type(v) is int for v in (*row.tokens, row.feed, row.steps))
        chunk = int(rng.integers(1, 6))
        assert flow_rows(live, now=NOW, max_batch=max_batch, chunk=chunk) == _oracle_flow(
            live, max_batch=max_batch, chunk=chunk
        )


def test_rows_of_no_stream_are_empty():
    assert talker_rows(
        [], now=NOW, max_batch=4, prefill_tokens=4, prefill_room=2, bos=BOS, text_vocab=TEXT_VOCAB
    ) == ([], [])
    assert flow_rows([], now=NOW, max_batch=4, chunk=8) == []
