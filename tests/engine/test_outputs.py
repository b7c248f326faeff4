"""The engine's output oracle: what a request hears depends on the request alone.

A request's codes and audio are bit-identical whether it is served alone or in a random crowd, beside
padding rows or a full bucket, in a combined prefill+decode walk, offloaded to host memory and
reloaded, or next to requests cancelled mid-stream. And one stream served by the engine equals the
dense full-history reference (tests/models/reference.py) driven the way the engine drives it.

Every run here reads a clock that advances a millisecond per read (`FakeClock`), so holds and their
backoff (and so every batch) are the same in every process; each test also checks from
`engine.records` or `engine.stats` that the situation it is about really happened.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from benchmarks.soak import FakeClock
from mstar_jax.engine import Phase
from mstar_jax.models.streaming_tts import Engine, Stream, TTSRequest
from mstar_jax.models.streaming_tts.voices import Voice
from tests.engine.support import CONFIG, assert_complete, make_engine, request, stable_seed
from tests.models.reference import (
    SLACK,
    flow_history,
    make_reference_flow,
    make_reference_talker,
    talker_history,
    vocode_reference,
    voice_prompt,
)

VOICE_SEEDS = {Voice(0, 4): 1, Voice(1, 6): 2, Voice(2, 3): 9}
"""Every engine's voices and the seeds their prompts are drawn from (`make_engine` registers the
first two; `fresh_engine` adds the third)."""
VOICES = tuple(VOICE_SEEDS)


def fresh_engine(programs, pipelined: bool = False) -> Engine:
    engine, voices = make_engine(programs, clock=FakeClock(), pipelined=pipelined)
    voices.append(engine.add_voice(2, frames=3, seed=VOICE_SEEDS[VOICES[2]]))
    assert tuple(voices) == VOICES
    return engine


Hook = Callable[[Engine, int], None]


def serve(
    engine: Engine, arrivals: dict[int, list[TTSRequest]], hook: Hook | None = None
) -> dict[str, Stream]:
    """Step `engine` once per iteration until every request has arrived and finished.

    Args:
      arrivals: the requests submitted at each iteration (before its step).
      hook: called with the engine and the iteration, after the arrivals and before the step.

    Returns:
      every request's stream, by id.
    """
    streams, last = {}, max(arrivals)
    for i in range(3000):
        for req in arrivals.get(i, ()):
            streams[req.request_id] = engine.submit(req)
        if hook is not None:
            hook(engine, i)
        if i >= last and engine.idle:
            return streams
        engine.step()
    raise AssertionError(f"still serving {sorted(engine.streams)} after 3000 iterations")


def steps_of(engine: Engine, rid: str) -> list:
    return [r for r in engine.records if rid in r.request_ids]


def assert_same_output(got: Stream, want: Stream) -> None:
    """Codes equal and every chunk's codes, mel and samples bit-identical."""
    rid = got.request_id
    assert got.codes == want.codes, rid
    assert len(got.chunks) == len(want.chunks), rid
    for a, b in zip(got.chunks, want.chunks, strict=True):
        assert a.first_frame == b.first_frame, rid
        np.testing.assert_array_equal(a.codes, b.codes, err_msg=rid)
        np.testing.assert_array_equal(a.mel, b.mel, err_msg=rid)
        np.testing.assert_array_equal(a.samples, b.samples, err_msg=rid)


class Alone:
    """Requests served each by a fresh engine serving nothing else, memoised per request."""

    def __init__(self, programs):
        self.programs = programs
        self.served: dict[TTSRequest, tuple[Stream, list]] = {}

    def __call__(self, req: TTSRequest) -> Stream:
        """The request's stream served alone."""
        if req not in self.served:
            engine = fresh_engine(self.programs)
            stream = serve(engine, {0: [req]})[req.request_id]
            assert_complete(stream)
            assert all(r.rows < r.bucket.bs for r in engine.records)  # alone, every step is padded
            self.served[req] = stream, engine.records
        return self.served[req][0]

    def records(self, req: TTSRequest) -> list:
        """The steps that served it alone."""
        self(req)
        return self.served[req][1]


