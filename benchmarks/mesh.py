"""The bounded KV cache on a `(data, model)` mesh: what the layers that run on one cost (docs/design.md §10).

On 8 simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`; the script reruns itself
with it when it is not set). Prints, from one run, ratios against baselines measured in the same run:
  1. a decode step (attention + store on every layer, `sharded_attend`) at global batches 8 and 32 on
     meshes 8x1, 4x2, 2x4 and 1x8 (and 1x1), as tokens/s ÷ plain `attend` on one device. Simulated devices
     share the host's cores, so this measures what partitioning costs, not how it scales. Beside it, what
     one device gathers per layer: the XLA path copies each row's retained K and V into [N, G, K, D]
     buffers, and on a CPU a step slows superlinearly once these outgrow the last-level cache, which a
     device's smaller share avoids (batch 32 on one device gathers 64 MiB a layer).
  2. host admit + plan_rows + plan + commit per row, `BoundedKVManager(data_shards=D)` for D in 1, 2, 4, 8 at
     the same global batch, ÷ one shard.
  3. each device's cache bytes on each mesh, measured from the sharded arrays' addressable shards and counted
     from shapes, ÷ the single-device cache's bytes (each data shard adds its own padding slot; KV heads
     replicated on `model` cost `model / G` copies).
  4. the engine serving one workload (`mesh_engine.py`) on meshes 4x2 and 8x1 (--quick: 4x2), as frames/s
     ÷ the same workload on one device, at the same global batch.
The timed variants run in alternation, in a fresh random order every repeat (`benchmarks.timing`); each
figure is the median of the per-repeat ratios, with their min–max over the repeat count.

Run: python -m benchmarks.mesh [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import mesh_engine
from benchmarks.timing import ORDER_NOTE, Spread, interleaved_times, quick_label
from benchmarks.timing import ratios as paired_ratios
from mstar_jax.resources.kv.bounded import sharding as sh
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

DEVICES = 8
DEVICE_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))  # (data, model): every split of the 8 devices
# One decode step of a small talker-like model: B requests of R = 1 row, T = 1 token, H query heads over
# G KV heads of dim D, C = SINK + WINDOW slot tokens; every request in its own slot, past the ring's wrap.
LAYERS, QUERY_HEADS, KV_HEADS, HEAD_DIM = 2, 16, 8, 64
SINK, WINDOW = 4, 508
SLOTS = 32  # S: every data shard's slots together
BATCHES = (8, 32)  # the global batches B timed (B / data requests per data shard); --quick: the first
HOST_BATCH = 32
WRITTEN = 4096
STEPS_PER_SAMPLE = 10  # one timed sample: this many steps back to back (a step takes milliseconds)
HOST_STEPS_PER_SAMPLE = 20
REPLICATED_KV_HEADS = 2  # section 3 also counts G = 2 heads, replicated on model = 4 and 8
ENGINE_MESHES = ((4, 2), (8, 1))  # section 4; --quick: the first


def make_config(
    *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, window: int = WINDOW
) -> BoundedKVConfig:
    return BoundedKVConfig(
        num_layers=LAYERS, num_heads=kv_heads, head_dim=head_dim, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(SINK, window), max_slots=SLOTS,
    )  # fmt: skip


def decode_batch(manager: BoundedKVManager, batch: int, written: int) -> tuple[BoundedKVStep, StepContext]:
    """Ingest `batch` requests positioned at `written` (without running those steps); their decode step."""
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        manager.ingest_request(rid)
        manager._requests[rid].written = written
    bucket = BucketKey("decode", batch // manager.data_shards, 1)  # rows per data shard
    ctx = StepContext(rids, "decode", 0, capture=False, slot_lease=SlotLease(0, bucket))
    return decode_step(rids, written), ctx


def decode_step(rids: list[str], written: int) -> BoundedKVStep:
    return BoundedKVStep(tuple(Segment(r, "main", 1) for r in rids), {r: Pos(0, written) for r in rids})


# 1. The device step.


@partial(jax.jit, static_argnames="config", donate_argnums=0)
def single_device_step(cache, bank, table, q, k, v, *, config):
    out = None
    for layer in range(config.num_layers):
        out, cache = attend(
            cache, bank, BoundedKVPlan(table), layer, q, k, v, config=config, implementation="xla"
        )
    return cache, out


@partial(jax.jit, static_argnames=("mesh", "config"), donate_argnums=0)
def sharded_step(cache, bank, table, q, k, v, *, mesh, config):
    out = None
    for layer in range(config.num_layers):
        out, cache = sh.sharded_attend(
            mesh, cache, bank, BoundedKVPlan(table), layer, q, k, v, config=config, implementation="xla"
        )
    return cache, out


def step_runner(mesh_shape: tuple[int, int] | None, batch: int, inputs: tuple[np.ndarray, ...]):
    """A zero-argument function running `STEPS_PER_SAMPLE` decode steps of `batch` requests on a mesh (None:
    one device, plain `attend`), and the manager whose (global, sharded) cache the steps carry."""
    config = make_config()
    data = 1 if mesh_shape is None else mesh_shape[0]
    manager = BoundedKVManager(BoundedKVSpec("kv", {"model"}, config), num_sources=1, data_shards=data)
    step, ctx = decode_batch(manager, batch, WRITTEN)
    assert manager.admit(step, ctx).ok
    table = np.asarray(manager.plan(step, ctx).table)  # shard-major, each shard's rows naming local slots
    q, k, v = inputs
    if mesh_shape is None:
        table, q, k, v = jax.device_put((table, q, k, v))
        step_fn = partial(single_device_step, config=config)
    else:
        mesh = sh.make_mesh(*mesh_shape)
        where = sh.BoundedKVShardings.create(mesh, config)
        manager.cache = jax.device_put(manager.cache, where.cache)
        manager.bank = jax.device_put(manager.bank, where.bank)
        table = jax.device_put(table, where.table)
        q, k, v = jax.device_put(q, where.rows), *jax.device_put((k, v), where.step_kv)
        step_fn = partial(sharded_step, mesh=mesh, config=config)

    def run():
        out = None
        for _ in range(STEPS_PER_SAMPLE):  # the same plan again: a step's cost does not depend on position
            manager.cache, out = step_fn(manager.cache, manager.bank, table, q, k, v)
        out.block_until_ready()

    return run, manager


def ratios_to_first(times: list[list[float]], *, inverse: bool = False) -> list[Spread]:
    """Per setting: its time ÷ the first setting's in the same repeat (`inverse`: the first's ÷ its, a
    throughput ratio), as the median and min–max over repeats."""
    return [Spread.of(paired_ratios(record, times[0], inverse=inverse)) for record in times]


def spread(ratio: Spread) -> str:
    return ratio.format(repeats=False)


def gathered_mib(rows: int, kv_heads: int) -> float:
    """MiB the XLA attention gathers on one device for one layer: K and V of every row's retained keys."""
    config = make_config()
    keys = min(config.max_retained, config.slot_capacity)
    return 2 * rows * kv_heads * keys * HEAD_DIM * np.dtype(config.dtype).itemsize / 2**20


