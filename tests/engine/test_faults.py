"""Device faults (docs/design.md §11): a step that raises, before or after it consumed its donated cache,
costs at most the requests whose state was lost; with snapshots, not even those.

Faults are injected with `mstar_jax.engine.faults.inject_faults`: a program that runs and then raises
(its donated cache is gone), one that raises before running (the cache survives), or a cache buffer
deleted before a step (a poisoned buffer). Every surviving request's codes and audio must equal,
bit for bit, the same request served alone by a fresh engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.engine import Phase
from mstar_jax.engine.faults import inject_faults
from mstar_jax.engine.recovery import MAX_STEP_FAULTS
from mstar_jax.models.streaming_tts import Stream, TTSRequest
from mstar_jax.models.streaming_tts.request import StateLostError, StepFailedError
from tests.engine.support import CONFIG, assert_complete, make_engine, request


def served_alone(programs, req: TTSRequest) -> Stream:
    engine, _ = make_engine(programs)
    stream = engine.submit(req)
    engine.run_until_idle()
    assert_complete(stream)
    return stream


def assert_same_output(stream: Stream, alone: Stream) -> None:
    assert stream.codes == alone.codes
    assert len(stream.chunks) == len(alone.chunks)
    for got, want in zip(stream.chunks, alone.chunks, strict=True):
        assert got.first_frame == want.first_frame
        for a, b in ((got.codes, want.codes), (got.mel, want.mel), (got.samples, want.samples)):
            np.testing.assert_array_equal(a, b)


def crowd(voices) -> list[TTSRequest]:
    v0, v1 = voices
    return [
        request("a", v0, 13, seed=1),
        request("b", v1, 9, text_len=7, seed=2),
        request("c", v0, 6, seed=3),
    ]


def listen(engine, req: TTSRequest, heard: dict) -> Stream:
    heard[req.request_id] = []
    return engine.submit(req, on_output=lambda chunk: heard[req.request_id].append(chunk.first_frame))


def test_a_fault_that_consumes_the_talker_cache_fails_only_its_slot_holders_then_serving_goes_on(
    programs, pipelined
):
    engine, voices = make_engine(programs, pipelined=pipelined)
    parked = engine.submit(request("parked", voices[1], 8, seed=9))
    while not parked.codes:
        engine.step()
    engine.pause("parked")
    assert engine.offload("parked") > 0  # on the host: the fault cannot reach it
    first = [engine.submit(req) for req in crowd(voices)[:2]]
    inject_faults(engine, "talker", lambda n: "after" if n == 4 else None)
    while engine.stats.faults == 0:
        engine.step()
    for stream in first:
        assert stream.phase is Phase.FAILED
        assert type(stream.failure) is StateLostError
        assert stream.failure.retryable
        assert "lost request" in stream.error
    assert engine.stats.requests_lost == 2
    assert engine.talker.free_slots == CONFIG.max_slots  # the rebuilt cache is empty; nothing leaked
    engine.resume("parked")
    late = engine.submit(crowd(voices)[2])
    retried = engine.submit(crowd(voices)[0])  # the failure said it is retryable: submit it again
    engine.run_until_idle()
    for stream in (parked, late, retried):
        assert_same_output(stream, served_alone(programs, stream.request))
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    assert engine.compilations == 0


@pytest.mark.parametrize(("node", "kind"), [("talker", "after"), ("flow", "after"), ("talker", "poison")])
def test_with_snapshots_a_lost_cache_is_restored_and_replayed_bit_for_bit(programs, pipelined, node, kind):
    engine, voices = make_engine(programs, snapshot_every=3, pipelined=pipelined)
    heard: dict[str, list[int]] = {}
    streams = [listen(engine, req, heard) for req in crowd(voices)[:2]]
    faults = {"talker": {6, 15}, "flow": {2, 5}}[
        node
    ]  # early, while the third request is on its way, and later
    inject_faults(engine, node, lambda n: kind if n in faults else None)
    for _ in range(4):
        engine.step()
    streams.append(listen(engine, crowd(voices)[2], heard))  # arrives after a snapshot: starts over
    engine.run_until_idle()
    assert engine.stats.faults == 2
    assert engine.stats.requests_restored >= 2
    assert engine.stats.snapshots >= 2
    for stream in streams:
        assert_same_output(stream, served_alone(programs, stream.request))
        frames = stream.request.frames
        assert heard[stream.request_id] == list(range(0, frames, CONFIG.flow_chunk))  # once each, in order
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    assert engine.compilations == 0


def test_a_poisoned_flow_buffer_is_a_fault_like_any_other(programs, pipelined):
    engine, voices = make_engine(programs, snapshot_every=2, pipelined=pipelined)
    streams = [engine.submit(req) for req in crowd(voices)[:2]]
    while not any(s.chunks for s in streams):
        engine.step()
    engine.flow.cache.k[0].delete()  # what a failed transfer or a bad device leaves behind
    engine.run_until_idle()
    assert engine.stats.faults == 1
    for stream in streams:
        assert_same_output(stream, served_alone(programs, stream.request))


@pytest.mark.parametrize("node", ["talker", "flow"])
def test_a_step_whose_outputs_cannot_be_read_back_loses_its_requests_and_serving_goes_on(
    programs, pipelined, node
):
    """Its outputs are lost after it ran: a synchronous engine finds out at once, a pipelined one a step
    later, with the next step already dispatched on its cache. Either way its requests are lost (and
    retryable), nothing leaks, and requests submitted again hear what they hear alone."""
    engine, voices = make_engine(programs, pipelined=pipelined)
    streams = [engine.submit(req) for req in crowd(voices)[:2]]
    inject_faults(engine, node, lambda n: "unreadable" if n == 3 else None)
    engine.run_until_idle()
    # A pipelined talker's next step, fed the lost codes, fails as well.
    assert engine.stats.faults == (2 if pipelined and node == "talker" else 1)
    for stream in streams:
        assert stream.phase is Phase.FAILED
        assert type(stream.failure) is StateLostError
        assert stream.failure.retryable
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    again = [engine.submit(req) for req in crowd(voices)[:2]]
    engine.run_until_idle()
    for stream in again:
        assert_same_output(stream, served_alone(programs, stream.request))
    assert engine.compilations == 0


def test_a_step_that_fails_before_consuming_its_cache_is_retried(programs, pipelined):
    engine, voices = make_engine(programs, pipelined=pipelined)
    streams = [engine.submit(req) for req in crowd(voices)[:2]]
    inject_faults(engine, "talker", lambda n: "before" if n in (2, 3) else None)
    engine.run_until_idle()
    assert engine.stats.faults == 2
    assert engine.stats.requests_lost == 0
    for stream in streams:
        assert_same_output(stream, served_alone(programs, stream.request))


def test_faults_that_are_not_in_a_row_never_fail_a_stream_reading_its_prompt(programs):
    """A talker step that comes back forgives the failures before it, a prompt's chunk as much as a
    code's: a long text whose every other step fails is read and spoken as it is alone."""
    engine, voices = make_engine(programs)
    stream = engine.submit(request("long", voices[0], 6, text_len=12))  # a prompt of 4 chunks
    inject_faults(engine, "talker", lambda n: "before" if n % 2 else None)
    engine.run_until_idle()
    assert stream.phase is Phase.DONE, stream.error
    assert engine.stats.faults > MAX_STEP_FAULTS  # more in all than a stream rides out in a row
    assert_same_output(stream, served_alone(programs, stream.request))