@pytest.fixture(scope="module")
def alone(programs) -> Alone:
    return Alone(programs)


def crowd(tag: str, size: int = 6) -> dict[int, list[TTSRequest]]:
    """`size` requests of random voices, text lengths, frames and seeds; three arrive at once, the
    others at random later iterations."""
    rng = np.random.default_rng(stable_seed(tag))
    arrivals: dict[int, list[TTSRequest]] = {}
    later = sorted(int(t) for t in rng.integers(1, 25, size - 3))
    for i, at in enumerate([0, 0, 0, *later]):
        voice = VOICES[int(rng.integers(len(VOICES)))]
        frames, text_len = int(rng.integers(1, 30)), int(rng.integers(1, 11))
        req = request(f"{tag}{i}", voice, frames, text_len, seed=int(rng.integers(2**32)))
        arrivals.setdefault(at, []).append(req)
    return arrivals


def test_each_member_of_a_random_crowd_hears_what_it_hears_alone(programs, alone, pipelined):
    """Six requests of mixed voices, lengths and seeds, half arriving while others run, competing for two
    slots per cache: every one's codes, mel and samples are bit-identical to the same request served
    alone (so nothing leaks between rows, slots or batch compositions)."""
    arrivals = crowd("crowd")
    engine = fresh_engine(programs, pipelined)
    live: list[int] = []
    streams = serve(engine, arrivals, lambda engine, i: live.append(len(engine.streams)))
    for stream in streams.values():
        assert_complete(stream)
        assert_same_output(stream, alone(stream.request))
    # It was a crowd: more live requests than slots, late arrivals, full steps of every walk.
    assert max(live) > CONFIG.max_slots
    assert len(arrivals) > 1
    assert len({r.voice for reqs in arrivals.values() for r in reqs}) == len(VOICES)
    walks = {r.walk for r in engine.records if r.rows == r.bucket.bs}
    assert walks == {"talker_prefill", "talker_decode", "talker_mixed", "flow_chunk"}


def test_a_request_in_a_full_bucket_hears_what_it_hears_beside_padding(programs, alone, pipelined):
    """Two requests in lockstep fill every bucket they run in (no padding row); served alone, every step
    pads the other row. Their outputs are bit-identical either way."""
    twins = [request("twin-a", VOICES[0], 13, 6, seed=3), request("twin-b", VOICES[1], 13, 6, seed=4)]
    engine = fresh_engine(programs, pipelined)
    streams = serve(engine, {0: twins})
    for req in twins:
        records = steps_of(engine, req.request_id)
        assert all(r.rows == r.bucket.bs == 2 for r in records)
        assert {r.walk for r in records} == {"talker_prefill", "talker_decode", "flow_chunk"}
        assert_complete(streams[req.request_id])
        assert_same_output(streams[req.request_id], alone(req))


def test_a_request_prefilled_in_combined_steps_hears_what_it_hears_alone(programs, alone, pipelined):
    """A request arriving while another decodes reads its whole prompt (three chunks, the last short)
    in combined prefill+decode steps, and takes its first frame from one; alone it runs plain prefill
    steps. Both requests' outputs are bit-identical to theirs alone."""
    decoding = request("mix-decode", VOICES[0], 14, 3, seed=5)
    arriving = request("mix-prefill", VOICES[1], 9, 9, seed=6)  # prompt of 10 tokens: chunks 4, 4, 2
    engine = fresh_engine(programs, pipelined)
    streams = serve(engine, {0: [decoding], 3: [arriving]})
    mixed = [r for r in steps_of(engine, "mix-prefill") if r.walk == "talker_mixed"]
    assert len(mixed) == 3
    assert all(r.request_ids == ("mix-decode", "mix-prefill") for r in mixed)
    assert [r.positions[1] for r in mixed] == [0, 4, 8]
    assert not any(r.walk == "talker_prefill" for r in steps_of(engine, "mix-prefill"))
    assert {r.walk for r in alone.records(arriving)} == {"talker_prefill", "talker_decode", "flow_chunk"}
    for req in (decoding, arriving):
        assert_complete(streams[req.request_id])
        assert_same_output(streams[req.request_id], alone(req))


