"""One decode step of sink+window attention against baselines measured in the same run.

Run from the repository root:

    python -m benchmarks.kernel            # 32 slots x (sink 4 + window 1020), G=8, H=32, D=128
    python -m benchmarks.kernel --quick    # a smaller batch and fewer repeats (labelled as such)

The plan table comes from the library's own planner: a `BoundedKVManager` admits the step's requests
(each committed far past its ring's first wrap, at a different offset per slot) and plans their decode
step, so the step reads `active * (sink + window) * G * D * 2 (K and V) * dtype bytes`: the bytes a decode
step cannot avoid. Figures are ratios against baselines timed in this run, on this machine:

- copy: `x + 1` over an array of exactly those bytes (reads them once and writes them once);
- dense dpa: `jax.nn.dot_product_attention` over the same retained keys already laid out densely
  `[active, K, G, D]` (no gather, no table), i.e. what a plain cache layout would cost;
- each implementation's time against the XLA path's.

Every case is timed once per repeat, in a fresh random order each repeat (`benchmarks.timing`); each
ratio is the median of the per-repeat ratios, with their min–max over the repeat count.

Pallas kernels are timed compiled only (never in interpret mode, which measures nothing about speed).
A step costs what it reads, not the cache's size: raise `--slots` with `--active` fixed and the step's
time should stay put.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bounded_kv import advance
from benchmarks.timing import ORDER_NOTE, Spread, describe, interleaved_times, quick_label, ratios
from kernels_pallas.sink_window_attention import sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.gpu import BlockSizes, sink_window_attention_gpu
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

PALLAS_FOR_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def decode_plan(
    written: np.ndarray, active: int, *, sink: int, window: int, kv_heads: int, head_dim: int, dtype
) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """The library's plan for one decode step, from a `BoundedKVManager` as an engine gets it.

    Requests `r0 .. r{active - 1}` are committed through the manager to `written[i]` entries (no source
    prefix, nothing run on the device), then one decode step of them is admitted and planned in a bucket
    of `len(written)` rows, the others padding rows (they read nothing).

    Args:
      written: i64[S] entries request i wrote before the step (only the first `active` are used).
      active: requests in the step, <= S.
      sink, window: the retention; the window does not include the step.
      kv_heads, head_dim, dtype: the cache's geometry.

    Returns:
      (i32[S, ROW_INTS] the plan table, one layer's cache shape [S + 1, 1, G, C, D], the source bank's
      shape per layer).
    """
    slots = len(written)
    config = BoundedKVConfig(
        num_layers=1, num_heads=kv_heads, head_dim=head_dim, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(sink, window), max_slots=slots, dtype=dtype,
    )  # fmt: skip
    manager = BoundedKVManager(BoundedKVSpec("kv", {"model"}, config), num_sources=1)
    rids = [f"r{i}" for i in range(active)]
    advance(manager, {rid: int(written[i]) for i, rid in enumerate(rids)})
    positions = {r: Pos(0, manager.written(r)) for r in rids}
    step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), positions)
    lease = SlotLease(0, BucketKey("decode", slots, 1))  # pads the table to S rows
    ctx = StepContext(rids, "decode", 0, capture=False, slot_lease=lease)
    outcome = manager.admit(step, ctx)
    if not outcome.ok:
        raise RuntimeError(f"the manager refused the step: {outcome.reason}")
    table = np.asarray(manager.plan(step, ctx).table)
    return table, tuple(manager.cache.k[0].shape), tuple(manager.bank.k[0].shape)


def back_to_back(fn, *args, calls: int):
    """A case that dispatches `calls` calls of `fn(*args)` and waits once, for the last one's result.

    JAX dispatches asynchronously, so the device runs the calls back to back while the host queues the
    next: a sample's time over `calls` is the device's time per call, not the host's dispatch and sync.
    """

    def run() -> None:
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    return run


def sweep_blocks(
    *, query_rows: int, head_dim: int, max_retained: int, kv_heads: int, itemsize: int = 2
) -> list[BlockSizes]:
    """`--sweep`'s settings for a decode step: key blocks × warps × pipelining stages, each with the
    default split; then the default tiles with each split (keys a program: None, 64 .. 512). 16-bit
    dtypes (`itemsize` 2) try key blocks 32-256, 4 or 8 warps and 2-4 stages; float32 (4) key blocks
    16-64, 4-16 warps and 1 or 2 stages (its dots run on FMA units, `BlockSizes.default`)."""
    default = BlockSizes.default(
        query_rows=query_rows,
        head_dim=head_dim,
        max_retained=max_retained,
        kv_heads=kv_heads,
        itemsize=itemsize,
    )
    wide = itemsize >= 4
    grid = ((16, 32, 64), (4, 8, 16), (1, 2)) if wide else ((32, 64, 128, 256), (4, 8), (2, 3, 4))
    tiles = [
        BlockSizes(block_q=default.block_q, block_k=block_k, num_warps=warps, num_stages=stages,
                   split_keys=None if default.split_keys is None else max(default.split_keys, block_k))
        for block_k in grid[0]
        for warps in grid[1]
        for stages in grid[2]
    ]  # fmt: skip
    splits = [None, *(keys for keys in (64, 128, 256, 512) if keys % default.block_k == 0)]
    splits = [keys for keys in splits if keys != default.split_keys]
    return tiles + [dataclasses.replace(default, split_keys=keys) for keys in splits]


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
    p.add_argument("--calls", type=int, default=10,
                   help="calls per sample, dispatched back to back and waited on once")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true",
                   help="GPU only: also time the Pallas GPU kernel at sweep_blocks' tiles")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="8 slots, 2 warm-up samples, 5 repeats of 2 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.slots, args.warmup, args.repeats = min(args.slots, 8), min(args.warmup, 2), min(args.repeats, 5)
        args.calls = min(args.calls, 2)
    if args.calls < 1:
        p.error(f"--calls {args.calls} must be >= 1")
    args.active = args.slots if args.active is None else min(args.active, args.slots)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    backend = jax.default_backend()
    if args.sweep and backend != "gpu":  # refused before any work
        raise SystemExit(f"--sweep times compiled Triton kernels: it needs a GPU backend, not {backend}")
    dtype = jnp.dtype(args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16"))
    slots, active, groups, heads, dim = args.slots, args.active, args.kv_heads, args.heads, args.head_dim
    retained = args.sink + args.window
    tile_shape = {
        "query_rows": heads // groups,
        "head_dim": dim,
        "max_retained": retained,
        "kv_heads": groups,
        "itemsize": dtype.itemsize,
    }

    # Streams well past the first wrap, each at its own ring offset; inactive slots are padding rows.
    rng = np.random.default_rng(args.seed)
    written = retained + rng.integers(0, 4 * args.window, slots)
    table, cache_shape, source_shape = decode_plan(
        written, active, sink=args.sink, window=args.window, kv_heads=groups, head_dim=dim, dtype=dtype
    )

    keys = iter(jax.random.split(jax.random.key(args.seed), 8))
    normal = functools.partial(jax.random.normal, dtype=dtype)
    q = normal(next(keys), (slots, 1, heads, dim))
    k, v = (normal(next(keys), (slots, 1, groups, dim)) for _ in range(2))
    cache_k, cache_v = (normal(next(keys), cache_shape) for _ in range(2))
    source_k, source_v = (jnp.zeros(source_shape, dtype) for _ in range(2))  # no source read
    arrays = (q, k, v, cache_k, cache_v, source_k, source_v, jnp.asarray(table))

    step_bytes = active * retained * groups * dim * 2 * dtype.itemsize
    flat = jnp.zeros((step_bytes // dtype.itemsize,), dtype)
    # The same retained keys laid out densely, a row per active request. A full slot holds its sink and
    # window at offsets [0, retained) in ring order, which a decode query's softmax does not depend on.
    used = table[:active, tbl.SLOT]
    dense_k, dense_v = (c[used, 0, :, :retained].transpose(0, 2, 1, 3) for c in (cache_k, cache_v))
    dense_q = q[:active]
    copy, dpa = jax.jit(lambda x: x + 1), jax.jit(jax.nn.dot_product_attention)
    cases = {
        "copy (read + write)": back_to_back(copy, flat, calls=args.calls),
        "dense dot_product_attention": back_to_back(dpa, dense_q, dense_k, dense_v, calls=args.calls),
    }
    implementations = ["xla"] + ([PALLAS_FOR_BACKEND[backend]] if backend in PALLAS_FOR_BACKEND else [])
    unavailable: dict[str, str] = {}
    for name in implementations:
        fn = jax.jit(functools.partial(sink_window_attention, max_retained=retained, implementation=name))
        try:
            jax.block_until_ready(fn(*arrays))  # compiles; a kernel that cannot is reported, not timed
        except (NotImplementedError, ImportError, ValueError) as e:
            if name == "xla":
                raise
            unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            continue
        cases[name] = back_to_back(fn, *arrays, calls=args.calls)
    if args.sweep:
        for blocks in sweep_blocks(**tile_shape):
            split = f" split {blocks.split_keys}" if blocks.split_keys else ""
            name = f"pallas_gpu {blocks.block_k}k {blocks.num_warps}w {blocks.num_stages}s{split}"
            fn = jax.jit(
                functools.partial(sink_window_attention_gpu, max_retained=retained, block_sizes=blocks)
            )
            try:
                jax.block_until_ready(fn(*arrays))
            except Exception as e:  # a setting Triton cannot build (registers, shared memory) is reported
                unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                continue
            cases[name] = back_to_back(fn, *arrays, calls=args.calls)
            implementations.append(name)
    times = {
        name: [t / args.calls for t in samples]
        for name, samples in interleaved_times(cases, args.repeats, warmup=args.warmup).items()
    }

    label = quick_label(args.quick, f"{slots} slots, {args.repeats} repeats")
    print(f"benchmarks/kernel.py{label}")
    print(f"backend {backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, {dtype.name}")
    print(
        f"one decode step: {active}/{slots} active slots x (sink {args.sink} + window {args.window}) "
        f"keys, G={groups}, H={heads}, D={dim}; the plan from BoundedKVManager.plan"
    )
    print(f"bytes the step must read (retained K+V of active rows): {step_bytes / 1e6:.1f} MB")
    print(f"{ORDER_NOTE}, after {args.warmup} warm-up samples each")
    print(f"a sample: {args.calls} calls dispatched back to back, waited on once (hides the host's dispatch)")
    print(f"pallas_gpu: its default tiles, {BlockSizes.default(**tile_shape)}")
    print(f"times: medians; ratios: median (min–max) over {args.repeats} repeats\n")
    baselines = {"copy": "copy (read + write)", "dpa": "dense dot_product_attention", "xla": "xla"}
    header = f"{'':34} {'time ms':>8} {'GB/s':>7}" + "".join(f" {'vs ' + b:>18}" for b in baselines)
    print(header)
    print("-" * len(header))
    for name, record in times.items():
        seconds = Spread.of(record).median
        shown = [key != "xla" or name in implementations for key in baselines]
        cells = "".join(
            f" {describe(ratios(record, times[base]), repeats=False) if show else '':>18}"
            for show, base in zip(shown, baselines.values(), strict=True)
        )
        print(f"{name:34} {seconds * 1e3:8.3f} {step_bytes / seconds / 1e9:7.1f}{cells}")
    for name, reason in unavailable.items():
        print(f"{name:34} unavailable ({reason})")
    print("\nratios are time / baseline time in the same repeat (lower is faster); GB/s = step bytes / time")
    # The copy reads and writes the step's bytes, so the device's copy bandwidth is twice its GB/s column.
    print("\nbytes/s ÷ the copy's bytes/s (2 × step bytes per copy time: it reads them and writes them)")
    for name in implementations:
        if name in times:
            fraction = ratios(times[name], times["copy (read + write)"], inverse=True)
            print(f"{name:34} of copy {describe([f / 2 for f in fraction], '.2f')}")
    if backend not in PALLAS_FOR_BACKEND:
        print(
            f"{backend}: XLA path only. The Pallas kernels run here only in interpret mode, "
            "which checks semantics and is not a speed."
        )


if __name__ == "__main__":
    main()
