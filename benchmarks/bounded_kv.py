"""Bounded KV cache: step cost is independent of stream length and of slot count; host planning is cheap.

Prints, from one run (ratios against baselines measured in the same run):
  1. decode step time at 64k written tokens / at 1k (goal <= 1.05), beside a dense growing cache of the
     same model (attention over the whole stream) whose ratio grows with the stream;
  2. step time with 256 slots / 16 slots at batch 8 (goal <= 1.2): a step touches only its rows' bytes;
  3. host admit + plan + commit microseconds per row at batch 32.

Run: python benchmarks/bounded_kv.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import Segment, StepContext


@partial(jax.jit, static_argnames=("config",), donate_argnums=0)
def bounded_step(cache, bank, plan, q, k, v, *, config):
    out = None
    for layer in range(config.num_layers):
        out, cache = attend(cache, bank, plan, layer, q, k, v, config=config, implementation="xla")
    return cache, out


@partial(jax.jit, donate_argnums=(0, 1))
def dense_step(cache_k, cache_v, q, k, v):
    """A dense cache holding the whole stream: write the new token at the end, attend every key.

    cache_k, cache_v: per layer [B, n + 1, G, D]; the new token goes to the last entry in place.
    """
    n = cache_k[0].shape[1] - 1
    out, new_k, new_v = None, [], []
    for ck, cv in zip(cache_k, cache_v, strict=True):
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k, n, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v, n, axis=1)
        out = jax.nn.dot_product_attention(q, ck, cv)
        new_k.append(ck)
        new_v.append(cv)
    return tuple(new_k), tuple(new_v), out


def interleaved_medians(fns, repeats: int) -> list[float]:
    """Median seconds per call of each function, timed in alternation so machine noise hits all alike."""
    for fn in fns:
        fn()  # warm-up (compiles)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]


def make_manager(*, slots: int, layers: int, kv_heads: int, head_dim: int, sink: int, window: int):
    cfg = BoundedKVConfig(
        num_layers=layers, num_heads=kv_heads, head_dim=head_dim, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(sink, window), max_slots=slots,
    )  # fmt: skip
    return BoundedKVManager(BoundedKVSpec("kv", {"model"}, cfg), num_sources=1)


def admit_and_plan(manager: BoundedKVManager, batch: int, written: int):
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        manager.ingest_request(rid)
        manager._requests[rid].written = written  # position the stream without running `written` steps
    step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), {r: Pos(0, written) for r in rids})
    ctx = StepContext(rids, "decode", 0, capture=False)
    assert manager.admit(step, ctx).ok
    return manager.plan(step, ctx)


def bounded_runner(*, slots, batch, written, geometry, heads, rng):
    """A zero-argument function running one bounded decode step."""
    manager = make_manager(slots=slots, **geometry)
    plan = admit_and_plan(manager, batch, written)
    cfg = manager.config
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, cfg.head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)

    def run():
        manager.cache, out = bounded_step(manager.cache, manager.bank, plan, q, k, k, config=cfg)
        out.block_until_ready()

    return run


def dense_runner(*, batch, written, geometry, heads, rng):
    """A zero-argument function running one decode step over a dense cache of the whole stream."""
    shape = (batch, written + 1, geometry["kv_heads"], geometry["head_dim"])
    layers = range(geometry["layers"])
    state = {name: tuple(jnp.zeros(shape, jnp.float32) for _ in layers) for name in ("k", "v")}
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, geometry["head_dim"])), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, 1, geometry["kv_heads"], geometry["head_dim"])), jnp.float32)

    def run():
        state["k"], state["v"], out = dense_step(state["k"], state["v"], q, k, k)
        out.block_until_ready()

    return run


def host_us_per_row(batch: int, repeats: int) -> float:
    manager = make_manager(slots=batch, layers=1, kv_heads=1, head_dim=8, sink=4, window=64)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        manager.ingest_request(rid)
    ctx = StepContext(rids, "decode", 0, capture=False)
    times = []
    for written in range(repeats):
        step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), {r: Pos(0, written) for r in rids})
        start = time.perf_counter()
        manager.admit(step, ctx)
        manager.plan(step, ctx)
        manager.commit(step, ctx)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / batch * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    rng = np.random.default_rng(0)
    geometry = {"layers": 2, "kv_heads": 2, "head_dim": 64, "sink": 4, "window": 1020}
    heads, batch = 8, 4
    short, long = (1024, 16384) if args.quick else (1024, 65536)
    print(f"backend: {jax.default_backend()}  geometry: {geometry}, {heads} query heads, batch {batch}")

    common = {"geometry": geometry, "heads": heads, "rng": rng}
    b_short, b_long, d_short, d_long = interleaved_medians(
        [
            bounded_runner(slots=16, batch=batch, written=short, **common),
            bounded_runner(slots=16, batch=batch, written=long, **common),
            dense_runner(batch=batch, written=short, **common),
            dense_runner(batch=batch, written=long, **common),
        ],
        repeats,
    )
    print(f"\n1. decode step at {long // 1024}k written / at {short // 1024}k written")
    row = "   {:<31}: {:8.3f} ms / {:8.3f} ms = {:6.3f}{}"
    goal = "  (goal <= 1.05)"
    print(row.format("bounded (sink 4 + window 1020)", b_long * 1e3, b_short * 1e3, b_long / b_short, goal))
    print(row.format("dense growing cache", d_long * 1e3, d_short * 1e3, d_long / d_short, ""))
    print(f"   dense / bounded at {long // 1024}k          : {d_long / b_long:6.2f}x")

    s_small, s_large = interleaved_medians(
        [
            bounded_runner(slots=16, batch=8, written=4096, **common),
            bounded_runner(slots=256, batch=8, written=4096, **common),
        ],
        repeats,
    )
    print("\n2. decode step with 256 slots / 16 slots, batch 8")
    print(f"   {s_large * 1e3:8.3f} ms / {s_small * 1e3:8.3f} ms = {s_large / s_small:6.3f}  (goal <= 1.2)")

    us = host_us_per_row(32, 50 if args.quick else 200)
    print("\n3. host admit + plan + commit at batch 32")
    print(f"   {us:8.2f} us per row")


if __name__ == "__main__":
    main()