@pytest.mark.parametrize("how", ["explicit", "evicted"])
def test_a_stream_offloaded_and_reloaded_mid_stream_hears_what_it_hears_alone(
    programs, alone, pipelined, how
):
    """A stream holding state in both caches (its talker past the ring wrap, flow chunks written) is
    paused and moved to host memory, by `engine.offload` (both caches at once, then a squatter
    dirties the freed slots) or by the engine evicting it, one cache at a time, for a newcomer. Resumed
    and reloaded, it (and everyone else) hears exactly what it hears alone."""
    target = request("target", VOICES[1], 26, 5, seed=7)
    other = request("other", VOICES[0], 18, 4, seed=8)
    newcomer = request("newcomer", VOICES[2], 6, 3, seed=9)
    seen_offloaded: set[str] = set()

    def hook(engine: Engine, i: int) -> None:
        stream = engine.streams.get("target")
        if i == 14:
            assert stream.phase is Phase.DECODE
            assert stream.chunks
            assert stream.talker_written > engine.talker.config.slot_tokens  # past the ring's wrap
            engine.pause("target")
            if how == "explicit":
                freed = engine.offload("target")
                assert freed == engine.talker.config.slot_bytes + engine.flow.config.slot_bytes
                assert engine.talker.slot_of("target") is None
                assert engine.flow.slot_of("target") is None
            engine.submit(newcomer)
        if stream is not None:
            seen_offloaded.update(n for n, node in engine.nodes.items() if node.runner.is_offloaded("target"))
        if stream is not None and stream.paused and "newcomer" in engine.finished:
            engine.resume("target")

    engine = fresh_engine(programs, pipelined)
    streams = serve(engine, {0: [target, other]}, hook)
    streams["newcomer"] = engine.finished["newcomer"]
    assert seen_offloaded == {"talker", "flow"}
    assert engine.stats.reloads == 2  # one per cache
    assert engine.stats.offloads == (1 if how == "explicit" else 2)
    for req in (target, other, newcomer):
        assert_complete(streams[req.request_id])
        assert_same_output(streams[req.request_id], alone(req))


def test_cancelling_crowd_members_mid_stream_leaves_the_others_unchanged(programs, alone, pipelined):
    """The crowd of the first test, two members cancelled mid-stream (one decoding with audio out, one
    halfway through reading its prompt): the others hear exactly what they hear alone, and what the
    cancelled ones got before is a prefix of their output alone."""
    arrivals = crowd("crowd")
    cancelled: dict[str, Phase] = {}
    wanted = [  # cancel the first stream seen in each state, in this order
        lambda s: s.phase is Phase.DECODE and s.chunks,
        lambda s: s.phase is Phase.PREFILL,
    ]

    def hook(engine: Engine, i: int) -> None:
        if len(cancelled) == len(wanted):
            return
        victim = next((s for s in engine.streams.values() if wanted[len(cancelled)](s)), None)
        if victim is not None:
            cancelled[victim.request_id] = victim.phase
            engine.cancel(victim.request_id)

    engine = fresh_engine(programs, pipelined)
    streams = serve(engine, arrivals, hook)
    assert list(cancelled.values()) == [Phase.DECODE, Phase.PREFILL]
    for rid, stream in streams.items():
        want = alone(stream.request)
        if rid in cancelled:
            assert stream.phase is Phase.CANCELLED
            assert len(stream.codes) < stream.request.frames
            assert stream.codes == want.codes[: len(stream.codes)]
            assert len(stream.chunks) <= len(want.chunks)
            for got, ref in zip(stream.chunks, want.chunks, strict=False):
                np.testing.assert_array_equal(got.samples, ref.samples)
        else:
            assert_complete(stream)
            assert_same_output(stream, want)
    assert engine.stats.cancelled == 2


