"""The whole bounded KV cache (manager + layout + cache writes + XLA attention) against a brute-force oracle.

The oracle keeps every request's stream whole, in float64, and attends `stream[R] ++ step keys`
straight from the definition in docs/design.md §3; it never sees a slot, a ring or a plan table.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.resources.kv.bounded import planning
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import (
    AdmitRuntimeError,
    BucketKey,
    Segment,
    SlotLease,
    StepContext,
    StepNotAdmittedError,
)


@partial(jax.jit, static_argnames=("config", "implementation"), donate_argnums=0)
def run_step(cache, bank, plan, q, k, v, *, config, implementation="xla"):
    outs = []
    for layer in range(config.num_layers):
        out, cache = attend(
            cache,
            bank,
            plan,
            layer,
            q[layer],
            k[layer],
            v[layer],
            config=config,
            implementation=implementation,
        )
        outs.append(out)
    return cache, jnp.stack(outs)


@dataclasses.dataclass
class OracleStream:
    """One request's whole stream per layer: keys and values [L, R, G, n, D] in float64."""

    k: np.ndarray
    v: np.ndarray
    policy: SinkWindow

    def retained(self, span: int) -> np.ndarray:
        n = self.k.shape[3]
        sink, window, includes_step = self.policy
        w = max(0, window - span) if includes_step else window
        return np.concatenate([np.arange(min(sink, n)), np.arange(max(sink, n - w), n)]).astype(int)

    def append(self, k_new: np.ndarray, v_new: np.ndarray, reverse: bool) -> None:
        order = slice(None, None, -1) if reverse else slice(None)
        self.k = np.concatenate([self.k, k_new[..., order, :]], axis=3)
        self.v = np.concatenate([self.v, v_new[..., order, :]], axis=3)


def oracle_attention(stream: OracleStream, q, k, v, span, tokens, query_window, scale):
    """q [L, R, T, H, D], k/v [L, R, T, G, D] (one request) -> [L, R, tokens, H, D] float64."""
    n = stream.k.shape[3]
    kept = stream.retained(span)
    heads, groups = q.shape[3], k.shape[3]
    out = np.zeros((*q.shape[:2], tokens, heads, q.shape[-1]))
    key_pos = np.concatenate([kept, n + np.arange(tokens)])
    head_group = np.arange(heads) // (heads // groups)  # the KV head each query head reads
    for layer in range(q.shape[0]):
        for c in range(q.shape[1]):
            keys = np.concatenate(
                [stream.k[layer, c][:, kept], k[layer, c, :tokens].transpose(1, 0, 2)], axis=1
            )
            vals = np.concatenate(
                [stream.v[layer, c][:, kept], v[layer, c, :tokens].transpose(1, 0, 2)], axis=1
            )
            for i in range(tokens):
                visible = np.ones(len(key_pos), bool)
                if query_window is not None:
                    p = n + i
                    visible = (key_pos <= p) & ((key_pos < stream.policy.sink) | (key_pos > p - query_window))
                scores = np.einsum("hkd,hd->hk", keys[head_group][:, visible], q[layer, c, i]) * scale
                weights = np.exp(scores - scores.max(axis=1, keepdims=True))
                weights /= weights.sum(axis=1, keepdims=True)
                out[layer, c, i] = np.einsum("hk,hkd->hd", weights, vals[head_group][:, visible])
    return out