def test_requests_whose_steps_always_fail_fail_alone_and_the_engine_stays_usable(programs):
    engine, voices = make_engine(programs)
    streams = [engine.submit(req) for req in crowd(voices)[:2]]
    counter = inject_faults(engine, "talker", lambda n: "before")
    engine.run_until_idle()
    for stream in streams:
        assert stream.phase is Phase.FAILED
        assert type(stream.failure) is StepFailedError
        assert f"{MAX_STEP_FAULTS} talker steps with request" in stream.error
    assert counter == [MAX_STEP_FAULTS]  # both rode in the same steps
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_a_step_that_raises_keeps_its_own_error_when_aborting_its_admission_raises_too(programs, monkeypatch):
    engine, voices = make_engine(programs)
    stream = engine.submit(crowd(voices)[0])
    inject_faults(engine, "talker", lambda n: "before")

    def broken_abort(step, ctx):
        raise RuntimeError("abort broke")

    monkeypatch.setattr(engine.talker, "abort_step", broken_abort)
    engine.run_until_idle()
    assert type(stream.failure) is StepFailedError
    assert "InjectedFaultError('injected before talker step 3')" in stream.error
    assert "abort broke" not in stream.error
    assert engine.stats.faults == MAX_STEP_FAULTS


def test_inject_faults_refuses_what_it_cannot_inject(programs):
    engine, voices = make_engine(programs)
    with pytest.raises(
        ValueError, match=r"node='vocoder' must be one of the engine's nodes \['talker', 'flow'\]"
    ):
        inject_faults(engine, "vocoder", lambda n: None)
    inject_faults(engine, "talker", lambda n: "melt")
    stream = engine.submit(request("a", voices[0], 3))
    engine.run_until_idle()  # the engine reads the refusal as a failing step, like any other
    assert type(stream.failure) is StepFailedError
    assert (
        "schedule(3)='melt' must be None or one of ('before', 'after', 'poison', 'unreadable')"
        in stream.error
    )


def test_a_stream_offloaded_while_its_lost_step_was_in_flight_fails_retryably(programs):
    """Pipelined: a talker step is dispatched with its outputs lost, and before it is read its stream
    is paused and offloaded (the host copy is read from the lost step's cache). The stream holds no
    slot for the recovery to rewind, so it fails, retryably, rather than wait forever on a code that
    never comes; the other stream is lost with the cache; resubmitted, both hear what they hear alone."""
    engine, voices = make_engine(programs, pipelined=True)
    streams = [engine.submit(req) for req in crowd(voices)[:2]]
    calls = inject_faults(engine, "talker", lambda n: "unreadable" if n == 6 else None)
    while calls[0] < 6:
        engine.step()
    assert engine.stats.faults == 0  # dispatched, not read yet
    engine.pause(streams[0].request_id)
    assert engine.offload(streams[0].request_id) > 0
    while engine.stats.faults == 0:  # the lost step is read while its stream is on the host
        engine.step()
    assert streams[0].phase is Phase.FAILED
    engine.run_until_idle()
    for stream in streams:
        assert stream.phase is Phase.FAILED
        assert type(stream.failure) is StateLostError
    assert "offloaded copy" in streams[0].error
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    again = [engine.submit(req) for req in crowd(voices)[:2]]
    engine.run_until_idle()
    for stream in again:
        assert_same_output(stream, served_alone(programs, stream.request))
