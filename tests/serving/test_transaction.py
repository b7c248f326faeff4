"""The one step transaction every model's steps run through: declare (padded to a bucket) -> admit ->
plan -> replay -> install the caches -> commit, and abort on any error with nothing claimed left behind.

Outputs are checked against the float64 oracle of the stream (every key the request wrote, in order), the
bookkeeping against what a step that never ran leaves: the same free slots and committed lengths."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mstar_jax.resources.kv.bounded import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import PAD, AllocationFailed, BucketKey, Segment
from mstar_jax.serving import Resources, admit, declare, layer_attention, run_admitted
from tests.resources.kv.bounded.test_step_width import oracle

H, G, D = 4, 2, 8
CONFIG = BoundedKVConfig(
    num_layers=2, num_heads=G, head_dim=D, rows_per_request=1, max_source_len=0,
    retention=SinkWindow(0, 32), max_slots=2,
)  # fmt: skip
KEYS = ("a_kv", "b_kv")  # two caches declared with the same rows, as Gemma's local and global layers


def node(*rids: str) -> ResourceRunner:
    managers = {key: BoundedKVManager(BoundedKVSpec(key, {"node"}, CONFIG), num_sources=1) for key in KEYS}
    runner = ResourceRunner(managers)
    for rid in rids:
        runner.ingest_request(rid)
    return runner


def step_of(runner: ResourceRunner, spans: dict[str, int]) -> BoundedKVStep:
    return BoundedKVStep(
        tuple(Segment(rid, "main", span) for rid, span in spans.items()),
        {rid: Pos(0, runner[KEYS[0]].written(rid)) for rid in spans},
        dict(spans),
    )


def state(runner: ResourceRunner, rids=("a", "b", "c")) -> list:
    return [
        (m.free_slots, {rid: (m.slot_of(rid), m.written(rid)) for rid in rids})
        for m in (runner[key] for key in KEYS)
    ]


@jax.jit
def attention_step(caches, banks, plans, q, k, v):
    """Layer 1 of each cache attends and stores `q, k, v` (layer 0 stays unwritten)."""
    outs, new = [], []
    for cache, bank, plan in zip(caches, banks, plans, strict=True):
        out, cache = layer_attention(CONFIG, bank, plan, implementation="xla")(cache, 1, q, k, v)
        outs.append(out)
        new.append(cache)
    return tuple(new), tuple(outs)


def test_declare_pads_once_and_declares_the_same_rows_on_every_cache():
    runner = node("a", "b")
    declared = declare(KEYS, step_of(runner, {"a": 3, "b": 1}), BucketKey("prefill", 4, 4))
    ids = [seg.request_id for seg in declared.padded.step.segments]
    assert ids == ["a", "b", f"{PAD}0", f"{PAD}1"]
    assert declared.sub.steps == dict.fromkeys(KEYS, declared.padded.step)
    assert declared.sub.ctx is declared.padded.ctx
    assert declared.bucket == BucketKey("prefill", 4, 4)
    with pytest.raises(ValueError, match=r"keys=\(\) must name at least one cache"):
        declare((), step_of(runner, {"a": 3}), BucketKey("prefill", 4, 4))


def test_steps_through_the_transaction_attend_what_each_stream_wrote():
    runner, rng = node("a", "b"), np.random.default_rng(0)
    bucket = BucketKey("prefill", 2, 4)
    written = {"a": [], "b": []}
    for spans in ({"a": 3, "b": 4}, {"a": 1, "b": 1}, {"a": 2}):
        declared = declare(KEYS, step_of(runner, spans), bucket)
        assert admit(runner, declared).ok
        q = [rng.standard_normal((n, H, D)).astype(np.float32) for n in spans.values()]
        k = [rng.standard_normal((n, G, D)).astype(np.float32) for n in spans.values()]
        v = [rng.standard_normal((n, G, D)).astype(np.float32) for n in spans.values()]
        args = [declared.padded.pad(x, dtype=np.float32) for x in (q, k, v)]

        def replay(resources: Resources, args=args):
            return attention_step(resources.caches, resources.banks, resources.plans, *args)

        outs = run_admitted(runner, declared, replay)
        for cache_out in outs:  # both caches hold the same stream: the same attention
            got = declared.padded.unpad(np.asarray(cache_out))
            for b, rid in enumerate(spans):
                keys = np.concatenate([x for x, _ in written[rid]] + [k[b]])
                values = np.concatenate([x for _, x in written[rid]] + [v[b]])
                retained = len(keys) - len(k[b])
                want = oracle(keys, values, q[b], retained=retained)
                np.testing.assert_allclose(got[b, : len(q[b])], want, rtol=1e-5, atol=1e-6)
        for b, rid in enumerate(spans):
            written[rid].append((k[b], v[b]))
    assert [runner[key].written("a") for key in KEYS] == [6, 6]
    assert [runner[key].written("b") for key in KEYS] == [5, 5]


def test_a_replay_that_raises_leaves_nothing_claimed():
    runner = node("a", "b", "c")
    before = state(runner)
    declared = declare(KEYS, step_of(runner, {"a": 2, "b": 1}), BucketKey("prefill", 2, 4))
    assert admit(runner, declared).ok
    assert state(runner) != before  # admission claimed slots

    def replay(resources: Resources):
        raise RuntimeError("the device failed")

    with pytest.raises(RuntimeError, match="the device failed"):
        run_admitted(runner, declared, replay)
    assert state(runner) == before
    # The same step runs once the fault is gone: the abort left it admissible from scratch.
    again = declare(KEYS, step_of(runner, {"a": 2, "b": 1}), BucketKey("prefill", 2, 4))
    assert admit(runner, again).ok


def test_an_abort_that_raises_too_keeps_the_steps_error_and_notes_the_other():
    runner = node("a")
    declared = declare(KEYS, step_of(runner, {"a": 1}), BucketKey("decode", 1, 1))
    assert admit(runner, declared).ok

    def abort_fails(step, ctx=None):
        raise OSError("abort broke")

    runner[KEYS[1]].abort_step = abort_fails

    def replay(resources: Resources):
        raise RuntimeError("the device failed")

    with pytest.raises(RuntimeError, match="the device failed") as info:
        run_admitted(runner, declared, replay)
    noted = "aborting the step's admission raised too: OSError('abort broke')"
    assert noted in info.value.__notes__
    assert runner[KEYS[0]].slot_of("a") is None  # the other cache gave its claim back all the same


def test_a_replay_returning_the_wrong_caches_is_refused_and_aborted():
    runner = node("a")
    before = state(runner, "a")
    declared = declare(KEYS, step_of(runner, {"a": 1}), BucketKey("decode", 1, 1))
    assert admit(runner, declared).ok
    with pytest.raises(ValueError, match=r"replay returned 1 caches; the step runs on 2"):
        run_admitted(runner, declared, lambda resources: ((resources.caches[0],), None))
    assert state(runner, "a") == before


def test_a_refused_admission_claims_nothing():
    runner = node("a", "b", "c")
    first = declare(KEYS, step_of(runner, {"a": 1, "b": 1}), BucketKey("decode", 2, 1))
    assert admit(runner, first).ok
    run_admitted(runner, first, lambda r: (r.caches, None))
    before = state(runner)
    late = declare(KEYS, step_of(runner, {"c": 1}), BucketKey("decode", 1, 1))
    outcome = admit(runner, late)  # both slots are taken
    assert not outcome.ok
    assert isinstance(outcome.reason, AllocationFailed)
    assert state(runner) == before


def test_layer_attention_reads_without_writing_when_asked():
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, CONFIG), num_sources=1)
    manager.ingest_request("a")
    step = BoundedKVStep((Segment("a", "main", 2),), {"a": Pos(0, 0)}, {"a": 2})
    assert manager.admit(step).ok
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, H, D)).astype(np.float32)
    k = rng.standard_normal((1, 2, G, D)).astype(np.float32)
    before = [np.asarray(x) for x in jax.tree.leaves(manager.cache)]
    fn = layer_attention(CONFIG, manager.bank, manager.plan(step), implementation="xla", write=False)
    out, cache = fn(manager.cache, 0, q, k, k)
    for got, want in zip(jax.tree.leaves(cache), before, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(out)[0], oracle(k[0], k[0], q[0], retained=0), rtol=1e-5, atol=1e-6)