def random_config(rng: np.random.Generator) -> BoundedKVConfig:
    max_source_len = int(rng.integers(0, 10))
    min_source_len = int(rng.integers(0, max_source_len + 1))
    sink_extra, window = int(rng.integers(0, 6)), int(rng.integers(0, 9))
    includes_step = bool(rng.random() < 0.3)
    mode = rng.integers(3)
    if mode == 0:  # a constant policy: the sink may be shorter or longer than the source
        retention = SinkWindow(int(rng.integers(0, 8)), window, includes_step)
    elif mode == 1:  # the voice plus a few tokens (the talker's policy)
        retention = lambda s: SinkWindow(s + sink_extra, window, includes_step)  # noqa: E731
    else:  # the flow decoder's policy: sink = voice, window grows with the voice
        retention = lambda s: SinkWindow(s, window + s // 2, includes_step)  # noqa: E731
    order = rng.integers(3)
    groups = int(rng.integers(1, 3))
    return BoundedKVConfig(
        num_layers=int(rng.integers(1, 3)),
        num_heads=groups,
        head_dim=8,
        rows_per_request=int(rng.integers(1, 3)),
        max_source_len=max_source_len,
        min_source_len=min_source_len,
        retention=retention,
        max_slots=4,
        reverse_step_order=bool(order == 1),
        query_window=int(rng.integers(1, 6)) if order == 2 else None,
    )


def declared_step(cfg, bucket, batch, spans, positions, tokens, steps: int = 1):
    """The step of `batch` (its `spans` and `tokens`), padded to the cache's slots, and its context."""
    padding = [f"pad{i}" for i in range(cfg.max_slots - len(batch))]
    ctx = StepContext(batch, "decode", 0, capture=False, slot_lease=SlotLease(0, bucket))
    ctx.set_padded_rids(batch + padding)
    step = BoundedKVStep(
        tuple(Segment(rid, "main", spans[rid]) for rid in batch)
        + tuple(Segment(p, "main", 0) for p in padding),
        positions={rid: positions[rid] for rid in batch},
        step_tokens=tokens,
        steps=steps,
    )
    return step, ctx


def assert_only_these_slots_changed(before, after, touched, cfg, label: str = "") -> None:
    """Every slot but `touched` holds the same keys and values `after` as `before`."""
    for layer in range(cfg.num_layers):
        for old, new in ((before.k[layer], after.k[layer]), (before.v[layer], after.v[layer])):
            for slot in set(range(cfg.max_slots + 1)) - touched:
                np.testing.assert_array_equal(old[slot], new[slot], err_msg=f"{label}slot {slot} changed")


def run_random_streams(seed: int, steps: int = 60, implementation: str = "xla") -> int:
    """Drive random streams through the manager and compare every output with the oracle."""
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, cfg), num_sources=3)
    L, R, G, D = cfg.num_layers, cfg.rows_per_request, cfg.num_heads, cfg.head_dim
    H = G * int(rng.integers(1, 3))
    T = int(rng.integers(1, 5))
    sources = {}
    for index in range(3):
        length = int(rng.integers(cfg.min_source_len, cfg.max_source_len + 1))
        sources[index] = (
            rng.standard_normal((L, R, G, length, D)),
            rng.standard_normal((L, R, G, length, D)),
        )
        manager.register_source(index, list(sources[index][0]), list(sources[index][1]))
    streams: dict[str, OracleStream] = {}
    positions: dict[str, Pos] = {}
    scale = 1 / np.sqrt(D)
    next_id, finished = 0, 0
    bucket = BucketKey("decode", cfg.max_slots, T)
    for _ in range(steps):
        if len(streams) < cfg.max_slots and rng.random() < 0.5:  # an arrival
            rid, next_id = f"r{next_id}", next_id + 1
            source = int(rng.integers(0, 3))
            src_k, src_v = sources[source]
            source_len = int(rng.integers(cfg.min_source_len, src_k.shape[3] + 1))
            manager.ingest_request(rid)
            streams[rid] = OracleStream(
                src_k[..., :source_len, :].copy(),
                src_v[..., :source_len, :].copy(),
                cfg.retention_for(source_len),
            )
            positions[rid] = Pos(source_len, 0, source)
        if streams and rng.random() < 0.1:  # a departure
            rid = str(rng.choice(sorted(streams)))
            manager.remove_request(rid)
            del streams[rid], positions[rid]
            finished += 1
        batch = [rid for rid in sorted(streams) if rng.random() < 0.8]
        if not batch:
            continue
        rng.shuffle(batch)
        tokens = {rid: int(rng.integers(1, T + 1)) for rid in batch}
        spans = {rid: int(rng.integers(0, tokens[rid] + 1)) for rid in batch}
        step, ctx = declared_step(cfg, bucket, batch, spans, positions, tokens)
        assert manager.admit(step, ctx).ok
        plan = manager.plan(step, ctx)
        rows = cfg.max_slots * R
        q = rng.standard_normal((L, rows, T, H, D)).astype(np.float32)
        k = rng.standard_normal((L, rows, T, G, D)).astype(np.float32)
        v = rng.standard_normal((L, rows, T, G, D)).astype(np.float32)
        before = jax.device_get(manager.cache)
        manager.cache, out = run_step(
            manager.cache, manager.bank, plan, q, k, v, config=cfg, implementation=implementation
        )
        manager.commit(step, ctx)
        out, after = np.asarray(out), jax.device_get(manager.cache)
        touched = {manager.slot_of(rid) for rid in batch} | {manager.padding_slot}
        assert_only_these_slots_changed(before, after, touched, cfg)
        for b, rid in enumerate(batch):
            rows_b = slice(b * R, (b + 1) * R)
            q_b = q[:, rows_b].astype(np.float64)
            k_b, v_b = k[:, rows_b].astype(np.float64), v[:, rows_b].astype(np.float64)
            expected = oracle_attention(
                streams[rid], q_b, k_b, v_b, spans[rid], tokens[rid], cfg.query_window, scale
            )
            np.testing.assert_allclose(
                out[:, rows_b, : tokens[rid]], expected, rtol=2e-5, atol=2e-5, err_msg=rid
            )
            streams[rid].append(
                k_b[:, :, : spans[rid]].transpose(0, 1, 3, 2, 4),
                v_b[:, :, : spans[rid]].transpose(0, 1, 3, 2, 4),
                cfg.reverse_step_order,
            )
            positions[rid] = positions[rid]._replace(written=positions[rid].written + spans[rid])
    for rid in list(streams):
        manager.remove_request(rid)
    assert manager.free_slots == cfg.max_slots  # nothing leaked
    return finished + len(positions)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_streams_match_oracle(seed):
    assert run_random_streams(seed) >= 1


