"""Batch formation of the TTS model's two nodes against a plain loop that applies their rules as the
docstrings state them.

The talker (`TalkerNode`, a `DecoderNode`) and the flow decoder (`FlowNode`, a `ChunkNode`) form rows in tuned
loops (inline tests, early caps); the oracle visits every stream and caps at the end. Random states
cover every phase, pauses, holds at and after the clock, codes in flight, and feeds from the step in
flight and from an older one, with and without the combined walk, with decode blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.compile import Buckets, BucketSet
from mstar_jax.models.streaming_tts.model import FLOW_CHUNK, TALKER_DECODE, TALKER_MIXED, TALKER_PREFILL
from mstar_jax.models.streaming_tts.nodes import FlowNode, TalkerNode
from mstar_jax.models.streaming_tts.programs import tts_buckets
from mstar_jax.models.streaming_tts.request import FLOW, TALKER, Stream, TTSRequest
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.serving.chunks import ChunkRow
from mstar_jax.serving.decoder import DecodeRow
from mstar_jax.serving.model import Node, RowWalks
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase

NOW, BOS, TEXT_VOCAB, IN_FLIGHT = 10.0, 3, 100, 7
WALKS = RowWalks(TALKER_DECODE, TALKER_PREFILL, TALKER_MIXED)


def _random_stream(rng: np.random.Generator, rid: str, in_flight: int | None) -> Stream:
    """A stream in a state an engine reaches: a decoding one's newest code is read, or on the device in
    the step in flight (`in_flight`); a stream whose every code is scheduled flushes."""
    frames = int(rng.integers(1, 12))
    text = tuple(int(t) for t in rng.integers(0, 50, rng.integers(1, 9)))
    request = TTSRequest(rid, text, Voice(int(rng.integers(3)), int(rng.integers(1, 5))), frames)
    stream = Stream(request, prompt=(*text, BOS))
    talker, flow = stream.progress[TALKER], stream.progress[FLOW]
    phases = [Phase.WAITING, PREFILL, DECODE, FLUSH, Phase.DONE, Phase.CANCELLED]
    stream.phase = phases[rng.integers(len(phases))]
    if stream.phase is DECODE and frames == 1:  # its one code was scheduled with its prompt's last chunk
        stream.phase = FLUSH
    stream.paused = bool(rng.random() < 0.15)
    stream.hold_until = NOW + 1 if rng.random() < 0.15 else float(rng.integers(0, NOW + 1))  # NOW: runs
    if stream.phase in (Phase.WAITING, PREFILL):
        talker.prefilled = int(rng.integers(0, stream.prompt_len))
    else:
        talker.prefilled = stream.prompt_len
        most = frames - 1 if stream.phase is DECODE else frames  # a decoding stream has frames to come
        talker.tokens.extend(rng.integers(0, 64, rng.integers(in_flight is None, most + 1)).tolist())
        talker.generated = len(talker.tokens)
        talker.tokens_in_flight = int(rng.integers(0, most - len(talker.tokens) + 1))
        if not talker.tokens:  # its first code is on the device
            talker.tokens_in_flight = max(talker.tokens_in_flight, 1)
            talker.feed = (IN_FLIGHT, int(rng.integers(64)))
        elif rng.random() < 0.5:  # a code fed by the step in flight, or by one since read
            talker.feed = (IN_FLIGHT if rng.random() < 0.8 else IN_FLIGHT - 1, int(rng.integers(64)))
        talker.finished = talker.generated >= frames
    flow.written = int(rng.integers(0, len(talker.tokens) + 1))
    return stream


def _oracle_talker(streams, *, max_batch, prefill_tokens, prefill_room, in_flight, decode_steps):
    decode, prefill = [], []
    for s in streams:
        if s.phase in (FLUSH, Phase.DONE, Phase.FAILED, Phase.CANCELLED) or s.paused or s.hold_until > NOW:
            continue
        p = s.progress[TALKER]
        if s.phase is DECODE:
            steps = min(decode_steps, s.request.frames - len(s.codes) - p.tokens_in_flight)
            if p.feed is not None and p.feed[0] == in_flight:
                decode.append(DecodeRow(s, (TEXT_VOCAB,), True, p.feed[1], steps))
            else:
                decode.append(DecodeRow(s, (TEXT_VOCAB + s.codes[-1],), True, -1, steps))
        else:
            prompt = (*s.request.text, BOS)
            prefill.append(DecodeRow(s, prompt[p.prefilled : p.prefilled + prefill_tokens], False))
    decode, prefill = decode[:max_batch], prefill[:max_batch]
    if prefill_room:  # one combined program: prefill rows beside decode rows, as many as it has room for
        return [
            (decode + prefill[: min(max_batch - len(decode), prefill_room) if decode else max_batch], None)
        ]
    return [(decode, TALKER_DECODE), (prefill, TALKER_PREFILL)]


def _oracle_flow(streams, *, max_batch, chunk):
    rows = []
    for s in streams:
        if s.phase.finished or s.paused or s.hold_until > NOW:
            continue
        ready = len(s.codes) - s.flow_written
        if ready >= chunk or (ready > 0 and len(s.codes) >= s.request.frames):
            first = s.flow_written
            rows.append(ChunkRow(s, first, tuple(s.codes[first : first + min(chunk, ready)])))
    return [(rows[:max_batch], FLOW_CHUNK)]


def _nodes(
    max_batch: int, room: int, steps: int, prefill_tokens: int, chunk: int
) -> tuple[TalkerNode, FlowNode]:
    buckets = tts_buckets(
        batch_sizes=(max_batch,), token_counts=(prefill_tokens,), flow_chunk=1,
        max_prefill_rows_in_combined=room, combined=room > 0, decode_steps=steps,
    )  # fmt: skip
    talker_node = Node(TALKER, None, (), None, buckets.walks, feeds=True, row_walks=WALKS)
    talker = TalkerNode(
        talker_node, buckets=buckets, decode_steps=steps, mesh=None, text_vocab=TEXT_VOCAB,
        decode_walk=TALKER_DECODE, prefill_walk=TALKER_PREFILL,
    )  # fmt: skip
    flow_buckets = Buckets((BucketSet(graph_walk=FLOW_CHUNK, batch_sizes=(max_batch,), token_counts=(8,)),))
    flow = FlowNode(Node(FLOW, None, (), None, (FLOW_CHUNK,)), talker, buckets=flow_buckets, chunk=chunk)
    return talker, flow


@pytest.mark.parametrize("seed", range(12))
def test_rows_equal_a_plain_loop_over_the_streams(seed):
    rng = np.random.default_rng(seed)
    in_flight = IN_FLIGHT if rng.random() < 0.7 else None
    live = [_random_stream(rng, f"r{i}", in_flight) for i in range(int(rng.integers(1, 80)))]
    for max_batch, room, steps in [(1, 0, 1), (4, 2, 1), (16, 16, 1), (64, 5, 1), (3, 0, 4), (64, 0, 32)]:
        prefill_tokens, chunk = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        talker, flow = _nodes(max_batch, room, steps, prefill_tokens, chunk)
        expected = _oracle_talker(
            live, max_batch=max_batch, prefill_tokens=prefill_tokens, in_flight=in_flight,
            decode_steps=steps, prefill_room=min(room, max_batch),
        )  # fmt: skip
        got = talker.rows(live, now=NOW, max_batch=max_batch, in_flight=in_flight)
        assert got == expected
        for rows, _ in got:  # Python ints, as the batch builders expect
            for row in rows:
                assert all(type(v) is int for v in (*row.tokens, row.feed, row.steps))
        assert flow.rows(live, now=NOW, max_batch=max_batch, in_flight=None) == _oracle_flow(
            live, max_batch=max_batch, chunk=chunk
        )


def test_rows_of_no_stream_are_empty():
    talker, flow = _nodes(4, 2, 1, 4, 4)
    assert talker.rows([], now=NOW, max_batch=4, in_flight=None) == [([], None)]
    assert flow.rows([], now=NOW, max_batch=4, in_flight=None) == [([], FLOW_CHUNK)]
