"""Bucketed capture: what it costs at load, what the persistent cache saves, what serving gains.

The step is the bounded KV attention over every layer of one cache (`attend`, XLA path) at a
deployment's geometry and buckets (the embedded default deployment unless `--deployment`). Prints,
from one run:
  1. capture time and compiled memory per bucket, and the totals;
  2. second start / first start: capture time (and the whole process's wall time) in two fresh
     processes sharing a temporary directory, two ways: JAX's persistent compilation cache (goal
     <= 0.2; lowering is not cached, so the compile-only ratio is shown too), and the executable store
     (`ExecutableStore`: nothing traced, lowered or compiled on the second start; goal <= 0.1, 0
     programs compiled). Repeated with a fresh directory each time (the first start always runs before
     the second: that is the comparison); median and min–max of the per-repeat ratios;
  3. un-captured `jit` / captured replay: wall time over one workload of random (batch, tokens) steps,
     the `jit` path called at the real shapes and paying every compile it meets (its caches cleared
     before each repeat), the captured path padding to the tightest bucket (it must compile nothing);
     then the same with `jit` warm. Each repeat times both in a fresh random order (`benchmarks.timing`).

Run: python -m benchmarks.compile [--quick] [--repeats N] [--deployment PATH] [--resource talker_kv]
     [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label, ratios
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import (
    BucketSet,
    ExecutableStore,
    cap_batch_sizes,
    capture,
    count_compilations,
    enable_persistent_cache,
)
from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment
from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

NUM_SOURCES = 2


@dataclasses.dataclass(frozen=True)
class Setup:
    """The cache's config, the query heads that read it, and the buckets compiled."""

    config: BoundedKVConfig
    heads: int
    buckets: BucketSet


def step(cache, bank, table, q, k, v, *, config):
    """Attention over the retained stream at every layer, then the store: one model step's cache work."""
    plan, out = BoundedKVPlan(table), None
    for layer in range(config.num_layers):
        out, cache = attend(cache, bank, plan, layer, q, k, v, config=config, implementation="xla")
    return cache, out


def make_setup(args) -> Setup:
    deployment = load_deployment(args.deployment)
    spec = deployment.spec(args.resource)
    config = spec.config
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    if args.max_slots is not None:
        config = dataclasses.replace(config, max_slots=args.max_slots)
    # The query heads of the node reading this cache: "talker_kv" is read with the model's talker_heads.
    heads = getattr(deployment.model_config, args.resource.removesuffix("_kv") + "_heads", config.num_heads)
    max_batch = min(deployment.engine.max_batch, config.max_slots)
    batch_sizes = cap_batch_sizes(args.batch_sizes or deployment.batch_sizes, max_batch)
    token_counts = tuple(args.token_counts or deployment.token_counts)
    if args.quick:
        batch_sizes, token_counts = batch_sizes[:2], token_counts[:2]
    buckets = BucketSet(graph_walk=args.resource, batch_sizes=batch_sizes, token_counts=token_counts)
    return Setup(config=config, heads=heads, buckets=buckets)


def abstract_args(setup: Setup, bucket):
    cfg, n, t = setup.config, bucket.bs * setup.config.rows_per_request, bucket.num_tokens
    return (
        BoundedKVCache.abstract(cfg),
        SourceBank.abstract(cfg, NUM_SOURCES),
        jax.ShapeDtypeStruct((bucket.bs, tbl.ROW_INTS), jnp.int32),
        jax.ShapeDtypeStruct((n, t, setup.heads, cfg.head_dim), cfg.dtype),
        jax.ShapeDtypeStruct((n, t, cfg.num_heads, cfg.head_dim), cfg.dtype),
        jax.ShapeDtypeStruct((n, t, cfg.num_heads, cfg.head_dim), cfg.dtype),
    )


def capture_step(setup: Setup, progress: bool = False, store: ExecutableStore | None = None):
    return capture(
        step, setup.buckets, lambda bucket: abstract_args(setup, bucket),
        static_kwargs={"config": setup.config}, donate_argnums=0, name=f"attend[{setup.buckets.graph_walk}]",
        progress=progress, store=store,
    )  # fmt: skip


def random_batch(rng, setup: Setup, bs: int, tokens: int):
    """A plan for `bs` requests in distinct slots with random positions, and their step tokens."""
    cfg = setup.config
    step_tokens = rng.integers(1, tokens + 1, bs)
    step_tokens[0] = tokens
    source_len = rng.integers(cfg.min_source_len, cfg.max_source_len + 1, bs)
    policies = [cfg.retention_for(int(s)) for s in source_len]
    table = layout.plan_table(
        slot=rng.permutation(cfg.max_slots)[:bs], source=rng.integers(0, NUM_SOURCES, bs),
        source_len=source_len,
        written=rng.integers(0, 4 * cfg.slot_tokens + 1, bs), span=rng.integers(0, step_tokens + 1),
        step_tokens=step_tokens, sink=[p.sink for p in policies], window=[p.window for p in policies],
        window_includes_step=False, sink_capacity=cfg.sink_capacity, reverse=cfg.reverse_step_order,
        slot_tokens=cfg.slot_tokens,
    )  # fmt: skip
    n, d = bs * cfg.rows_per_request, cfg.head_dim
    q = rng.standard_normal((n, tokens, setup.heads, d)).astype(cfg.dtype)
    k = rng.standard_normal((n, tokens, cfg.num_heads, d)).astype(cfg.dtype)
    return table, q, k, k.copy()