STEP_VARIANTS = {"1 device, `attend`": None, "1x1": (1, 1), **{f"{d}x{m}": (d, m) for d, m in MESHES}}


def device_steps(batch: int, repeats: int) -> tuple[list[Spread], dict[str, BoundedKVCache]]:
    """Time every variant's decode step at `batch`; print the table; return the ratios and stepped caches."""
    rng = np.random.default_rng(batch)
    q = rng.standard_normal((batch, 1, QUERY_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((batch, 1, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((batch, 1, KV_HEADS, HEAD_DIM)).astype(np.float32)
    runners = {name: step_runner(shape, batch, (q, k, v)) for name, shape in STEP_VARIANTS.items()}
    times = interleaved_times([run for run, _ in runners.values()], repeats)
    ratios = ratios_to_first(times, inverse=True)
    print(f"\n### Global batch {batch}\n")
    columns = ("mesh", "rows x KV heads per device", "gathered K+V per device and layer", "ms per step")
    print("| " + " | ".join((*columns, "tokens/s", f"÷ 1 device, {repeats} repeats")) + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, shape), record, ratio in zip(STEP_VARIANTS.items(), times, ratios, strict=True):
        seconds = statistics.median(record) / STEPS_PER_SAMPLE
        data, model = shape or (1, 1)
        rows, heads = batch // data, KV_HEADS // model
        print(
            f"| {name} | {rows} x {heads} | {gathered_mib(rows, heads):g} MiB | {seconds * 1e3:.3f} "
            f"| {batch / seconds:,.0f} | {spread(ratio)} |"
        )
    return ratios, {name: manager.cache for name, (_, manager) in runners.items()}


# 2. Host planning.


def host_runner(data_shards: int):
    """A zero-argument function running `HOST_STEPS_PER_SAMPLE` steps' admit, plan_rows, plan and commit."""
    config = make_config(kv_heads=1, head_dim=8, window=60)  # the host's work does not depend on the arrays
    manager = BoundedKVManager(BoundedKVSpec("kv", {"model"}, config), data_shards=data_shards)
    step, ctx = decode_batch(manager, HOST_BATCH, 0)
    rids, state = list(ctx.request_ids), {"step": step}

    def run():
        for _ in range(HOST_STEPS_PER_SAMPLE):
            step = state["step"]
            assert manager.admit(step, ctx).ok
            manager.plan_rows(step, ctx)  # what an engine lays its query rows out by
            manager.plan(step, ctx)
            manager.commit(step, ctx)
            state["step"] = decode_step(rids, manager.written(rids[0]))

    return run


def host_planning(repeats: int) -> list[Spread]:
    shards = (1, 2, 4, 8)
    times = interleaved_times([host_runner(d) for d in shards], repeats)
    ratios = ratios_to_first(times)
    print(
        f"\n## 2. Host admit + plan_rows + plan + commit per decode step, global batch {HOST_BATCH}\n\n"
        f"`BoundedKVManager(data_shards=D)`, {SLOTS} slots; a sample is {HOST_STEPS_PER_SAMPLE} steps.\n"
    )
    print(f"| data shards D | µs per row | ÷ D=1, {repeats} repeats |")
    print("| --- | --- | --- |")
    for d, record, ratio in zip(shards, times, ratios, strict=True):
        us = statistics.median(record) / HOST_STEPS_PER_SAMPLE / HOST_BATCH * 1e6
        print(f"| {d} | {us:.2f} | {spread(ratio)} |")
    return ratios


# 3. Cache bytes per device.


def per_device_bytes(cache: BoundedKVCache) -> list[int]:
    """Each device's bytes of every layer's K and V, from the arrays' addressable shards (sorted)."""
    totals: dict[int, int] = {}
    for layer in (*cache.k, *cache.v):
        for shard in layer.addressable_shards:
            totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    return sorted(totals.values())


def counted_bytes(config: BoundedKVConfig, mesh_shape: tuple[int, int]) -> int:
    """One device's cache bytes from shapes: its data shard's slots and padding slot, its stored heads."""
    local = sh.sharded_config(config, sh.make_mesh(*mesh_shape))
    return BoundedKVCache.abstract(local).nbytes


def allocated(config: BoundedKVConfig, mesh_shape: tuple[int, int]) -> BoundedKVCache:
    """The global cache of `config` on a mesh, allocated in place (zeros) from its sharded abstract arrays."""
    zeros = lambda s: jax.jit(partial(jnp.zeros, s.shape, s.dtype), out_shardings=s.sharding)()  # noqa: E731
    return jax.tree.map(zeros, sh.abstract_cache(config, sh.make_mesh(*mesh_shape)))


def cache_bytes(caches: dict[str, BoundedKVCache]) -> list[float]:
    """Print each mesh's per-device cache bytes; return their ratios to one device's, in `MESHES` order."""
    config, replicated = make_config(), make_config(kv_heads=REPLICATED_KV_HEADS)
    rows = [(config, (d, m), caches[f"{d}x{m}"]) for d, m in MESHES]
    # KV heads replicated on model: only where model > G (each device then holds one stored head).
    rows += [
        (replicated, (d, m), allocated(replicated, (d, m))) for d, m in MESHES if m > replicated.num_heads
    ]
    print(
        f"\n## 3. Cache bytes per device ÷ one device's cache of the same G ({SLOTS} slots + padding)\n\n"
        "Measured: each device's addressable shards of the global cache (stepped in section 1, or allocated "
        "for the replicated rows). Counted: `BoundedKVCache.abstract(sharded_config(...))`. Even share: "
        "1 / devices.\n"
    )
    columns = ("mesh", "KV heads G (stored G')", "slots per device", "bytes per device, measured", "counted")
    print("| " + " | ".join((*columns, "÷ 1 device", "even share")) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    shares = []
    for cfg, (d, m), cache in rows:
        measured = per_device_bytes(cache)
        shown = f"{measured[0]:,}" if measured[0] == measured[-1] else f"{measured[0]:,}–{measured[-1]:,}"
        share = measured[-1] / BoundedKVCache.abstract(cfg).nbytes
        shares.append(share)
        print(
            f"| {d}x{m} | {cfg.num_heads} ({sh.stored_heads(cfg.num_heads, m)}) | {SLOTS // d} + 1 | {shown} "
            f"| {counted_bytes(cfg, (d, m)):,} | {share:.3f} | {1 / (d * m):.3f} |"
        )
    return shares[: len(MESHES)]


def readme_rows(
    steps: dict[int, list[Spread]],
    host: list[Spread],
    shares: list[float],
    engine: dict[str, Spread],
    label: str = "",
) -> None:
    """The headline figures as rows of docs/guides/benchmarks.md's table (`label`: a quick run's, printed)."""
    names = "/".join(f"{d}x{m}" for d, m in MESHES)
    rows = [
        (
            f"decode tokens/s at batch {batch} (1 device gathers {gathered_mib(batch, KV_HEADS):g} MiB a "
            f"layer), {names} ÷ 1 device; {DEVICES} simulated devices on {os.cpu_count()} cores: overhead "
            "and cache locality, not scaling",
            " / ".join(f"{ratio.median:.2f}" for ratio in ratios[-len(MESHES) :]),
        )
        for batch, ratios in steps.items()
    ]
    rows.append(
        (f"host admit + plan + commit per row, 8 data shards ÷ 1, batch {HOST_BATCH}", spread(host[-1]))
    )
    rows.append(
        (
            f"cache bytes per device ÷ 1 device's, {names} (even share 0.125)",
            " / ".join(f"{x:.3f}" for x in shares),
        )
    )
    rows.append(
        (
            f"engine frames/s, one workload of {mesh_engine.REQUESTS} requests, {'/'.join(engine)} ÷ 1 "
            f"device (same global batch; simulated devices on {os.cpu_count()} cores)",
            " / ".join(spread(ratio) for ratio in engine.values()),
        )
    )
    print(f"\n## Summary rows{label}\n\n| script | figure | result |\n| --- | --- | --- |")
    for i, (figure, result) in enumerate(rows):
        print(f"| {'`benchmarks/mesh.py`' if i == 0 else ''} | {figure} | {result} |")


def last_level_cache() -> str:
    """The host's last-level CPU cache size as Linux reports it, e.g. "L3 32768K"."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    try:
        level, size = ((caches[-1] / name).read_text().strip() for name in ("level", "size"))
    except (IndexError, OSError):
        return "its size unknown here"
    return f"L{level}: {size} here"


def rerun_with_simulated_devices(argv: list[str]) -> None:
    """Run this script again in a child whose jax starts with `DEVICES` CPU devices; relay its output."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}".strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    command = [sys.executable, "-m", "benchmarks.mesh", *argv]
    root = Path(__file__).resolve().parents[1]
    with subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            print(line, end="", flush=True)
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed with status {child.returncode}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"batch {BATCHES[0]} only, fewer repeats (labelled so)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed samples per variant (default 30, quick 5)"
    )
    args = parser.parse_args(argv)
    # XLA creates the simulated devices only if the flag is set before jax starts its CPU backend.
    if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", "").split() or os.environ.get("JAX_PLATFORMS") != "cpu":
        rerun_with_simulated_devices(argv)
        return
    if jax.device_count() != DEVICES:
        raise SystemExit(f"{DEVICES} simulated CPU devices expected, found {jax.devices()}")
    repeats = args.repeats or (5 if args.quick else 30)
    start = time.perf_counter()
    label = quick_label(args.quick, f"batch {BATCHES[0]} only, {repeats} repeats")
    print(
        f"# benchmarks/mesh.py{label}\n\njax {jax.__version__}, {jax.device_count()} simulated CPU devices; "
        f"{ORDER_NOTE}; figures are medians (min–max)\n"
    )
    print(
        f"## 1. Decode step: attention + store, {LAYERS} layers, on each mesh ÷ on 1 device\n\n"
        f"H={QUERY_HEADS} G={KV_HEADS} D={HEAD_DIM} C={SINK + WINDOW}, T=1, {SLOTS} slots, past the ring's "
        f"wrap; a sample is {STEPS_PER_SAMPLE} steps. The {DEVICES} simulated devices share this host's "
        f"{os.cpu_count()} CPU cores, so this measures the partitioning overhead of `sharded_attend` "
        f"(shard_map), not scaling: {os.cpu_count()} cores bound a fair gain. Gains past that come from each "
        "device's smaller working set: the XLA path gathers every row's retained K and V (the 'gathered' "
        "column), and on a CPU a step slows superlinearly once that outgrows the last-level cache "
        f"({last_level_cache()})."
    )
    steps, caches = {}, {}
    for batch in BATCHES[:1] if args.quick else BATCHES:
        steps[batch], caches = device_steps(batch, repeats)
    host = host_planning(repeats)
    shares = cache_bytes(caches)
    engine_meshes = ENGINE_MESHES[:1] if args.quick else ENGINE_MESHES
    engine = mesh_engine.engine_section(engine_meshes, repeats, os.cpu_count())
    names = [f"{d}x{m}" for d, m in engine_meshes]
    readme_rows(steps, host, shares, dict(zip(names, engine, strict=True)), label)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
