"""K decode steps per dispatch (`EngineSettings(decode_steps=K)`): what a request hears does not depend on K.

The output oracle of `test_outputs` run over K = 4, 8 and 32: every request of a random crowd, served by
an engine whose talker decodes K frames per program (synchronous and pipelined), gets the codes, mel and
samples it gets alone from the K = 1 engine, bit for bit; so does one offloaded and reloaded mid-block,
one next to a cancelled crowd member, and a crowd replayed after device faults. Each test checks from
the records that blocks really ran (K-token decode buckets, rows taking several steps, rows ending
inside a block).
"""

from __future__ import annotations

import itertools
import os

import pytest

from benchmarks.soak import FakeClock
from mstar_jax.compile import ExecutableStore
from mstar_jax.engine import Phase
from mstar_jax.engine.admission import Admission
from mstar_jax.engine.build import EXECUTABLES
from mstar_jax.engine.faults import inject_faults
from mstar_jax.models.streaming_tts import Engine, TTSPrograms, tts_buckets
from mstar_jax.models.streaming_tts.model import TALKER_DECODE
from mstar_jax.settings import EngineSettings
from tests.engine.support import (
    BATCH_SIZES,
    CONFIG,
    TOKEN_COUNTS,
    assert_complete,
    make_engine,
    managers,
    request,
)
from tests.engine.test_outputs import VOICE_SEEDS, VOICES, Alone, assert_same_output, crowd, serve

STEPS = (4, 8, 32)


@pytest.fixture(scope="module")
def alone(programs) -> Alone:
    """Requests served alone by the K = 1 engine (the package's programs)."""
    return Alone(programs)


@pytest.fixture(scope="module", params=STEPS, ids=[f"K={k}" for k in STEPS])
def blocks(request, programs, cache_dir):
    """The package's model with programs captured for decode blocks of K steps."""
    model, _ = programs
    talker, flow = managers()
    buckets = tts_buckets(
        batch_sizes=BATCH_SIZES, token_counts=TOKEN_COUNTS, flow_chunk=CONFIG.flow_chunk, combined=False,
        decode_steps=request.param,
    )  # fmt: skip
    store = ExecutableStore(os.path.join(cache_dir, EXECUTABLES))
    captured = TTSPrograms.capture(
        model, buckets, talker=talker, flow=flow, progress=False, max_workers=2, store=store
    )
    assert captured.decode_steps == request.param
    return model, captured


def block_engine(blocks, **settings) -> Engine:
    k = blocks[1].decode_steps
    engine, voices = make_engine(blocks, clock=FakeClock(), decode_steps=k, **settings)
    voices.append(engine.add_voice(2, frames=3, seed=VOICE_SEEDS[VOICES[2]]))
    assert tuple(voices) == VOICES
    return engine


def decode_records(engine: Engine) -> list:
    return [r for r in engine.records if r.walk == TALKER_DECODE]


def assert_blocks_ran(engine: Engine, streams) -> None:
    """Every decode program was a K-step block; some row took several of its steps and some ended inside
    one (its frames ran out before the block's end)."""
    k = engine.settings.decode_steps
    decodes = decode_records(engine)
    assert decodes
    assert all(r.bucket.num_tokens == k for r in decodes)
    advanced, ended_inside = False, False
    for stream in streams.values():
        starts = [r.positions[r.request_ids.index(stream.request_id)] for r in decodes
                  if stream.request_id in r.request_ids]  # fmt: skip
        advanced |= any(b - a > 1 for a, b in itertools.pairwise(starts))
        decoded = stream.request.frames - 1  # the first frame comes from the prompt's last chunk
        ended_inside |= decoded % k != 0 or (decoded and len(starts) == 1 and decoded < k)
    assert ended_inside
    assert advanced or k >= max(s.request.frames for s in streams.values())


@pytest.mark.slow
def test_each_member_of_a_crowd_hears_what_it_hears_alone_at_one_step(blocks, alone, pipelined):
    """The random crowd of `test_outputs`, half arriving while others run, two slots a cache: every
    member's codes, mel and samples are bit-identical to the K = 1 engine's alone."""
    engine = block_engine(blocks, pipelined=pipelined)
    streams = serve(engine, crowd("crowd"))
    for stream in streams.values():
        assert_complete(stream)
        assert_same_output(stream, alone(stream.request))
    assert_blocks_ran(engine, streams)
    assert engine.compilations == 0
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    if pipelined:
        assert engine.stats.rows_fed_on_device > 0


def test_new_streams_at_a_full_cache_are_held_together_after_one_refusal(blocks, alone, monkeypatch):
    """Both talker slots are taken and two new streams arrive: their prefill step is refused once
    (AllocationFailed names the first) and both are held, not one refusal, declare and admit a row; every
    stream still hears what it hears alone."""
    attempts, admit = [], Admission.admit

    def counted(self, node, rows, bucket=None):
        before = self.allocation_failed
        out = admit(self, node, rows, bucket)
        attempts.append((len(rows), self.allocation_failed - before))
        return out

    monkeypatch.setattr(Admission, "admit", counted)
    engine = block_engine(blocks)
    running = [engine.submit(request(f"run{i}", VOICES[i], 70, 4, seed=i)) for i in range(2)]
    while engine.talker.free_slots:
        engine.step()
    late = [engine.submit(request(f"new{i}", VOICES[2 - i], 6, 3, seed=5 + i)) for i in range(2)]
    attempts.clear()
    engine.run_until_idle()
    assert (2, 1) in attempts  # a step of both new rows at the full cache, refused once
    assert max(refused for _, refused in attempts) == 1
    assert engine.stats.holds >= 2
    for stream in running + late:
        assert_complete(stream)
        assert_same_output(stream, alone(stream.request))