def child(args) -> None:
    """One start: capture every bucket with the persistent cache on, or from the executable store;
    print the timings as JSON."""
    setup = make_setup(args)
    store = None
    if args.store:
        store = ExecutableStore(os.path.join(args.cache_dir, "executables"))
    else:
        enable_persistent_cache(
            args.cache_dir, min_compile_secs=args.min_compile_secs, min_entry_size_bytes=-1
        )
    with count_compilations() as counter:
        report = capture_step(setup, store=store).report
    result = {
        "wall": report.wall_secs, "compile": report.compile_secs, "hits": report.cache_hits,
        "loaded": report.loaded, "compiled": counter.count,
    }  # fmt: skip
    print("RESULT " + json.dumps(result))


def start_process(argv: list[str], cache_dir: str, *, store: bool = False) -> dict:
    """One start in a fresh process; its `child` result, with the process's wall time as "process"."""
    repo = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks.compile", *argv, "--child", "--cache-dir", cache_dir]
    command += ["--store"] if store else []
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=repo, check=False)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "process": seconds}


def workload(rng, setup: Setup, steps: int) -> list:
    return [
        random_batch(rng, setup, int(rng.integers(1, setup.buckets.max_batch + 1)),
                     int(rng.integers(1, setup.buckets.max_tokens + 1)))
        for _ in range(steps)
    ]  # fmt: skip


def pad_batch(bucket, config: BoundedKVConfig, table, q, k, v, *, fill=0.0) -> tuple:
    """A batch of raw plan-table rows and their q, k, v grown to `bucket`: padding rows that read and
    write nothing (`layout.padding_rows`), and `fill` where no row has a token (each row's step tokens
    mask it, so any value works; tests pass NaN to prove it)."""
    rows, r = bucket.bs - table.shape[0], config.rows_per_request
    padding = layout.padding_rows(rows, config.max_slots)
    grow = ((0, rows * r), (0, bucket.num_tokens - q.shape[1]), (0, 0), (0, 0))
    return (
        np.concatenate([table, padding]),
        *(np.pad(x, grow, constant_values=fill) for x in (q, k, v)),
    )


def run_replay(captured, setup: Setup, batches, cache, bank):
    outs = []
    for table, q, k, v in batches:
        bucket = setup.buckets.bucket_for(table.shape[0], q.shape[1])
        padded = pad_batch(bucket, setup.config, table, q, k, v)
        cache, out = captured.replay(bucket, cache, bank, *padded)
        outs.append(np.asarray(out)[: q.shape[0], : q.shape[1]])  # the real rows and tokens
    return cache, outs


def run_jit(jitted, setup: Setup, batches, cache, bank):
    outs = []
    for table, q, k, v in batches:
        cache, out = jitted(cache, bank, table, q, k, v, config=setup.config)
        outs.append(np.asarray(out))
    return cache, outs


def timed(fn, *args):
    with count_compilations() as counter:
        begin = time.perf_counter()
        cache, outs = fn(*args)
        jax.block_until_ready(cache)
        seconds = time.perf_counter() - begin
    return seconds, counter, cache, outs


