"""Capture and replay of the bounded KV attention step: every bucket compiled once from abstract
arguments, padded replays equal to the unpadded `jit` row by row, nothing compiled while serving, the
cache really donated, and the persistent cache loading what a previous capture wrote."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.compile import pad_batch
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import (
    BucketSet,
    NoBucketError,
    ReplayError,
    assert_no_compilations,
    capture,
    count_compilations,
    disable_persistent_cache,
    enable_persistent_cache,
)
from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, SinkWindow

CONFIG = BoundedKVConfig(
    num_layers=1, num_heads=2, head_dim=8, rows_per_request=2, max_source_len=4, min_source_len=0,
    retention=lambda s: SinkWindow(s + 2, 6), max_slots=4,
)  # fmt: skip
HEADS = 4  # query heads: two per KV head
SOURCES = 2
R = CONFIG.rows_per_request
# Few buckets: each XLA:CPU compile of the attention step takes about a second.
BUCKETS = BucketSet(graph_walk="attend", batch_sizes=(1, 3), token_counts=(1, 4))


def step(cache, bank, table, q, k, v, *, config):
    """Every layer attends the same step tokens; the output sums the layers (so each one counts)."""
    plan, total = BoundedKVPlan(table), jnp.zeros(q.shape, jnp.float32)
    for layer in range(config.num_layers):
        out, cache = attend(cache, bank, plan, layer, q, k, v, config=config, implementation="xla")
        total = total + out
    return cache, total


def abstract_args(bucket):
    n, t, f32 = bucket.bs * R, bucket.num_tokens, jnp.float32
    return (
        BoundedKVCache.abstract(CONFIG),
        SourceBank.abstract(CONFIG, SOURCES),
        jax.ShapeDtypeStruct((bucket.bs, tbl.ROW_INTS), jnp.int32),
        jax.ShapeDtypeStruct((n, t, HEADS, CONFIG.head_dim), f32),
        jax.ShapeDtypeStruct((n, t, CONFIG.num_heads, CONFIG.head_dim), f32),
        jax.ShapeDtypeStruct((n, t, CONFIG.num_heads, CONFIG.head_dim), f32),
    )


@pytest.fixture(scope="module")
def captured():
    return capture(
        step, BUCKETS, abstract_args, static_kwargs={"config": CONFIG}, donate_argnums=0, progress=False
    )


@functools.cache
def uncaptured():
    return jax.jit(step, donate_argnums=0, static_argnames=("config",))


def random_state(rng):
    """A cache and bank of random entries: whatever a plan reads is real data."""
    cache = jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), BoundedKVCache.abstract(CONFIG)
    )
    bank = jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), SourceBank.abstract(CONFIG, SOURCES)
    )
    return cache, jax.device_put(bank)


def random_batch(rng, bs: int, tokens: int):
    """A plan for `bs` requests in distinct slots and their step tokens; the first row brings `tokens`."""
    step_tokens = rng.integers(1, tokens + 1, bs)
    step_tokens[0] = tokens
    source_len = rng.integers(0, CONFIG.max_source_len + 1, bs)
    policies = [CONFIG.retention_for(int(s)) for s in source_len]
    table = layout.plan_table(
        slot=rng.permutation(CONFIG.max_slots)[:bs], source=rng.integers(0, SOURCES, bs),
        source_len=source_len,
        written=rng.integers(0, 20, bs), span=rng.integers(0, step_tokens + 1), step_tokens=step_tokens,
        sink=[p.sink for p in policies], window=[p.window for p in policies], window_includes_step=False,
        sink_capacity=CONFIG.sink_capacity, reverse=False, slot_tokens=CONFIG.slot_tokens,
    )  # fmt: skip
    n, d = bs * R, CONFIG.head_dim
    q = rng.standard_normal((n, tokens, HEADS, d)).astype(np.float32)
    k = rng.standard_normal((n, tokens, CONFIG.num_heads, d)).astype(np.float32)
    v = rng.standard_normal((n, tokens, CONFIG.num_heads, d)).astype(np.float32)
    return table, q, k, v


def test_every_bucket_is_compiled_with_a_report(captured):
    assert set(captured.programs) == set(BUCKETS.keys())
    assert len(captured) == len(BUCKETS) == 4
    report = captured.report
    assert [b.bucket for b in report.buckets] == list(BUCKETS.keys())
    cache_bytes = BoundedKVCache.create(CONFIG).nbytes
    for b in report.buckets:
        assert b.compile_secs > 0
        assert b.lower_secs > 0
        assert not b.from_cache
        # XLA:CPU reports every field (generated code as 0); other backends may give None.
        for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes"):
            assert isinstance(getattr(b, field), int), field
        # The donated cache comes back in place: its bytes are aliased, argument to output.
        assert b.alias_bytes == cache_bytes
        assert b.argument_bytes >= cache_bytes
    assert report.compile_secs == pytest.approx(sum(b.compile_secs for b in report.buckets))
    text = str(report)
    assert all(str(key) in text for key in BUCKETS)
    assert "4 buckets" in text


@pytest.mark.parametrize(("bs", "tokens"), [(1, 1), (2, 3), (3, 2)])
def test_padded_replay_equals_unpadded_jit_row_by_row(captured, bs, tokens):
    rng = np.random.default_rng(bs * 10 + tokens)
    cache, bank = random_state(rng)
    table, q, k, v = random_batch(rng, bs, tokens)
    bucket = BUCKETS.bucket_for(bs, tokens)

    padded_cache = jax.device_put(cache)
    # Padding rows read and write nothing, and q, k, v's padding is NaN: it must never be read.
    padded = pad_batch(bucket, CONFIG, table, q, k, v, fill=np.nan)
    new_cache, out = captured.replay(bucket, padded_cache, bank, *padded)
    out = np.asarray(out)[: bs * R, :tokens]
    assert padded_cache.k[0].is_deleted()  # donated, not copied

    want_cache, want = uncaptured()(jax.device_put(cache), bank, table, q, k, v, config=CONFIG)
    assert out.shape == (bs * R, tokens, HEADS, CONFIG.head_dim)
    assert np.isfinite(out).all()
    for row in range(bs * R):
        np.testing.assert_allclose(
            out[row], np.asarray(want)[row], rtol=2e-5, atol=2e-6, err_msg=f"row {row}"
        )
    # Padding rows wrote nothing: every slot, the padding slot included, holds what the real rows left.
    for got_layer, want_layer in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got_layer), np.asarray(want_layer))


def test_serving_compiles_nothing_whatever_the_batch(captured):
    rng = np.random.default_rng(7)
    cache, bank = random_state(rng)
    cache = jax.device_put(cache)
    with assert_no_compilations("replaying captured buckets"), count_compilations() as counter:
        for _ in range(40):
            bs, tokens = int(rng.integers(1, 4)), int(rng.integers(1, 5))
            table, q, k, v = random_batch(rng, bs, tokens)
            bucket = BUCKETS.bucket_for(bs, tokens)
            cache, out = captured.replay(bucket, cache, bank, *pad_batch(bucket, CONFIG, table, q, k, v))
            assert out.shape[:2] == (bucket.bs * R, bucket.num_tokens)
            assert np.isfinite(np.asarray(out)[: bs * R, :tokens]).all()
    assert counter.count == 0


def test_wrong_shapes_raise_and_never_compile(captured):
    rng = np.random.default_rng(3)
    cache, bank = random_state(rng)
    table, q, k, v = random_batch(rng, 3, 4)
    bucket = BUCKETS.key(3, 4)
    with count_compilations() as counter:
        with pytest.raises(ReplayError, match=re.escape(f"bucket {bucket}")):
            captured.replay(bucket, jax.device_put(cache), bank, table, q[:, :2], k[:, :2], v[:, :2])
        with pytest.raises(ReplayError, match="Pad the batch"):
            captured.replay(bucket, jax.device_put(cache), bank, table, q.astype(np.float16), k, v)
        with pytest.raises(NoBucketError, match="was not captured"):
            captured.replay(dataclasses.replace(bucket, bs=2), jax.device_put(cache), bank, table, q, k, v)
    assert counter.count == 0


def test_reusing_a_donated_cache_is_refused_with_the_fix(captured):
    rng = np.random.default_rng(4)
    cache, bank = random_state(rng)
    table, q, k, v = random_batch(rng, 1, 1)
    cache = jax.device_put(cache)
    captured.replay(BUCKETS.key(1, 1), cache, bank, table, q, k, v)
    with pytest.raises(ValueError, match=r"donated to an earlier step.*previous step returned"):
        captured.replay(BUCKETS.key(1, 1), cache, bank, table, q, k, v)


def test_abstract_arguments_must_be_shape_dtype_structs():
    def eager_args(bucket):
        return (jnp.zeros((bucket.bs,)),)

    with pytest.raises(TypeError, match=r"args\[0\] = .*jax.ShapeDtypeStruct"):
        capture(
            lambda x: x,
            BucketSet(graph_walk="w", batch_sizes=(1,), token_counts=(1,)),
            eager_args,
            progress=False,
        )
    with pytest.raises(ValueError, match="buckets is empty"):
        capture(lambda x: x, (), eager_args, progress=False)


def _tiny(x, *, scale):
    return jnp.tanh(x * scale).sum(axis=1)


def test_persistent_cache_serves_a_second_capture(tmp_path):
    buckets = BucketSet(graph_walk="tiny", batch_sizes=(1, 2), token_counts=(5,))

    def abstract(bucket):
        return (jax.ShapeDtypeStruct((bucket.bs, bucket.num_tokens), jnp.float32),)

    enable_persistent_cache(str(tmp_path), min_compile_secs=0, min_entry_size_bytes=-1)
    try:
        first = capture(_tiny, buckets, abstract, static_kwargs={"scale": 0.5}, progress=False)
        assert first.report.cache_hits == 0
        assert any(tmp_path.iterdir()), "the first capture wrote no cache entries"
        jax.clear_caches()  # a second start: nothing compiled in memory, only what is on disk
        second = capture(_tiny, buckets, abstract, static_kwargs={"scale": 0.5}, progress=True, max_workers=2)
        assert second.report.cache_hits == len(buckets)
        assert all(b.from_cache for b in second.report.buckets)
    finally:
        disable_persistent_cache()
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_allclose(
        np.asarray(second.replay(buckets.key(2, 5), x)), np.tanh(x * 0.5).sum(1), rtol=1e-6
    )
