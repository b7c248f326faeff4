"""A step's width (its arrays carry exactly the tokens it declares), the plan's accessors and `attend`'s
options, against values computed by hand or by a float64 oracle that attends the whole stream as
docs/design.md §3 defines it (the streams here are shorter than the window: every entry is retained)."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

from mstar_jax.resources.kv.bounded import attention
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import make_mesh, place_on_mesh, sharded_attend
from mstar_jax.resources.step import PAD, BucketKey, Segment, StepContext

H, G, D = 4, 2, 8
CONFIG = BoundedKVConfig(
    num_layers=1, num_heads=G, head_dim=D, rows_per_request=1, max_source_len=4,
    retention=SinkWindow(4, 16), max_slots=3,
)  # fmt: skip
run = jax.jit(partial(attend, layer=0, config=CONFIG, implementation="xla"))


def oracle(keys, values, q, *, retained, bias=None, sinks=None):
    """keys, values [K, G, D] (retained ++ own, in stream order), q [T, H, D] -> f64[T, H, D]."""
    keys, values, q = (np.asarray(x, np.float64) for x in (keys, values, q))
    (tokens, heads, dim), groups = q.shape, keys.shape[1]
    out = np.zeros(q.shape)
    for i in range(tokens):
        for h in range(heads):
            g = h // (heads // groups)
            raw = keys[:, g] @ q[i, h]
            if bias is not None:  # Transformer-XL: the compacted distance of query i to key j
                raw = raw + bias[h, i, (retained + i) - np.arange(len(keys)) + tokens - 1]
            scores = raw / np.sqrt(dim)
            top = scores.max() if sinks is None else max(scores.max(), sinks[h])
            weights = np.exp(scores - top)
            denominator = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[i, h] = weights @ values[:, g] / denominator
    return out


def manager_with(*rids: str) -> BoundedKVManager:
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, CONFIG), num_sources=1)
    for rid in rids:
        manager.ingest_request(rid)
    return manager


def draw(rng, tokens: int, heads: int, rows: int = 1) -> np.ndarray:
    return rng.standard_normal((rows, tokens, heads, D)).astype(np.float32)


def test_a_decode_step_given_lookahead_arrays_is_refused_and_changes_nothing(rng):
    manager = manager_with("a")
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)})  # span 1, no step_tokens
    assert manager.admit(step).ok
    plan = manager.plan(step)
    assert plan.num_tokens == 1  # max(span, 1)
    cache = manager.take_cache()
    q, k = draw(rng, 3, H), draw(rng, 3, G)
    message = r"q carries 3 tokens per row \(q.shape=\(1, 3, 4, 8\)\).*plan.num_tokens=1.*step_tokens"
    donating = jax.jit(partial(attend, layer=0, config=CONFIG), donate_argnums=0)
    for fn in (run, donating, partial(attend, layer=0, config=CONFIG)):
        with pytest.raises(ValueError, match=message):
            fn(cache, manager.bank, plan, q=q, k=k, v=k)
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))  # refused while tracing: not donated
    assert manager.written("a") == 0
    out, cache = run(cache, manager.bank, plan, q=q[:, :1], k=k[:, :1], v=k[:, :1])  # the same step, right
    manager.commit(step)
    assert manager.written("a") == 1
    np.testing.assert_allclose(out[0], oracle(k[0, :1], k[0, :1], q[0, :1], retained=0), rtol=1e-5, atol=1e-6)


def test_arrays_narrower_than_the_declared_tokens_are_refused(rng):
    manager = manager_with("a")
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)}, {"a": 3})
    assert manager.admit(step).ok
    plan = manager.plan(step)
    with pytest.raises(ValueError, match=r"q carries 2 tokens.*rows of up to 3 \(plan.num_tokens=3\)"):
        run(manager.take_cache(), manager.bank, plan, q=draw(rng, 2, H), k=draw(rng, 2, G), v=draw(rng, 2, G))


def test_declared_lookahead_is_attended_and_only_the_span_is_kept(rng):
    manager = manager_with("a")
    cache = manager.take_cache()
    # Step 1: 3 tokens, the first 2 written; every query sees all 3 own keys (no query_window).
    step = BoundedKVStep((Segment("a", "main", 2),), {"a": Pos(0, 0)}, {"a": 3})
    assert manager.admit(step).ok
    plan = manager.plan(step)
    assert plan.num_tokens == 3
    q, k, v = draw(rng, 3, H), draw(rng, 3, G), draw(rng, 3, G)
    out, cache = run(cache, manager.bank, plan, q=q, k=k, v=v)
    manager.commit(step)
    np.testing.assert_allclose(out[0], oracle(k[0], v[0], q[0], retained=0), rtol=1e-5, atol=1e-6)
    # Step 2, a decode: it sees the 2 written entries (not the lookahead token) and its own key.
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 2)})
    assert manager.admit(step).ok
    q2, k2, v2 = draw(rng, 1, H), draw(rng, 1, G), draw(rng, 1, G)
    out, cache = run(cache, manager.bank, manager.plan(step), q=q2, k=k2, v=v2)
    keys, values = np.concatenate([k[0, :2], k2[0]]), np.concatenate([v[0, :2], v2[0]])
    np.testing.assert_allclose(out[0], oracle(keys, values, q2[0], retained=2), rtol=1e-5, atol=1e-6)


def test_bucket_padding_stays_legal(rng):
    manager = manager_with("a")
    step = BoundedKVStep((Segment("a", "main", 2), Segment(f"{PAD}0", "main", 0)), {"a": Pos(0, 0)}, {"a": 2})
    ctx = StepContext.for_step(step, BucketKey("walk", 2, 4))
    assert manager.admit(step, ctx).ok
    plan = manager.plan(step, ctx)
    assert plan.num_tokens == 4  # planned for the bucket: its arrays are the bucket's width
    q, k, v = draw(rng, 4, H, rows=2), draw(rng, 4, G, rows=2), draw(rng, 4, G, rows=2)
    for x in (q, k, v):
        x[0, 2:] = x[1] = np.nan  # padding tokens and the padding row are never read
    cache = manager.take_cache()
    with pytest.raises(ValueError, match=r"q carries 2 tokens per row .*plan.num_tokens=4.*PaddedStep.pad"):
        run(cache, manager.bank, plan, q=q[:, :2], k=k[:, :2], v=v[:, :2])  # not padded to the bucket
    out, _ = run(cache, manager.bank, plan, q=q, k=k, v=v)
    out = np.asarray(out)
    np.testing.assert_allclose(
        out[0, :2], oracle(k[0, :2], v[0, :2], q[0, :2], retained=0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(out[0, 2:], 0)
    np.testing.assert_array_equal(out[1], 0)


def test_a_plans_width_is_its_widest_declared_row():
    manager = manager_with("a", "b")
    step = BoundedKVStep(
        (Segment("a", "main", 2), Segment("b", "main", 0)), {"a": Pos(0, 0), "b": Pos(0, 0)}, {"b": 5}
    )
    assert manager.admit(step).ok
    assert manager.plan(step).num_tokens == 5  # a brings max(2, 1) = 2, b declares 5
    padding_only = BoundedKVStep((Segment(f"{PAD}0", "main", 0),))
    assert manager.plan(padding_only).num_tokens is None  # no real row: nothing to lose
    table = np.zeros((1, 16), np.int32)
    assert BoundedKVPlan(table, num_tokens=np.int64(3)).num_tokens == 3
    assert type(BoundedKVPlan(table, num_tokens=np.int64(3)).num_tokens) is int
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"num_tokens={bad!r} must be None or an int >= 1"):
            BoundedKVPlan(table, num_tokens=bad)
    # Static: plans of different widths are different pytrees (a new width retraces).
    assert jax.tree.structure(BoundedKVPlan(table, 2)) != jax.tree.structure(BoundedKVPlan(table, 3))
    assert jax.tree.leaves(BoundedKVPlan(table, 2))[0] is table


def test_sharded_attend_checks_the_width_too(rng):
    mesh = make_mesh(1, 1)
    manager = manager_with("a")
    place_on_mesh(manager, mesh)
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)})
    assert manager.admit(step).ok
    with pytest.raises(ValueError, match=r"q carries 2 tokens.*plan.num_tokens=1"):
        sharded_attend(
            mesh, manager.cache, manager.bank, manager.plan(step), 0, draw(rng, 2, H), draw(rng, 2, G),
            draw(rng, 2, G), config=CONFIG, implementation="xla",
        )  # fmt: skip


def test_plan_accessors_read_the_table_for_the_model(rng):
    manager = manager_with("a", "b")
    source = rng.standard_normal((1, 1, G, 3, D)).astype(np.float32)
    manager.register_source(0, source, source)
    prefix = BoundedKVStep((Segment("a", "main", 5),), {"a": Pos(3, 0)})
    assert manager.admit(prefix).ok
    manager.commit(prefix)  # bookkeeping only: the accessors read the plan, not the cache
    step = BoundedKVStep(
        (Segment("a", "main", 1), Segment("b", "main", 1), Segment(f"{PAD}0", "main", 0)),
        {"a": Pos(3, 5), "b": Pos(0, 0)},
        {"a": 2},
    )
    assert manager.admit(step).ok
    plan = manager.plan(step)
    # a: n = 3 source + 5 written = 8; b: n = 0; the padding row plans empty.
    np.testing.assert_array_equal(plan.stream_lengths(), [8, 0, 0])
    np.testing.assert_array_equal(plan.positions(3), [[8, 9, 10], [0, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(plan.step_tokens(), [2, 1, 0])
    traced = jax.jit(lambda p: p.positions(2))(plan)  # the same inside jit, where the model calls it
    np.testing.assert_array_equal(traced, [[8, 9], [0, 1], [0, 1]])
    assert plan.positions(0).shape == (3, 0)
    with pytest.raises(ValueError, match=r"num_tokens=-1 must be an int >= 0"):
        plan.positions(-1)


def test_read_only_attend_returns_the_cache_unchanged(rng):
    manager = manager_with("a")
    cache = manager.take_cache()
    step = BoundedKVStep((Segment("a", "main", 2),), {"a": Pos(0, 0)})
    assert manager.admit(step).ok
    plan = manager.plan(step)
    q, k, v = draw(rng, 2, H), draw(rng, 2, G), draw(rng, 2, G)
    read, same = attend(
        cache, manager.bank, plan, 0, q, k, v, config=CONFIG, implementation="xla", write=False
    )
    assert same is cache
    written, stored = attend(cache, manager.bank, plan, 0, q, k, v, config=CONFIG, implementation="xla")
    np.testing.assert_array_equal(read, written)  # the same attention; only the store differs
    slot = manager.slot_of("a")
    np.testing.assert_array_equal(np.asarray(stored.k[0])[slot, 0, :, :2], k[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(np.asarray(cache.k[0]), 0)


@pytest.mark.parametrize("terms", ["rel_bias", "sink_logits", "both"])
def test_score_terms_match_the_oracle(rng, terms):
    manager = manager_with("a")
    cache = manager.take_cache()
    prefix = BoundedKVStep((Segment("a", "main", 3),), {"a": Pos(0, 0)})  # 3 entries to retain
    assert manager.admit(prefix).ok
    k0, v0 = draw(rng, 3, G), draw(rng, 3, G)
    _, cache = run(cache, manager.bank, manager.plan(prefix), q=draw(rng, 3, H), k=k0, v=v0)
    manager.commit(prefix)
    step = BoundedKVStep((Segment("a", "main", 2),), {"a": Pos(0, 3)})
    assert manager.admit(step).ok
    tokens = 2
    q, k, v = draw(rng, tokens, H), draw(rng, tokens, G), draw(rng, tokens, G)
    width = CONFIG.max_retained + 2 * tokens - 1  # RB
    bias = rng.standard_normal((1, H, tokens, width)).astype(np.float32) if terms != "sink_logits" else None
    sinks = rng.standard_normal(H).astype(np.float32) if terms != "rel_bias" else None
    out, _ = run(cache, manager.bank, manager.plan(step), q=q, k=k, v=v, rel_bias=bias, sink_logits=sinks)
    keys, values = np.concatenate([k0[0], k[0]]), np.concatenate([v0[0], v[0]])
    expected = oracle(keys, values, q[0], retained=3, bias=None if bias is None else bias[0], sinks=sinks)
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
    plain = oracle(keys, values, q[0], retained=3)
    assert np.abs(expected - plain).max() > 1e-2  # the terms matter here


def test_absent_score_terms_are_not_passed_to_the_op(monkeypatch, rng):
    seen = []

    def spy(*args, **kwargs):
        seen.append(sorted(kwargs))
        return args[0]

    monkeypatch.setattr(attention, "sink_window_attention", spy)
    manager = manager_with("a")
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)})
    assert manager.admit(step).ok
    args = (manager.take_cache(), manager.bank, manager.plan(step), 0, draw(rng, 1, H), draw(rng, 1, G))
    attend(*args, args[-1], config=CONFIG, write=False)
    attend(*args, args[-1], config=CONFIG, write=False, rel_bias=np.zeros(1), sink_logits=np.zeros(H))
    common = ["implementation", "interpret", "max_retained", "query_window", "scale"]
    assert seen == [common, sorted([*common, "rel_bias", "sink_logits"])]