def steps_for(args) -> int:
    return args.steps or (30 if args.quick else 100)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--deployment", default=str(DEFAULT_CONFIG), help="deployment YAML (default: embedded)"
    )
    parser.add_argument("--resource", default="talker_kv", help="which bounded KV cache of the deployment")
    parser.add_argument("--layers", type=int, default=None, help="override the cache's layer count")
    parser.add_argument("--max-slots", type=int, default=None, help="override the cache's max_slots")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="override the batch buckets")
    parser.add_argument(
        "--token-counts", type=int, nargs="+", default=None, help="override the token buckets"
    )
    parser.add_argument("--steps", type=int, default=None, help="workload steps (default 100, quick 30)")
    parser.add_argument("--min-compile-secs", type=float, default=0.0, help="persistent cache threshold")
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of sections 2 and 3 (default 3, quick 2)"
    )
    parser.add_argument("--quick", action="store_true", help="two batch and two token buckets, fewer steps")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    child_argv = list(argv if argv is not None else sys.argv[1:])

    setup = make_setup(args)
    cfg = setup.config
    print(
        f"backend: {jax.default_backend()}  cache {args.resource}: {cfg.num_layers} layers, "
        f"{cfg.num_heads} K/V heads of {cfg.head_dim}, {setup.heads} query heads, "
        f"{cfg.rows_per_request} row(s), {cfg.max_slots} slots, {cfg.slot_tokens} tokens per slot, "
        f"{cfg.dtype.name}\nbuckets: batch {list(setup.buckets.batch_sizes)} x tokens "
        f"{list(setup.buckets.token_counts)}"
    )

    repeats = args.repeats or (2 if args.quick else 3)
    label = quick_label(
        args.quick, f"{len(setup.buckets)} buckets, {steps_for(args)} steps, {repeats} repeats"
    )
    captured = capture_step(setup, progress=True)
    print(f"\n1. capture (no persistent cache){label}\n{captured.report}")
    for store in (False, True):
        pairs = []
        for _ in range(repeats):  # a fresh directory per repeat: the first start must find it empty
            with tempfile.TemporaryDirectory(prefix="mstar-jax-cache-") as cache_dir:
                run = lambda: start_process(child_argv, cache_dir, store=store)  # noqa: B023, E731
                pairs.append((run(), run()))
        first, second = zip(*pairs, strict=True)
        how = "the executable store" if store else "JAX's persistent compilation cache"
        print(f"\n2{'b' if store else 'a'}. second start / first start, fresh processes sharing {how}{label}")
        print(
            f"   {repeats} repeats of (first, second), in that order by construction; median (min–max) of "
            "the per-repeat ratios"
        )
        goal = "  (goal <= 0.1)" if store else "  (goal <= 0.2)"
        keys = (("wall", "capture wall", goal), ("process", "process wall", ""))
        keys += () if store else (("compile", "compile only", ""),)
        for key, name, target in keys:
            firsts, seconds = [p[key] for p in first], [p[key] for p in second]
            print(
                f"   {name}: {statistics.median(seconds):8.3f} s / {statistics.median(firsts):8.3f} s = "
                f"{describe(ratios(seconds, firsts), '.3f')}{target}"
            )
        found = [p["loaded"] if store else p["hits"] for p in second]
        print(
            f"   {'loaded' if store else 'from the cache'} on second starts: {found} of {len(setup.buckets)}"
        )
        compiled = "programs compiled" if store else "backend compiles (persistent-cache loads included)"
        print(f"   {compiled} on second starts: {[p['compiled'] for p in second]}")

    steps = steps_for(args)
    rng = np.random.default_rng(0)
    batches = workload(rng, setup, steps)
    bank = SourceBank.create(cfg, NUM_SOURCES)
    jitted = jax.jit(step, donate_argnums=0, static_argnames=("config",))
    counts: dict[str, list[int]] = {"replay": [], "jit": [], "warm jit": []}
    outs: dict[str, list] = {}

    def case(name: str, fn, *fn_args, cold: bool = False):
        def run() -> float:
            if cold:
                jax.clear_caches()  # the jit path gets no help from programs compiled before
            seconds, counter, _, result = timed(
                fn, *fn_args, setup, batches, BoundedKVCache.create(cfg), bank
            )
            counts[name].append(counter.count)
            outs.setdefault(name, result)
            return seconds

        return run

    cold = interleaved_times(
        {"replay": case("replay", run_replay, captured), "jit": case("jit", run_jit, jitted, cold=True)},
        repeats, warmup=0, self_timed=True,
    )  # fmt: skip
    for got, want in zip(outs["replay"], outs["jit"], strict=True):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-3)
    warm = interleaved_times(
        {"replay": case("replay", run_replay, captured), "warm jit": case("warm jit", run_jit, jitted)},
        repeats, warmup=1, self_timed=True,
    )  # fmt: skip
    shapes = len({(t.shape[0], q.shape[1]) for t, q, _, _ in batches})
    print(f"\n3. {steps} steps of random (batch, tokens), {shapes} distinct shapes{label}")
    print(f"   {ORDER_NOTE}; median (min–max) over {repeats} repeats")
    print(
        f"   captured replay      : {statistics.median(cold['replay']):8.3f} s, "
        f"{max(counts['replay'])} compilations at most"
    )
    print(
        f"   jit at real shapes   : {statistics.median(cold['jit']):8.3f} s, {min(counts['jit'])}–"
        f"{max(counts['jit'])} compilations (caches cleared before each)"
    )
    print(f"   jit / replay         : {describe(ratios(cold['jit'], cold['replay']), unit='x')}")
    print(
        f"   warm jit / replay    : {describe(ratios(warm['warm jit'], warm['replay']), unit='x')}  (every "
        f"shape compiled, {max(counts['warm jit'][1:], default=0)} compilations: what padding costs)"
    )


if __name__ == "__main__":
    main()
