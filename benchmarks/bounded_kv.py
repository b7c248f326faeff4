"""Bounded KV cache: step cost is independent of stream length and of slot count; host planning is cheap.

Prints, from one run (ratios against baselines measured in the same run):
  1. decode step time at 64k written tokens / at 1k (goal <= 1.05), beside a dense growing cache of the
     same model (attention over the whole stream) whose ratio grows with the stream;
  2. step time with 256 slots / 16 slots at batch 8 (goal <= 1.2): a step touches only its rows' bytes;
  3. host admit + plan + commit of one decode step at batch 1, 32 and 256: microseconds a call and a
     row, and the fixed and per-row cost fitted over the three.

Every layer's attention output feeds the next layer's queries (a residual), in the bounded and the dense
step alike: a step that returned only the last layer's output would let XLA drop every earlier layer's
attention as dead code. Before timing, the script checks in the compiled programs that each layer's
softmax is there. Timed cases run interleaved in a fresh random order every repeat (`benchmarks.timing`);
each figure is the median of per-repeat ratios with their min–max and the repeat count.

Run: python -m benchmarks.bounded_kv [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ORDER_NOTE, Spread, describe, interleaved_times, quick_label, ratios
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import Segment, StepContext

STEPS_PER_SAMPLE = 4  # one timed sample: this many steps back to back (see `interleaved_times`' `number`)


@partial(jax.jit, static_argnames=("config",), donate_argnums=0)
def bounded_step(cache, bank, plan, q, k, v, *, config):
    """Every layer attends its retained stream and stores the step; layer l + 1's queries read layer l's
    output, so that no layer's attention is dead code."""
    out = None
    for layer in range(config.num_layers):
        out, cache = attend(cache, bank, plan, layer, q, k, v, config=config, implementation="xla")
        q = q + out
    return cache, out


@partial(jax.jit, donate_argnums=(0, 1))
def dense_step(cache_k, cache_v, q, k, v):
    """A dense cache holding the whole stream: write the new token at the end, attend every key.

    cache_k, cache_v: per layer [B, n + 1, G, D]; the new token goes to the last entry in place. Layer
    l + 1's queries read layer l's output, as in `bounded_step`.
    """
    n = cache_k[0].shape[1] - 1
    out, new_k, new_v = None, [], []
    for ck, cv in zip(cache_k, cache_v, strict=True):
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k, n, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v, n, axis=1)
        out = jax.nn.dot_product_attention(q, ck, cv)
        q = q + out
        new_k.append(ck)
        new_v.append(cv)
    return tuple(new_k), tuple(new_v), out


def exponentials(jitted, *args, **kwargs) -> int:
    """The exponential ops in the optimized HLO of `jitted` compiled for `args`: softmax's exp, so a
    count that grows with the layers shows that XLA kept every layer's attention."""
    text = jitted.lower(*args, **kwargs).compile().as_text()
    return len(re.findall(r"\sexponential\(", text))


def attention_counts(*, layers: int, kv_heads: int, head_dim: int, sink: int, window: int, heads: int,
                     batch: int, written: int) -> Mapping[str, tuple[int, int]]:  # fmt: skip
    """For the bounded and the dense step: (exponentials compiled at `layers` layers, at 1 layer).

    Every layer's attention survives compilation exactly when the first is `layers` times the second.
    """
    counts = {}
    for name, count in (("bounded", bounded_exponentials), ("dense", dense_exponentials)):
        at = partial(count, kv_heads=kv_heads, head_dim=head_dim, sink=sink, window=window, heads=heads,
                     batch=batch, written=written)  # fmt: skip
        counts[name] = (at(layers=layers), at(layers=1))
    return counts