def run_random_blocks(seed: int, blocks: int = 20) -> int:
    """Drive random streams through the manager in blocks of K one-token steps (`BoundedKVStep.steps`):
    one admission, one plan (a table per step) and one commit a block, each row taking its first `span`
    steps. Every step's output is compared with the oracle stepping one token at a time, and no step
    touches a slot but those of the rows taking it (and the padding slot). Returns the tokens checked."""
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, cfg), num_sources=3)
    L, R, G, D = cfg.num_layers, cfg.rows_per_request, cfg.num_heads, cfg.head_dim
    H, K = G * int(rng.integers(1, 3)), int(rng.integers(2, 7))
    sources = {}
    for index in range(3):
        length = int(rng.integers(cfg.min_source_len, cfg.max_source_len + 1))
        sources[index] = tuple(rng.standard_normal((L, R, G, length, D)) for _ in range(2))
        manager.register_source(index, list(sources[index][0]), list(sources[index][1]))
    streams: dict[str, OracleStream] = {}
    positions: dict[str, Pos] = {}
    scale, checked = 1 / np.sqrt(D), 0
    bucket = BucketKey("decode", cfg.max_slots, K)
    for b in range(blocks):
        while len(streams) < cfg.max_slots and rng.random() < 0.6:  # arrivals
            rid = f"r{b}-{len(streams)}"
            source = int(rng.integers(0, 3))
            src_k, src_v = sources[source]
            source_len = int(rng.integers(cfg.min_source_len, src_k.shape[3] + 1))
            manager.ingest_request(rid)
            streams[rid] = OracleStream(
                src_k[..., :source_len, :].copy(), src_v[..., :source_len, :].copy(),
                cfg.retention_for(source_len),
            )  # fmt: skip
            positions[rid] = Pos(source_len, 0, source)
        batch = [rid for rid in sorted(streams) if rng.random() < 0.8]
        if not batch:
            continue
        spans = {rid: int(rng.integers(0, K + 1)) for rid in batch}  # 0: a row taking none of the steps
        tokens = {rid: max(spans[rid], 1) for rid in batch}
        step, ctx = declared_step(cfg, bucket, batch, spans, positions, tokens, steps=K)
        assert manager.admit(step, ctx).ok
        plan = manager.plan(step, ctx)
        assert plan.steps == K
        assert plan.num_tokens == 1
        assert plan.table.shape == (K, cfg.max_slots, plan.table.shape[-1])
        for j in range(K):
            rows = cfg.max_slots * R
            q = rng.standard_normal((L, rows, 1, H, D)).astype(np.float32)
            k = rng.standard_normal((L, rows, 1, G, D)).astype(np.float32)
            v = rng.standard_normal((L, rows, 1, G, D)).astype(np.float32)
            before = jax.device_get(manager.cache)
            manager.cache, out = run_step(
                manager.cache, manager.bank, plan.step(plan.table[j]), q, k, v, config=cfg
            )
            out, after = np.asarray(out), jax.device_get(manager.cache)
            taking = [rid for rid in batch if j < spans[rid]]
            touched = {manager.slot_of(rid) for rid in taking} | {manager.padding_slot}
            assert_only_these_slots_changed(before, after, touched, cfg, f"step {j}: ")
            for i, rid in enumerate(batch):
                if rid not in taking:
                    continue
                rows_i = slice(i * R, (i + 1) * R)
                q_i = q[:, rows_i].astype(np.float64)
                k_i, v_i = k[:, rows_i].astype(np.float64), v[:, rows_i].astype(np.float64)
                want = oracle_attention(streams[rid], q_i, k_i, v_i, 1, 1, cfg.query_window, scale)
                np.testing.assert_allclose(
                    out[:, rows_i, :1], want, rtol=2e-5, atol=2e-5, err_msg=f"{rid} {j}"
                )
                streams[rid].append(
                    k_i.transpose(0, 1, 3, 2, 4), v_i.transpose(0, 1, 3, 2, 4), cfg.reverse_step_order
                )
                checked += 1
        manager.commit(step, ctx)
        for rid in batch:
            positions[rid] = positions[rid]._replace(written=positions[rid].written + spans[rid])
            assert manager.written(rid) == positions[rid].written
        for rid in [rid for rid in sorted(streams) if rng.random() < 0.15]:  # departures
            manager.remove_request(rid)
            del streams[rid], positions[rid]
    for rid in list(streams):
        manager.remove_request(rid)
    assert manager.free_slots == cfg.max_slots  # nothing leaked
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_blocks_of_one_token_steps_match_the_oracle_one_token_at_a_time(seed):
    assert run_random_blocks(seed) >= 1


