"""The ring write (`store_step`): its cost follows the tokens written, not the cache.

Prints, from one run:
  1. On this host, the XLA write (`implementation="xla"`: a `fori_loop` of 3·B read-modify-writes, the
     fallback and the CPU path) timed against batch B at a fixed slot count, and against slot count S at
     a fixed batch, each as a ratio to the smallest setting measured in the same run. The B ratios show
     the loop's sequential cost per request; the S ratios should stay near 1 (it touches no other slot).
     The settings are timed in alternation, in a fresh random order every repeat (`benchmarks.timing`), a
     sample being 20 writes back to back; median and spread (min–max of the per-repeat ratios) over the
     repeat count.
  2. Where libtpu is installed: the TPU program of `store_step` (`"auto"` lowered for TPU, i.e. the Pallas
     kernel) compiled for v5e on compile-only devices, its `cost_analysis()` bytes accessed ÷ the bytes
     the step writes (every request's T tokens, K and V), for S in {16, 64, 256} x B in {1, 8, 64}: at
     D = 128 in float32 (the direct DMA path) and bfloat16 (the tiled path), and at D = 64 (the lanes
     path: the slot's tokens lie in lanes, read and written back in tiles of 128 tokens). Flat along S
     and along B means O(bytes written) with no term in the cache's size. Counted by the compiler, not
     measured: no TPU ran.

Run: python -m benchmarks.ring_write [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import functools
import os

# Offline compilation needs no device: keep jax on the CPU even where a GPU plugin would claim one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ORDER_NOTE, Spread, describe, interleaved_times, quick_label, ratios
from kernels_pallas.sink_window_attention import store_step
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import offline_tpu
from mstar_jax.resources.kv.bounded import layout

# One layer of a small talker-like cache: R rows, G KV heads, D head dim; a decode-sized step.
ROWS, GROUPS, DIM = 1, 2, 128
SINK, WINDOW = 4, 1020  # C = 1024 slot tokens
STEPS = 4
CALLS_PER_SAMPLE = 20  # one timed sample: this many writes back to back (a write takes tens of µs on CPU)


def _table(slots: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """A planner table of `batch` requests in distinct slots (a third past the ring's wrap), spans of T."""
    return layout.plan_table(
        slot=rng.permutation(slots)[:batch], source=np.zeros(batch, int), source_len=np.zeros(batch, int),
        written=rng.integers(0, 4 * WINDOW, batch), span=np.full(batch, STEPS),
        step_tokens=np.full(batch, STEPS),
        sink=np.full(batch, SINK), window=np.full(batch, WINDOW), window_includes_step=np.zeros(batch, bool),
        sink_capacity=SINK, reverse=False, slot_tokens=SINK + WINDOW,
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _xla_write(cache_k, cache_v, k, v, table):
    return store_step(cache_k, cache_v, k, v, table, reverse=False, implementation="xla")


def _runner(*, slots: int, batch: int, rng: np.random.Generator):
    """A zero-argument function running `CALLS_PER_SAMPLE` XLA writes in place (the caches carried)."""
    shape = (slots + 1, ROWS, GROUPS, SINK + WINDOW, DIM)
    state = {"cache": (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))}
    table = jnp.asarray(_table(slots, batch, rng))
    k = jnp.asarray(rng.standard_normal((batch * ROWS, STEPS, GROUPS, DIM)), jnp.float32)

    def run():
        for _ in range(CALLS_PER_SAMPLE):
            state["cache"] = _xla_write(*state["cache"], k, k, table)
        jax.block_until_ready(state["cache"])

    return run


def _print_ratios(label: str, settings: list[int], times: list[list[float]], repeats: int) -> None:
    base = times[0]
    print(f"   {label:>5} | µs per write | ÷ {label}={settings[0]}: median (min–max), {repeats} repeats")
    for setting, record in zip(settings, times, strict=True):
        per_write = Spread.of(record, scale=1e6 / CALLS_PER_SAMPLE).median
        print(f"   {setting:>5} | {per_write:12.1f} | {describe(ratios(record, base), repeats=False)}")


def xla_timings(*, quick: bool, repeats: int) -> None:
    rng = np.random.default_rng(0)
    label = quick_label(quick, f"fewer settings, {repeats} repeats")
    geometry = f"R={ROWS} G={GROUPS} D={DIM} C={SINK + WINDOW} T={STEPS}"
    print(f"1. XLA write on {jax.default_backend()}{label}: {geometry}")
    print(f"   {ORDER_NOTE}")
    batches = [1, 8] if quick else [1, 8, 64]
    slots_fixed = 64
    print(f"\n   against batch B, S={slots_fixed} slots")
    times = interleaved_times([_runner(slots=slots_fixed, batch=b, rng=rng) for b in batches], repeats)
    _print_ratios("B", batches, times, repeats)
    slot_counts = [16, 256] if quick else [16, 64, 256]
    print("\n   against slot count S, batch B=8")
    times = interleaved_times([_runner(slots=s, batch=8, rng=rng) for s in slot_counts], repeats)
    _print_ratios("S", slot_counts, times, repeats)


def tpu_bytes(*, quick: bool) -> None:
    if (missing := offline_tpu.tpu_toolchain_missing()) is not None:
        print(f"\n2. TPU: skipped, {missing}")
        return
    label = quick_label(quick, "bfloat16 only")
    print(f"\n2. TPU (v5e, libtpu): store_step's bytes accessed ÷ bytes written{label}")
    print(f"   R={ROWS} G={GROUPS} C={SINK + WINDOW} T={STEPS}; rows S (slots), columns B (requests)")
    paths = [
        (jnp.float32, DIM, "direct DMAs"),
        (jnp.bfloat16, DIM, "tiles of 8 tokens"),
        (jnp.float32, 64, "lane tiles of 128 tokens"),
        (jnp.bfloat16, 64, "lane tiles of 128 tokens"),
    ]
    if quick:
        paths = [path for path in paths if path[0] == jnp.bfloat16]
    slot_counts, batches = (16, 64, 256), (1, 8, 64)
    for dtype, dim, unit in paths:
        itemsize = jnp.dtype(dtype).itemsize
        print(f"\n   {jnp.dtype(dtype).name}, D={dim} ({unit})")
        corner = "S \\ B"
        print(f"   {corner:>7}" + "".join(f"{b:>10}" for b in batches) + "   (bytes accessed at B=64)")
        for slots in slot_counts:
            row = []
            for batch in batches:
                cache = jax.ShapeDtypeStruct((slots + 1, ROWS, GROUPS, SINK + WINDOW, dim), dtype)
                step = jax.ShapeDtypeStruct((batch * ROWS, STEPS, GROUPS, dim), dtype)
                specs = (cache, cache, step, step, jax.ShapeDtypeStruct((batch, tbl.ROW_INTS), jnp.int32))
                fn = functools.partial(store_step, reverse=False)
                compiled = offline_tpu.compile_for_tpu(fn, *specs, generation="v5e", donate_argnums=(0, 1))
                assert "store_step_tpu" in compiled.as_text(), (
                    "the TPU program did not take the Pallas kernel"
                )
                cost = compiled.cost_analysis()
                accessed = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
                written = 2 * batch * ROWS * GROUPS * STEPS * dim * itemsize
                row.append((accessed / written, accessed))
            cells = "".join(f"{ratio:10.2f}" for ratio, _ in row)
            print(f"   {slots:>7}{cells}   ({row[-1][1] / 2**20:.2f} MiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer settings and repeats (figures labelled so)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per setting (default 30, quick 10)"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    xla_timings(quick=args.quick, repeats=repeats)
    tpu_bytes(quick=args.quick)


if __name__ == "__main__":
    main()