def dense_request(model, req: TTSRequest, *, prefill_tokens: int, flow_codes: list[np.ndarray]):
    """The request through the dense references, step by step as the engine drives it.

    The talker reads the prompt (text, then BOS) in chunks of `prefill_tokens` (the scheduler's split),
    its last chunk giving the first frame, then decodes one frame per step, each fed the previous
    one; every frame is drawn by `sample_codes` keyed by (seed, stream position). The flow then decodes
    `flow_codes` (the engine's chunks) in order. Stream positions count the voice.

    Returns:
      (codes, per chunk its mel f32[T, M] and samples f32[T * samples_per_frame]).
    """
    voice, seed = req.voice, np.uint32(req.seed)
    voice_codes, voice_mel, voice_noise = voice_prompt(model.config, VOICE_SEEDS[voice], voice.frames)
    assert prefill_tokens <= SLACK
    assert all(len(c) <= SLACK for c in flow_codes)

    def padded(values):
        out = np.zeros((1, SLACK), np.int32)
        out[0, : len(values)] = values
        return out

    prompt = [*req.text, model.bos]
    total = voice.frames + len(prompt) + req.frames
    hist_k, hist_v = talker_history(model, voice_codes, total)
    sink, window, _ = model.talker_kv.retention_for(voice.frames)
    step = make_reference_talker(model, total)
    chunks = [prompt[i : i + prefill_tokens] for i in range(0, len(prompt), prefill_tokens)]
    n, codes = voice.frames, []
    while len(codes) < req.frames:
        tokens = chunks.pop(0) if chunks else [model.text_vocab + codes[-1]]
        hist_k, hist_v, code = step(
            model.talker_params, hist_k, hist_v, padded(tokens), len(tokens), n, sink, window, seed
        )
        n += len(tokens)
        if not chunks:  # prefill chunks before the last predict nothing the engine keeps
            codes.append(int(code))

    total = voice.frames + req.frames
    hist_k, hist_v = flow_history(model, voice_codes, voice_mel, voice_noise, total)
    sink, window, _ = model.flow_kv.retention_for(voice.frames)
    chunk = make_reference_flow(model, total)
    n, audio = voice.frames, []
    for frames in flow_codes:
        m = len(frames)
        hist_k, hist_v, mel = chunk(
            model.flow_params, hist_k, hist_v, padded(frames), m, n, sink, window, seed
        )
        n += m
        mel = np.asarray(mel[:m])
        audio.append((mel, vocode_reference(model, mel)))
    return codes, audio


def test_one_stream_served_by_the_engine_equals_the_dense_reference(programs, alone):
    """A request whose prompt splits into three chunks (the last short) and whose talker wraps its ring
    many times, served by the engine, against the dense full-history reference driven the same way:
    the same codes exactly, the same mel and samples up to float rounding."""
    model, _ = programs
    req = request("dense", VOICES[1], 23, 9, seed=stable_seed("dense/seed"))
    stream = alone(req)
    # The engine drove it as `dense_request` does: three prefill chunks, then one decode per frame;
    # the flow in whole chunks, the last one short.
    talker = [r for r in alone.records(req) if r.walk.startswith("talker")]
    assert [r.walk for r in talker] == ["talker_prefill"] * 3 + ["talker_decode"] * (req.frames - 1)
    assert [r.positions[0] for r in talker] == [0, 4, 8, *range(10, 10 + req.frames - 1)]
    assert [len(c.codes) for c in stream.chunks] == [4] * 5 + [3]

    prefill_tokens = programs[1].buckets.max_tokens("talker_prefill")
    codes, audio = dense_request(
        model, req, prefill_tokens=prefill_tokens, flow_codes=[c.codes for c in stream.chunks]
    )
    assert stream.codes == codes
    # Float tolerance: the engine's attention reduces over the ring's retained entries in the kernel's
    # block order and the voice's keys were computed padded to the longest voice; the reference reduces
    # over the dense history in stream order. Same terms, different summation order.
    for got, (mel, samples) in zip(stream.chunks, audio, strict=True):
        np.testing.assert_allclose(got.mel, mel, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.samples, samples, rtol=2e-5, atol=2e-5)