def test_a_block_refuses_a_row_of_more_spans_than_steps():
    cfg = BoundedKVConfig(
        num_layers=1, num_heads=1, head_dim=8, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(1, 4), max_slots=2,
    )  # fmt: skip
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, cfg), num_sources=1)
    manager.ingest_request("a")
    # Unbucketed, so no bucket width holds the row to the block: the columns check refuses it, and then
    # `check_segment` says why (both needed), before the slot is claimed, for plain and NumPy ints.
    for written in (0, np.int64(0)):
        step = BoundedKVStep((Segment("a", "main", 5),), {"a": Pos(0, 0, written)}, {"a": 5}, steps=4)
        refused = manager.admit(step)
        assert not refused.ok
        assert isinstance(refused.reason, AdmitRuntimeError)  # terminal: no retry admits it
        assert (
            refused.reason.message == "'a': span=5 must be <= steps=4: a block's row writes one token a step"
        )
        assert manager.free_slots == 2
        assert manager.slot_of("a") is None
        with pytest.raises(StepNotAdmittedError):
            manager.plan(step)
    fits = BoundedKVStep((Segment("a", "main", 4),), {"a": Pos(0, 0, 0)}, {"a": 5}, steps=4)
    assert manager.admit(fits).ok
    with pytest.raises(ValueError, match=r"span\[0\]=5 exceeds the block's steps=4"):  # the planner's own
        planning.block_tables(
            step, step.segments, 1, {"a": 0}, requests=manager._requests, slots=manager._slots,
            padding_slot=manager.padding_slot, config=cfg,
        )  # fmt: skip
    for bad in (0, -1, 2.5, "4", None):
        with pytest.raises(ValueError, match=r"steps=.* must be an int >= 1"):
            BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)}, steps=bad)