def bounded_exponentials(*, layers, kv_heads, head_dim, sink, window, heads, batch, written) -> int:
    """`exponentials` of `bounded_step` compiled for a decode step of `batch` requests at `written`."""
    manager = make_manager(slots=batch, layers=layers, kv_heads=kv_heads, head_dim=head_dim, sink=sink,
                           window=window)  # fmt: skip
    plan = admit_and_plan(manager, batch, written)
    cfg = manager.config
    q = jax.ShapeDtypeStruct((batch, 1, heads, head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((batch, 1, kv_heads, head_dim), jnp.float32)
    cache, bank = BoundedKVCache.abstract(cfg), SourceBank.abstract(cfg, 1)
    return exponentials(bounded_step, cache, bank, plan, q, k, k, config=cfg)


def dense_exponentials(*, layers, kv_heads, head_dim, sink, window, heads, batch, written) -> int:
    """`exponentials` of `dense_step` compiled for a decode step over `written` cached entries."""
    del sink, window  # a dense cache keeps everything
    layer = jax.ShapeDtypeStruct((batch, written + 1, kv_heads, head_dim), jnp.float32)
    q = jax.ShapeDtypeStruct((batch, 1, heads, head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((batch, 1, kv_heads, head_dim), jnp.float32)
    return exponentials(dense_step, (layer,) * layers, (layer,) * layers, q, k, k)


def check_every_layer_attends(counts: Mapping[str, tuple[int, int]], layers: int) -> None:
    """Print the counts of `attention_counts`; raise if a compiled step dropped a layer's attention."""
    for name, (many, one) in counts.items():
        print(f"   {name} step: {many} softmax exponentials compiled at {layers} layers, {one} at 1 layer")
        if one == 0 or many != layers * one:
            raise RuntimeError(
                f"the compiled {name} step holds {many} exponentials, not {layers} x {one}: XLA dropped a "
                "layer's attention as dead code, so its timings would not measure every layer"
            )


def make_manager(*, slots: int, layers: int, kv_heads: int, head_dim: int, sink: int, window: int):
    """A manager of one bounded cache without a source prefix, retention `SinkWindow(sink, window)`."""
    cfg = BoundedKVConfig(
        num_layers=layers, num_heads=kv_heads, head_dim=head_dim, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(sink, window), max_slots=slots,
    )  # fmt: skip
    return BoundedKVManager(BoundedKVSpec("kv", {"model"}, cfg), num_sources=1)


def advance(manager: BoundedKVManager, written: Mapping[str, int]) -> None:
    """Ingest each request and commit its first `written[rid]` tokens through the manager (one admitted
    step each, nothing run on the device): its stream then stands at that position, its slot holding
    whatever the cache held, since a step's cost depends on where the stream is, not on its keys."""
    rids = [rid for rid in written if written[rid] > 0]
    for rid in written:
        manager.ingest_request(rid)
    if not rids:
        return
    step = BoundedKVStep(tuple(Segment(r, "main", written[r]) for r in rids), {r: Pos(0, 0) for r in rids})
    ctx = StepContext(rids, "advance", 0, capture=False)
    outcome = manager.admit(step, ctx)
    if not outcome.ok:
        raise RuntimeError(f"could not position the streams: {outcome.reason}")
    manager.commit(step, ctx)


def admit_and_plan(manager: BoundedKVManager, batch: int, written: int):
    """The plan of one decode step of `batch` fresh requests standing at `written` tokens."""
    rids = [f"r{i}" for i in range(batch)]
    advance(manager, dict.fromkeys(rids, written))
    step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), {r: Pos(0, written) for r in rids})
    ctx = StepContext(rids, "decode", 0, capture=False)
    assert manager.admit(step, ctx).ok
    return manager.plan(step, ctx)


def bounded_runner(*, slots, batch, written, geometry, heads, rng) -> Callable[[], None]:
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


def dense_runner(*, batch, written, geometry, heads, rng) -> Callable[[], None]:
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


HOST_BATCHES = (1, 32, 256)


def host_stepper(batch: int) -> Callable[[], float]:
    """A zero-argument function running one decode step's admit + plan + commit for `batch` requests
    (each call the next position), returning its own seconds; the first step claims the slots."""
    manager = make_manager(slots=batch, layers=1, kv_heads=1, head_dim=8, sink=4, window=64)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        manager.ingest_request(rid)
    ctx = StepContext(rids, "decode", 0, capture=False)
    written = 0

    def run() -> float:
        nonlocal written
        step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), {r: Pos(0, written) for r in rids})
        start = time.perf_counter()
        manager.admit(step, ctx)
        manager.plan(step, ctx)
        manager.commit(step, ctx)
        written += 1
        return time.perf_counter() - start

    return run