def test_a_stream_offloaded_and_reloaded_between_blocks_hears_what_it_hears_alone(blocks, alone, pipelined):
    """A stream whose flow decoder has run and which has blocks still to decode is paused, offloaded from
    both caches (a newcomer then takes and dirties its slots), resumed and reloaded: it and the others
    hear exactly what they hear alone. (It is offloaded once its first flow step is dispatched, not once
    that step's audio is delivered: a pipelined engine delivers audio when its copy has landed, and at
    K = 32 a loaded machine may land it after the talker's last block.)"""
    target = request("target", VOICES[1], 70, 5, seed=7)  # a 32-frame block, and another, still to come
    other = request("other", VOICES[0], 18, 4, seed=8)
    newcomer = request("newcomer", VOICES[2], 6, 3, seed=9)
    offloaded = []

    def hook(engine: Engine, i: int) -> None:
        stream = engine.streams.get("target")
        if stream is None:
            return
        if not offloaded and stream.flow_written and not stream.talker_done:  # it holds both caches
            engine.pause("target")
            offloaded.append(engine.offload("target"))
            engine.submit(newcomer)
        if stream.paused and "newcomer" in engine.finished:
            engine.resume("target")

    engine = block_engine(blocks, pipelined=pipelined)
    streams = serve(engine, {0: [target, other]}, hook)
    streams["newcomer"] = engine.finished["newcomer"]
    assert offloaded
    assert offloaded[0] > 0
    # Both caches were offloaded; a talker whose last block was already dispatched never reloads.
    assert engine.stats.reloads in (1, 2)
    for req in (target, other, newcomer):
        assert_complete(streams[req.request_id])
        assert_same_output(streams[req.request_id], alone(req))


def test_a_cancelled_member_leaves_the_others_unchanged(blocks, alone):
    """A crowd member cancelled mid-stream (a block of its possibly in flight): the others hear what they hear
    alone, the cancelled one's codes are a prefix of its own, and every slot comes back."""
    cancelled = []

    def hook(engine: Engine, i: int) -> None:
        victim = next((s for s in engine.streams.values() if s.codes and not s.talker_done), None)
        if victim is not None and not cancelled:
            cancelled.append(victim.request_id)
            engine.cancel(victim.request_id)

    engine = block_engine(blocks, pipelined=True)
    streams = serve(engine, crowd("crowd"), hook)
    assert len(cancelled) == 1
    for rid, stream in streams.items():
        want = alone(stream.request)
        if rid in cancelled:
            assert stream.phase is Phase.CANCELLED
            assert stream.codes == want.codes[: len(stream.codes)]
        else:
            assert_complete(stream)
            assert_same_output(stream, want)
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


@pytest.mark.parametrize("node", ["talker", "flow"])
def test_with_snapshots_a_lost_cache_is_replayed_bit_for_bit(blocks, alone, pipelined, node):
    """Device faults that consume a node's cache, early and later: the streams are restored from the last
    snapshot, their blocks replayed, and each hears what it hears alone, every chunk delivered once."""
    engine = block_engine(blocks, pipelined=pipelined, snapshot_every=2)
    heard: dict[str, list[int]] = {}
    arrivals = crowd("fault", size=4)

    def listen(engine: Engine, i: int) -> None:
        for stream in engine.streams.values():
            if stream.request_id not in heard:
                heard[stream.request_id] = []
                stream.on_output = lambda chunk, rid=stream.request_id: heard[rid].append(chunk.first_frame)

    inject_faults(engine, node, lambda n: "after" if n in (3, 7) else None)
    streams = serve(engine, arrivals, listen)
    assert engine.stats.faults == 2
    assert engine.stats.requests_restored >= 1
    for stream in streams.values():
        assert_complete(stream)
        assert_same_output(stream, alone(stream.request))
        assert heard[stream.request_id] == list(range(0, stream.request.frames, CONFIG.flow_chunk))
    assert engine.compilations == 0


def test_programs_of_one_k_refuse_an_engine_of_another(blocks):
    model, captured = blocks
    talker, flow = managers()
    k = captured.decode_steps
    with pytest.raises(ValueError, match=rf"decode_steps=1 must be {k}"):
        Engine(model, talker=talker, flow=flow, programs=captured, settings=EngineSettings(max_batch=2))


def test_a_combined_walk_needs_one_decode_step():
    with pytest.raises(ValueError, match=r"decode_steps=4 .* combined walk needs decode_steps=1"):
        tts_buckets(batch_sizes=(2,), token_counts=(1, 4), flow_chunk=4, decode_steps=4)
    for bad in ("8", 0, 2.0, True, float("nan")):
        with pytest.raises(ValueError, match=r"decode_steps=.* must be an int >= 1"):
            tts_buckets(batch_sizes=(2,), token_counts=(1, 4), flow_chunk=4, combined=False, decode_steps=bad)


@pytest.mark.parametrize("bad", ["8", 0, -1, 257, 2.5, True, float("nan"), None])
def test_engine_settings_refuse_a_bad_decode_steps(bad):
    with pytest.raises(ValueError, match=r"decode_steps=.* must be an int in \[1, 256\]"):
        EngineSettings(decode_steps=bad)
