"""One decode step of sink+window attention against baselines measured in the same run.

Run from the repository root (or after `pip install -e .`):

    python -m benchmarks.kernel            # 32 slots x (sink 4 + window 1020), G=8, H=32, D=128
    python -m benchmarks.kernel --quick    # a smaller batch and fewer repeats (under a minute on CPU)

Every active slot is full (its ring has wrapped, at a different offset per slot), so the step reads
`active * (sink + window) * G * D * 2 (K and V) * dtype bytes`: the bytes a decode step cannot avoid.
Figures are ratios against baselines timed in this run, on this machine:

- copy: `x + 1` over an array of exactly those bytes (reads them once and writes them once);
- dense dpa: `jax.nn.dot_product_attention` over the same retained keys already laid out densely
  `[active, K, G, D]` (no gather, no table), i.e. what a plain cache layout would cost;
- each implementation's time against the XLA path's.

Pallas kernels are timed compiled only (never in interpret mode, which measures nothing about speed).
A step costs what it reads, not the cache's size: raise `--slots` with `--active` fixed and the step's
time should stay put.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl

PALLAS_FOR_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def decode_table(written: np.ndarray, steps: np.ndarray, *, sink: int, window: int) -> np.ndarray:
    """Plan table of requests without a source prefix (slot offsets [0, sink) then a ring of `window`).

    Args:
      written: i64[B] entries each request wrote before the step; slot b belongs to request b.
      steps: i64[B] the step's real tokens per request; 0 makes a padding row (reads nothing).
      sink, window: the retention; the window does not include the step.

    Returns:
      i32[B, ROW_INTS].
    """
    table = np.zeros((len(written), tbl.ROW_INTS), np.int32)
    capacity = sink + window
    for b, (n, t) in enumerate(zip(written, steps, strict=True)):
        if t == 0:
            continue
        kept, window_start = min(sink, n), max(sink, n - window)
        table[b, [tbl.SLOT, tbl.STREAM_LEN, tbl.SINK, tbl.SINK_KEPT, tbl.WINDOW_START, tbl.STEP_TOKENS]] = (
            b, n, sink, kept, window_start, t,
        )  # fmt: skip
        table[b, tbl.read_len(1)] = kept  # the sink lives at slot offsets [0, sink)
        count = n - window_start
        if count > 0:
            offset = sink + (window_start - sink) % window
            first = min(count, capacity - offset)
            table[b, [tbl.read_start(3), tbl.read_len(3)]] = offset, first
            table[b, [tbl.read_start(4), tbl.read_len(4)]] = sink, count - first
    return table


def median_seconds(fn: Callable[..., jax.Array], *args: jax.Array, warmup: int, repeats: int) -> float:
    """Median wall time of `fn(*args)` after `warmup` calls (the first compiles), each call waited for."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=32, help="slots in the cache (and rows in the batch)")
    p.add_argument("--active", type=int, default=None, help="slots decoding this step (default: all)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--kv-heads", type=int, default=8, help="G")
    p.add_argument("--heads", type=int, default=32, help="H, a multiple of G")
    p.add_argument("--head-dim", type=int, default=128, help="D")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on accelerators, float32 on CPU")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 slots, 2 warm-up calls, 5 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.slots, args.warmup, args.repeats = min(args.slots, 8), min(args.warmup, 2), min(args.repeats, 5)
    args.active = args.slots if args.active is None else min(args.active, args.slots)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16"))
    slots, active, groups, heads, dim = args.slots, args.active, args.kv_heads, args.heads, args.head_dim
    retained = args.sink + args.window

    # Streams well past the first wrap, each at its own ring offset; inactive slots are padding rows.
    rng = np.random.default_rng(args.seed)
    written = retained + rng.integers(0, 4 * args.window, slots)
    steps = (np.arange(slots) < active).astype(np.int64)
    table = jnp.asarray(decode_table(written, steps, sink=args.sink, window=args.window))

    keys = iter(jax.random.split(jax.random.key(args.seed), 8))
    normal = functools.partial(jax.random.normal, dtype=dtype)
    q = normal(next(keys), (slots, 1, heads, dim))
    k, v = (normal(next(keys), (slots, 1, groups, dim)) for _ in range(2))
    cache_k, cache_v = (normal(next(keys), (slots, 1, groups, retained, dim)) for _ in range(2))
    source_k, source_v = (jnp.zeros((1, 1, groups, 1, dim), dtype) for _ in range(2))  # no source read
    arrays = (q, k, v, cache_k, cache_v, source_k, source_v, table)

    step_bytes = active * retained * groups * dim * 2 * dtype.itemsize
    timing = {"warmup": args.warmup, "repeats": args.repeats}
    results: dict[str, float] = {}

    flat = jnp.zeros((step_bytes // dtype.itemsize,), dtype)
    copy = jax.jit(lambda x: x + 1)
    results["copy (read + write)"] = median_seconds(copy, flat, **timing)
    del flat

    # The same retained keys laid out densely, one row per active slot, in stream order.
    dense_k, dense_v = (c[:active, 0].transpose(0, 2, 1, 3) for c in (cache_k, cache_v))  # [A, K, G, D]
    dense_q = q[:active]
    dpa = jax.jit(jax.nn.dot_product_attention)
    results["dense dot_product_attention"] = median_seconds(dpa, dense_q, dense_k, dense_v, **timing)
    del dense_q, dense_k, dense_v

    implementations = ["xla"] + ([PALLAS_FOR_BACKEND[backend]] if backend in PALLAS_FOR_BACKEND else [])
    unavailable: dict[str, str] = {}
    for name in implementations:
        fn = jax.jit(functools.partial(sink_window_attention, max_retained=retained, implementation=name))
        try:
            results[name] = median_seconds(fn, *arrays, **timing)
        except (NotImplementedError, ImportError, ValueError) as e:
            if name == "xla":
                raise
            unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"

    print(f"backend {backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, {dtype.name}")
    print(
        f"one decode step: {active}/{slots} active slots x (sink {args.sink} + window {args.window}) "
        f"keys, G={groups}, H={heads}, D={dim}"
    )
    print(f"bytes the step must read (retained K+V of active rows): {step_bytes / 1e6:.1f} MB")
    print(f"median of {args.repeats} calls after {args.warmup} warm-up calls\n")
    xla_time, copy_time = results.get("xla"), results["copy (read + write)"]
    dpa_time = results["dense dot_product_attention"]
    header = f"{'':30} {'time':>10} {'GB/s':>8} {'vs copy':>8} {'vs dpa':>8} {'vs xla':>8}"
    print(header)
    print("-" * len(header))
    for name, seconds in results.items():
        vs_xla = f"{seconds / xla_time:8.2f}" if xla_time and name in implementations else f"{'':8}"
        print(
            f"{name:30} {seconds * 1e3:8.3f}ms {step_bytes / seconds / 1e9:8.1f} "
            f"{seconds / copy_time:8.2f} {seconds / dpa_time:8.2f} {vs_xla}"
        )
    for name, reason in unavailable.items():
        print(f"{name:30} unavailable ({reason})")
    print("\nratios are time / baseline time (lower is faster); GB/s = step bytes / time")
    if backend not in PALLAS_FOR_BACKEND:
        print(
            f"{backend}: XLA path only. The Pallas kernels run here only in interpret mode, "
            "which checks semantics and is not a speed."
        )


if __name__ == "__main__":
    main()
