"""The engine loop: admission refusals and their answers, offload/reload, cancellation, no compilation
after warm-up, and `mstar-jax run` end to end on a tiny deployment.

Every engine here shares one set of captured programs (`programs`): they only depend on the caches'
geometry. The persistent compilation cache lets the CLI test load them instead of compiling again.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import yaml

from mstar_jax import cli
from mstar_jax.compile import (
    Buckets,
    CapturedStep,
    FrozenTree,
    RecompileWarning,
    assert_no_compilations,
)
from mstar_jax.engine import Phase
from mstar_jax.models.streaming_tts import Engine, TTSPrograms, TTSRequest
from mstar_jax.models.streaming_tts.model import TALKER_DECODE, StreamingTTSModel
from mstar_jax.models.streaming_tts.programs import SettingsMismatchError
from mstar_jax.models.streaming_tts.request import RequestError
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.resources.step import UnknownRequestError
from tests.engine.support import (
    BATCH_SIZES,
    CONFIG,
    TOKEN_COUNTS,
    assert_complete,
    engine_kwargs,
    make_engine,
    managers,
    request,
)


def test_streams_complete_and_stream_iterator_yields_chunks_in_order(programs):
    engine, (v0, v1) = make_engine(programs)
    streams = [
        engine.submit(request(f"r{i}", (v0, v1)[i % 2], frames)) for i, frames in enumerate((3, 17, 30))
    ]
    chunks = list(engine.stream(request("it", v1, 9)))
    engine.run_until_idle()
    for stream in streams:
        assert_complete(stream)
    assert [c.first_frame for c in chunks] == [0, 4, 8]
    assert sum(len(c.codes) for c in chunks) == 9
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    assert engine.compilations == 0


def test_every_step_gets_its_node_s_weights_frozen_once(programs, monkeypatch):
    # The programs take the weights as a FrozenTree (capture's frozen_argnums): the engine flattens each
    # node's nnx.State once, and every step gets that same object, holding the model's own arrays.
    model, _ = programs
    engine, (v0, _) = make_engine(programs)
    given = []
    replay = CapturedStep.replay
    monkeypatch.setattr(
        CapturedStep,
        "replay",
        lambda self, bucket, *args: given.append(args[0]) or replay(self, bucket, *args),
    )
    stream = engine.submit(request("frozen", v0, 9))
    engine.run_until_idle()
    assert_complete(stream)
    weights = {id(x): x for x in given}
    assert len(weights) == 2  # the talker's and the flow's
    assert all(isinstance(x, FrozenTree) for x in weights.values())
    own = [jax.tree.leaves(model.talker_params), jax.tree.leaves(model.flow_params)]
    held = sorted((list(x.leaves) for x in weights.values()), key=len)
    for leaves, expected in zip(held, sorted(own, key=len), strict=True):
        assert all(a is b for a, b in zip(leaves, expected, strict=True))


def test_run_until_idle_stops_after_max_steps_and_goes_on_where_it_stopped(programs):
    """`max_steps` rounds, then the streams are where those rounds left them: a second call finishes
    them with the codes one uninterrupted call gives."""
    whole, (v0, _) = make_engine(programs)
    alone = whole.submit(request("r0", v0, 12))
    whole.run_until_idle()
    engine, (v0, _) = make_engine(programs)
    stream = engine.submit(request("r0", v0, 12))
    assert engine.run_until_idle(max_steps=3) == 3
    assert engine.steps_run == 3
    assert not stream.phase.finished
    assert engine.run_until_idle() > 0
    assert_complete(stream)
    assert stream.codes == alone.codes


@pytest.mark.parametrize("max_steps", ["2", -1, 0.5, True, float("nan")])
def test_run_until_idle_refuses_a_bad_max_steps_before_any_step(programs, max_steps):
    engine, (v0, _) = make_engine(programs)
    stream = engine.submit(request("r0", v0, 12))
    with pytest.raises(ValueError, match=r"max_steps=.* must be None or an int >= 0"):
        engine.run_until_idle(max_steps=max_steps)
    assert engine.steps_run == 0
    assert stream.phase == Phase.WAITING


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("history", 0), ("history", "7"), ("num_voices", 0), ("num_voices", -1), ("num_voices", 2.0),
        ("max_workers", 0), ("max_prefill_rows_in_combined", -1),
        ("max_prefill_rows_in_combined", float("nan")),
    ],
)  # fmt: skip
def test_from_deployment_refuses_a_bad_setting_before_building_anything(monkeypatch, setting, value):
    """Once, `history=0` was refused after every bucket compiled, `num_voices=0` meant "the default"
    and `num_voices=-1` was refused as `num_sources`."""
    from mstar_jax.deployment import parse_deployment
    from mstar_jax.models.streaming_tts import build

    def no_manager(*args, **kwargs):
        raise AssertionError("a cache was built before the settings were checked")

    monkeypatch.setattr(build, "BoundedKVManager", no_manager)
    deployment = parse_deployment({"model": {"name": "streaming_tts"}})
    with pytest.raises(ValueError, match=rf"^{setting}={value!r} must be None or an int >= "):
        Engine.from_deployment(deployment, progress=False, **{setting: value})


def test_full_caches_offload_a_paused_stream_then_hold_it_until_a_slot_is_released(programs):
    engine, (v0, v1) = make_engine(programs)
    paused = engine.submit(request("paused", v0, 20))
    other = engine.submit(request("other", v1, 12))
    for _ in range(6):  # both hold a slot in each cache now
        engine.step()
    engine.pause("paused")
    late = engine.submit(request("late", v0, 10))
    engine.step()
    # Both talker slots were taken: the paused stream was offloaded to admit the new one.
    assert engine.stats.allocation_failed >= 1
    assert engine.is_offloaded("paused")
    assert engine.talker.slot_of("late") is not None
    engine.resume("paused")
    resumed_at = engine.clock()
    engine.run_until_idle()
    for stream in (paused, other, late):
        assert_complete(stream)
    # Resumed while both caches were full (nothing paused to offload), it was held, and reloaded only
    # once a stream finished and returned its slots.
    assert engine.stats.holds >= 1
    assert engine.stats.reloads >= 1
    first_release = min(other.finished_at, late.finished_at)
    back = min(r.started for r in engine.records if "paused" in r.request_ids and r.started > resumed_at)
    assert back >= first_release


def test_malformed_requests_are_refused_at_submit_with_nothing_queued(programs):
    engine, (v0, _) = make_engine(programs)
    bad = {
        "unregistered voice": (request("missing", Voice(5, 4), 10), ValueError, (
            r"request 'missing': voice=Voice\(index=5, frames=4\) is not registered; "
            r"registered \(index, frames\): \[\(0, 4\), \(1, 6\)\]"
        )),
        "voice of the wrong length": (request("wrong", Voice(0, 6), 10), ValueError, "is not registered"),
        "token outside the vocabulary": (
            TTSRequest("t", [3, 99], v0, 4), ValueError, r"text tokens \[99\] are outside",
        ),
        "not a request": ("say hello", TypeError, "must be a TTSRequest"),
    }  # fmt: skip
    for case, (req, error, match) in bad.items():
        with pytest.raises(error, match=match):
            engine.submit(req)
        assert engine.idle, case
    with pytest.raises(TypeError, match="on_output=3 must be callable"):
        engine.submit(request("cb", v0, 4), on_output=3)
    with pytest.raises(ValueError, match=r"Voice frames=16.0 must be an int >= 1"):
        Voice(0, 16.0)
    with pytest.raises(ValueError, match=r"text=\[1.5, 2\] must be integer token ids, got dtype float64"):
        TTSRequest("f", [1.5, 2], v0, 4)
    for call in (engine.pause, engine.resume, engine.offload, engine.cancel):
        with pytest.raises(
            UnknownRequestError, match=r"request_id='nobody' is not a live request; live: \[\]"
        ):
            call("nobody")
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_a_request_refused_at_admission_fails_alone_with_its_message(programs):
    engine, (v0, v1) = make_engine(programs)
    good = [engine.submit(request("g0", v0, 10)), engine.submit(request("g1", v0, 7))]
    orphan = engine.submit(request("orphan", v1, 10))
    engine.voices.remove(1)  # withdrawn behind the engine's back while the request waits
    engine.run_until_idle()
    for stream in good:
        assert_complete(stream)
    assert orphan.phase is Phase.FAILED
    assert type(orphan.failure) is RequestError
    assert not orphan.failure.retryable
    assert "resource 'talker_kv' rejected the request" in orphan.error
    assert "reads source 1, which is not registered" in orphan.error
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_an_admit_that_raises_fails_only_the_request_it_is_about(programs, monkeypatch):
    engine, (v0, v1) = make_engine(programs)
    admit = engine.talker.admit

    def fragile_admit(step, ctx):
        if any(seg.request_id == "boom" for seg in step.segments):
            raise TypeError("a resource bug")
        return admit(step, ctx)

    monkeypatch.setattr(engine.talker, "admit", fragile_admit)
    good = [engine.submit(request("g0", v0, 9)), engine.submit(request("g1", v1, 6))]
    boom = engine.submit(request("boom", v0, 9))
    engine.run_until_idle()
    for stream in good:
        assert_complete(stream)
    assert boom.phase is Phase.FAILED
    assert "admit raised TypeError('a resource bug')" in boom.error
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_cancellation_frees_every_slot(programs):
    engine, (v0, v1) = make_engine(programs)
    doomed = engine.submit(request("doomed", v0, 40))
    kept = engine.submit(request("kept", v1, 14))
    for _ in range(12):
        engine.step()
    assert engine.talker.slot_of("doomed") is not None
    assert engine.flow.slot_of("doomed") is not None
    engine.cancel("doomed")
    assert doomed.phase is Phase.CANCELLED
    assert engine.talker.slot_of("doomed") is None
    assert engine.flow.slot_of("doomed") is None
    engine.run_until_idle()
    assert_complete(kept)
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots
    assert "doomed" not in engine.streams


def test_cancel_refuses_a_request_that_is_not_live_and_changes_nothing(programs):
    engine, (v0, _) = make_engine(programs)
    ended = engine.submit(request("ended", v0, 3))
    engine.run_until_idle()
    kept = engine.submit(request("kept", v0, 5))
    stats = engine.stats
    with pytest.raises(UnknownRequestError) as info:
        engine.cancel("never")
    assert str(info.value) == "request_id='never' is not a live request; live: ['kept']"
    with pytest.raises(UnknownRequestError) as info:  # a stream ends once: done stays done
        engine.cancel("ended")
    assert str(info.value) == "request_id='ended' is not a live request (it ended: done); live: ['kept']"
    assert ended.phase is Phase.DONE
    assert ended.failure is None
    assert kept.phase is Phase.WAITING
    assert list(engine.streams) == ["kept"]
    assert engine.stats == stats
    engine.cancel("kept")
    assert kept.phase is Phase.CANCELLED
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_a_voice_named_by_a_queued_request_cannot_be_replaced(programs):
    engine, (v0, _) = make_engine(programs)
    engine.submit(request("queued", v0, 5))  # not admitted yet: it holds no slot
    with pytest.raises(ValueError, match=r"voice 0 is named by live request\(s\) \['queued'\]"):
        engine.add_voice(0, frames=6, seed=99)
    engine.run_until_idle()
    engine.add_voice(0, frames=6, seed=99)  # free once the request finished


def test_a_dropped_stream_iterator_returns_its_slots(programs):
    engine, (v0, _) = make_engine(programs)
    chunks = engine.stream(request("dropped", v0, 20))
    next(chunks)
    chunks.close()
    assert engine.finished["dropped"].phase is Phase.CANCELLED
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots


def test_a_stream_cancelled_from_its_callback_ends_once(programs):
    engine, (v0, _) = make_engine(programs)
    stream = engine.submit(request("self", v0, 4), on_output=lambda chunk: engine.cancel("self"))
    engine.run_until_idle()
    assert stream.phase is Phase.CANCELLED
    assert (engine.stats.cancelled, engine.stats.done) == (1, 0)
    assert len(stream.chunks) == 1


def test_a_stream_idle_past_the_threshold_moves_to_host_memory(programs):
    now = [0.0]
    engine, (v0, v1) = make_engine(programs, offload_idle_after_s=1.0, clock=lambda: now[0])
    idle = engine.submit(request("idle", v0, 16))
    busy = engine.submit(request("busy", v1, 16))
    for _ in range(8):
        engine.step()
        now[0] += 0.01
    engine.pause("idle")
    now[0] += 0.6
    engine.step()  # the busy stream runs: only the paused one grows idle
    assert not engine.is_offloaded("idle")
    now[0] += 0.6
    engine.step()
    assert engine.is_offloaded("idle")
    assert not engine.is_offloaded("busy")
    engine.resume("idle")
    while engine.streams:
        engine.step()
        now[0] += 0.01
    assert_complete(idle)
    assert_complete(busy)
    assert engine.stats.reloads >= 1


def slot_bytes(engine: Engine, rid: str) -> list[np.ndarray]:
    out = []
    for manager in (engine.talker, engine.flow):
        slot = manager.slot_of(rid)
        out += [np.asarray(layer[slot]) for layer in (*manager.cache.k, *manager.cache.v)]
    return out


def test_offload_and_reload_are_bit_exact(programs):
    runs = {}
    for offload in (False, True):
        engine, (v0, v1) = make_engine(programs)
        target = engine.submit(request("target", v0, 26, seed=5))
        engine.submit(request("other", v1, 18, seed=6))
        for _ in range(14):  # the target is past the talker's ring wrap and has flow chunks written
            engine.step()
        engine.pause("target")
        if offload:
            before = slot_bytes(engine, "target")
            freed = engine.offload("target")
            assert freed == engine.talker.config.slot_bytes + engine.flow.config.slot_bytes
            assert engine.talker.slot_of("target") is None
        for _ in range(6):
            engine.step()
        if offload:
            # Dirty the freed slots, then reload: the request's bytes come back exactly.
            engine.submit(request("squatter", v1, 6, seed=7))
            engine.run_until_idle()
            for node in engine.nodes.values():
                assert node.runner.reload("target")
            for got, want in zip(slot_bytes(engine, "target"), before, strict=True):
                np.testing.assert_array_equal(got, want)
        engine.resume("target")
        engine.run_until_idle()
        assert_complete(target)
        runs[offload] = target
    np.testing.assert_array_equal(runs[True].codes, runs[False].codes)
    np.testing.assert_array_equal(runs[True].audio, runs[False].audio)


def test_no_compilation_after_warm_up_over_a_random_workload(programs):
    engine, voices = make_engine(programs)
    rng = np.random.default_rng(0)
    steps, submitted = 0, 0
    with assert_no_compilations("serving a random workload") as counter:
        voices.append(engine.add_voice(2, frames=3, seed=9))  # a voice added at run time
        while steps < 300:
            if rng.random() < 0.15 and len(engine.streams) < 5:
                voice = voices[int(rng.integers(len(voices)))]
                text_len, frames = int(rng.integers(1, 11)), int(rng.integers(1, 40))
                engine.submit(request(f"w{submitted}", voice, frames, text_len, seed=submitted))
                submitted += 1
            live = list(engine.streams)
            if live and rng.random() < 0.03:
                engine.cancel(live[int(rng.integers(len(live)))])
            elif live and rng.random() < 0.05:
                rid = live[int(rng.integers(len(live)))]
                engine.pause(rid)
                if rng.random() < 0.5:
                    engine.offload(rid)
            for stream in list(engine.streams.values()):
                if stream.paused and rng.random() < 0.2:
                    engine.resume(stream.request_id)
            if engine.step():
                steps += 1
            elif not engine.streams:
                steps += 1  # idle iterations count too: arrivals come at random
        for stream in engine.streams.values():
            stream.paused = False
        engine.run_until_idle()
    assert counter.count == 0
    assert engine.compilations == 0
    walks = {record.walk for record in engine.records}
    assert walks == {"talker_decode", "talker_prefill", "talker_mixed", "flow_chunk"}
    assert (
        max(r.positions[0] for r in engine.records if r.walk == "talker_decode")
        > engine.talker.config.slot_tokens
    )
    assert submitted >= 20
    assert all(s.phase.finished for s in engine.finished.values())


class CompilingReplay:
    """Wraps a captured step so that each replay also compiles a program of a new shape."""

    def __init__(self, captured):
        self.captured, self.calls = captured, 0

    def replay(self, bucket, *args):
        self.calls += 1
        jax.jit(lambda x: x + 1)(np.zeros(1000 + self.calls, np.float32)).block_until_ready()
        return self.captured.replay(bucket, *args)


def test_a_step_that_compiles_warns_and_is_counted(programs):
    engine, (v0, _) = make_engine(programs)
    engine.programs.steps["talker_prefill"], original = (
        CompilingReplay(engine.programs.steps["talker_prefill"]),
        engine.programs.steps["talker_prefill"],
    )
    try:
        engine.submit(request("r0", v0, 3))
        with pytest.warns(RecompileWarning, match="engine step talker_prefill"):
            engine.step()
    finally:
        engine.programs.steps["talker_prefill"] = original
    assert engine.compilations == 1
    assert engine.records[-1].compilations == 1


def test_mstar_jax_run_end_to_end_on_a_tiny_deployment(programs, cache_dir, tmp_path, capsys):
    deployment = {
        "model": {"name": "streaming_tts", "config": dataclasses.asdict(CONFIG)},
        "resources": {"talker_kv": {"max_slots": 2}, "flow_kv": {"max_slots": 2}},
        "compile": {
            "batch_sizes": list(BATCH_SIZES),
            "token_counts": list(TOKEN_COUNTS),
            "persistent_cache_dir": cache_dir,
            "persistent_cache_min_compile_secs": 0.0,
        },
        "engine": {"max_batch": 2, "hold_backoff_s": 0.001, "pipelined": True},
        "workload": {
            "streams": 5,
            "arrival_rate_hz": 50.0,
            "voices": 2,
            "min_text_tokens": 2,
            "max_text_tokens": 6,
            "min_frames": 6,
            "max_frames": 30,
            "seed": 1,
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(deployment))
    output = tmp_path / "run"
    assert cli.main(["run", "--config", str(path), "--output", str(output), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "5/5 done" in out
    assert out.splitlines()[-1] == cli.NEXT_STEPS  # what the README's first command ends with
    assert "0 compilations after warm-up" in out
    report = json.loads((output / "report.json").read_text())
    assert report["streams"]["done"] == 5
    assert report["compile"]["compilations_after_warmup"] == 0
    assert report["compile"]["buckets"] == 4
    assert report["compile"]["loaded_from_store"] == 4  # stored by the `programs` fixture
    assert report["pipeline"]["pipelined"]
    assert report["pipeline"]["rows_fed_on_device"] > 0
    assert f"{report['pipeline']['rows_fed_on_device']} decode rows fed on the device" in out
    assert report["audio_seconds"] > 0
    assert report["memory"]["bytes_per_stream"] == sum(s.config.slot_bytes for s in managers())
    assert (output / "step_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_programs_captured_for_another_model_are_refused(programs):
    """The captured programs are compiled for their model's settings (sampling temperature here): an
    engine whose model has other settings would run another model's programs, so it refuses them, naming
    each setting that differs with both values, and the fix."""
    model, captured = programs
    assert captured.settings == model.settings
    talker, flow = managers()
    colder = StreamingTTSModel(CONFIG, temperature=0.7)
    # One walk is enough: the engine checks the settings before it looks at the buckets.
    decode_only = Buckets((captured.buckets[TALKER_DECODE],))
    cold = TTSPrograms.capture(colder, decode_only, talker=talker, flow=flow, progress=False)
    assert cold.settings == colder.settings
    assert cold.settings.temperature == 0.7
    with pytest.raises(
        SettingsMismatchError, match=r"temperature: captured for 0\.7, this model has 1\.0"
    ) as err:
        Engine(model, talker=talker, flow=flow, programs=cold, **engine_kwargs())
    assert err.value.differences == (("temperature", 0.7, 1.0),)
    assert isinstance(err.value, ValueError)
    assert "TTSPrograms.capture(model, ...)" in str(err.value)
    same = StreamingTTSModel(CONFIG)  # another instance with the same settings is fine
    Engine(same, talker=talker, flow=flow, programs=captured, **engine_kwargs())