def fixed_and_per_row(batches: tuple[int, ...], seconds: list[float]) -> tuple[float, float]:
    """Least-squares `seconds = fixed + per_row * batch`: (fixed µs per call, µs per row)."""
    per_row, fixed = np.polyfit(np.asarray(batches, np.float64), np.asarray(seconds) * 1e6, 1)
    return float(fixed), float(per_row)


def ratio_row(label: str, num: list[float], den: list[float], goal: str = "") -> str:
    """`label: num ms / den ms = median ratio (min–max, N repeats)`; the ms are medians per step."""
    ms = lambda samples: Spread.of(samples, scale=1e3).median  # noqa: E731
    ratio = describe(ratios(num, den), ".3f")
    return f"   {label:<31}: {ms(num):8.3f} ms / {ms(den):8.3f} ms = {ratio}{goal}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 16k long stream and fewer repeats (labelled)")
    parser.add_argument("--repeats", type=int, default=None, help="samples per case (default 30, quick 10)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    rng = np.random.default_rng(0)
    geometry = {"layers": 2, "kv_heads": 2, "head_dim": 64, "sink": 4, "window": 1020}
    heads, batch = 8, 4
    short, long = (1024, 16384) if args.quick else (1024, 65536)
    label = quick_label(args.quick, f"long stream {long // 1024}k, {repeats} repeats")
    print(f"benchmarks/bounded_kv.py{label}")
    print(f"backend: {jax.default_backend()}  geometry: {geometry}, {heads} query heads, batch {batch}")
    print(f"timing: {ORDER_NOTE}; a sample is {STEPS_PER_SAMPLE} steps back to back; median (min–max)")

    print("\n0. every layer's attention is in the compiled steps")
    counts = attention_counts(**geometry, heads=heads, batch=batch, written=short)
    check_every_layer_attends(counts, geometry["layers"])

    common = {"geometry": geometry, "heads": heads, "rng": rng}
    cases = {
        "b_short": bounded_runner(slots=16, batch=batch, written=short, **common),
        "b_long": bounded_runner(slots=16, batch=batch, written=long, **common),
        "d_short": dense_runner(batch=batch, written=short, **common),
        "d_long": dense_runner(batch=batch, written=long, **common),
    }
    t = interleaved_times(cases, repeats, number=STEPS_PER_SAMPLE)
    print(f"\n1. decode step at {long // 1024}k written / at {short // 1024}k written{label}")
    print(ratio_row("bounded (sink 4 + window 1020)", t["b_long"], t["b_short"], "  (goal <= 1.05)"))
    print(ratio_row("dense growing cache", t["d_long"], t["d_short"]))
    dense_over_bounded = describe(ratios(t["d_long"], t["b_long"]), unit="x")
    print(f"   dense / bounded at {long // 1024}k          : {dense_over_bounded}")

    cases = {
        "small": bounded_runner(slots=16, batch=8, written=4096, **common),
        "large": bounded_runner(slots=256, batch=8, written=4096, **common),
    }
    t = interleaved_times(cases, repeats, number=STEPS_PER_SAMPLE)
    print(f"\n2. decode step with 256 slots / 16 slots, batch 8{label}")
    print(ratio_row("256 slots / 16 slots", t["large"], t["small"], "  (goal <= 1.2)"))

    host_repeats = 50 if args.quick else 200
    t = interleaved_times(
        {b: host_stepper(b) for b in HOST_BATCHES}, host_repeats, number=STEPS_PER_SAMPLE, self_timed=True
    )
    print(f"\n3. host admit + plan + commit of one decode step{label}")
    for b in HOST_BATCHES:
        call, row = Spread.of(t[b], scale=1e6), Spread.of(t[b], scale=1e6 / b)
        per_row = row.format(".2f", repeats=False)
        print(f"   batch {b:>3}: {call.format('.1f', unit=' us')} a call, {per_row} a row")
    fixed, per_row = fixed_and_per_row(HOST_BATCHES, [Spread.of(t[b]).median for b in HOST_BATCHES])
    print(f"   fit over the medians: {fixed:.1f} us fixed per call + {per_row:.2f} us per row")


if __name__ == "__main__":
    main()
