"""Child process of `test_sharding.py`: `sharded_attend` on simulated 8-device CPU meshes, against the oracle.

Run as a script with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before jax starts, which
is why it is its own process). The oracle is `data` independent single-device `BoundedKVManager`s, each
with S slots and the same registered source, stepped one by one with `attend` on one device. The same
steps then run through `sharded_attend` on the global cache (the oracle's initial per-shard caches
concatenated on the slot axis, heads repeated where the mesh replicates them) with the per-shard plans
concatenated shard-major. Where the mesh replicates KV heads the oracle's pools store the same copies
(`G' = model` heads, each query head's group of the same size as a shard's), so each shard runs the
oracle's attention shape; the outputs are also compared, within rounding, with pools of the `G` heads
unrepeated, whose larger groups XLA may reduce in another order. Prints one JSON line: per mesh case,
whether outputs and final caches are bit-identical, the collectives in the compiled step's HLO, and
each device's cache bytes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from functools import partial

import jax
import numpy as np

from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded import sharding as sh
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py
jax.config.update("jax_numpy_rank_promotion", "raise")

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SLOTS = 3  # S per data shard
ROWS = 3  # B: table rows per shard, every shard padded to it
TOKENS = 4  # T: a prefill chunk; decode rows bring 1 token and pad the rest
STEPS = 10  # the first request writes 4 + 9 = 13 entries: past its 2 written sink entries + 6-entry ring
SOURCE_LEN = 5
# (data, model, KV heads G, query heads H): every split of 8 devices, and G = 2 replicated 2x on model = 4.
CASES = {
    "8x1": (8, 1, 8, 16),
    "4x2": (4, 2, 8, 16),
    "2x4": (2, 4, 8, 16),
    "1x8": (1, 8, 8, 16),
    "2x4_replicated_kv": (2, 4, 2, 8),
}


def sharded_steps(mesh, config):
    """The jitted step over every layer through `sharded_attend`: (cache, bank, table, q, k, v) ->
    (cache, per-layer outputs), the cache donated."""

    @partial(jax.jit, donate_argnums=0)
    def sharded_step(cache, bank, table, q, k, v):
        outs = []
        for layer in range(config.num_layers):
            out, cache = sh.sharded_attend(
                mesh, cache, bank, BoundedKVPlan(table), layer, q[layer], k[layer], v[layer], config=config,
                implementation="xla",
            )  # fmt: skip
            outs.append(out)
        return cache, tuple(outs)

    return sharded_step


def shard_config(kv_heads: int) -> BoundedKVConfig:
    """One data shard's (and the oracle's) config: S slots, rows_per_request 2, a sink past the source."""
    return BoundedKVConfig(
        num_layers=2, num_heads=kv_heads, head_dim=8, rows_per_request=2, max_source_len=SOURCE_LEN,
        retention=lambda s: SinkWindow(s + 2, 6), max_slots=SLOTS,
    )  # fmt: skip


@partial(jax.jit, static_argnames="config", donate_argnums=0)
def oracle_step(cache, bank, table, q, k, v, *, config):
    outs = []
    for layer in range(config.num_layers):
        out, cache = attend(
            cache, bank, BoundedKVPlan(table), layer, q[layer], k[layer], v[layer], config=config,
            implementation="xla",
        )  # fmt: skip
        outs.append(out)
    return cache, tuple(outs)


@dataclasses.dataclass(frozen=True)
class Request:
    """A request of one shard: live over steps `[first, last]`, its first step a prefill chunk."""

    rid: str
    first: int
    last: int
    source_len: int
    prefill_span: int  # TOKENS, or TOKENS - 1 (one lookahead token, attended but not kept)


def shard_requests(shard: int) -> list[Request]:
    """Shard d has 1 + d % 3 requests joining two steps apart, with different sources and prefills.

    Odd shards start a step late, so they are all padding at step 0. On shards 3 and 7 the first request
    leaves after step 6 and a newcomer takes its slot at step 8 (a reused slot, whose old entries must
    never be read).
    """
    requests = [
        Request(f"d{shard}r{i}", 2 * i + shard % 2, STEPS - 1, (shard + 2 * i) % 6, TOKENS - i % 2)
        for i in range(1 + shard % 3)
    ]
    if shard % 4 == 3:
        requests[0] = dataclasses.replace(requests[0], last=6)
        requests.append(Request(f"d{shard}late", 8, STEPS - 1, 1, TOKENS))
    return requests


def run_oracle(kv_heads: int, query_heads: int, shards: int, copies: int = 1) -> dict:
    """Drive `shards` independent managers; returns the initial and final caches, plans, inputs, outputs.

    `copies > 1` stores each of the `kv_heads` heads that many times (source and step k/v alike)."""
    config = shard_config(kv_heads * copies)
    L, R, D = config.num_layers, config.rows_per_request, config.head_dim
    source = np.random.default_rng(7).standard_normal((2, L, R, kv_heads, SOURCE_LEN, D)).astype(np.float32)
    source = np.repeat(source, copies, axis=3)
    result = {"initial": [], "final": [], "tables": [], "inputs": [], "outputs": [], "bank": None}
    result["max_written"] = 0
    for shard in range(shards):
        manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, config), num_sources=1)
        manager.register_source(0, list(source[0]), list(source[1]))
        # Poison every slot: an entry read that the plan did not write turns the output into NaN.
        manager.cache = jax.tree.map(lambda x: x.at[:].set(np.nan), manager.cache)
        result["initial"].append(jax.device_get(manager.cache))
        result["bank"] = jax.device_get(manager.bank)
        written: dict[str, int] = {}
        tables, inputs, outputs = [], [], []
        for step in range(STEPS):
            live = [r for r in shard_requests(shard) if r.first <= step <= r.last]
            live = live[::-1] if (step + shard) % 2 else live  # vary which row holds which slot
            for rid in set(written) - {r.rid for r in live}:
                manager.remove_request(rid)
                del written[rid]
            tokens = {r.rid: TOKENS if r.first == step else 1 for r in live}
            spans = {r.rid: r.prefill_span if r.first == step else 1 for r in live}
            if live:
                for r in live:
                    if r.rid not in written:
                        manager.ingest_request(r.rid)
                        written[r.rid] = 0
                batch = [r.rid for r in live]
                padding = [f"pad{i}" for i in range(ROWS - len(batch))]
                lease = SlotLease(0, BucketKey("mixed", ROWS, TOKENS))
                ctx = StepContext(batch, "mixed", 0, capture=False, slot_lease=lease)
                ctx.set_padded_rids(batch + padding)
                bstep = BoundedKVStep(
                    tuple(Segment(rid, "main", spans[rid]) for rid in batch)
                    + tuple(Segment(p, "main", 0) for p in padding),
                    positions={r.rid: StreamPosition(r.source_len, written[r.rid], 0) for r in live},
                    step_tokens=tokens,
                )
                assert manager.admit(bstep, ctx).ok
                table = np.asarray(manager.plan(bstep, ctx).table)
            else:
                table = layout.padding_rows(ROWS, manager.padding_slot)
            rng = np.random.default_rng(1000 * shard + step)
            n = ROWS * R
            q = rng.standard_normal((L, n, TOKENS, query_heads, D)).astype(np.float32)
            k = np.repeat(rng.standard_normal((L, n, TOKENS, kv_heads, D)).astype(np.float32), copies, axis=3)
            v = np.repeat(rng.standard_normal((L, n, TOKENS, kv_heads, D)).astype(np.float32), copies, axis=3)
            manager.cache, out = oracle_step(manager.cache, manager.bank, table, q, k, v, config=config)
            if live:
                manager.commit(bstep, ctx)
                for rid in written:
                    written[rid] += spans[rid]
                result["max_written"] = max(result["max_written"], *written.values())
            tables.append(table)
            inputs.append((q, k, v))
            outputs.append(np.stack(jax.device_get(out)))
        result["final"].append(jax.device_get(manager.cache))
        for key, value in (("tables", tables), ("inputs", inputs), ("outputs", outputs)):
            result[key].append(value)
    return result


def copies(name: str) -> int:
    """How many times the mesh of case `name` stores each KV head."""
    _, model, kv_heads, _ = CASES[name]
    return sh.stored_heads(kv_heads, model) // kv_heads


def run_case(name: str, oracle: dict, unrepeated: dict) -> dict:
    data, model, kv_heads, _ = CASES[name]
    mesh = sh.make_mesh(data, model)
    config = dataclasses.replace(shard_config(kv_heads), max_slots=data * SLOTS)  # the global config
    shardings = sh.BoundedKVShardings.create(mesh, config)
    L = config.num_layers

    def global_cache(per_shard: list[BoundedKVCache]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The first `data` shards' caches concatenated on the slot axis, KV heads repeated for the mesh."""

        def layers(name: str) -> list[np.ndarray]:
            stacked = [np.concatenate([getattr(c, name)[l] for c in per_shard[:data]]) for l in range(L)]
            return [sh.repeat_kv_heads(x, model, axis=2) for x in stacked]

        return layers("k"), layers("v")

    k0, v0 = global_cache(oracle["initial"])
    cache = jax.device_put(BoundedKVCache(k=tuple(k0), v=tuple(v0)), shardings.cache)
    bank = jax.tree.map(lambda x: sh.repeat_kv_heads(x, model, axis=2), oracle["bank"])
    bank = jax.device_put(bank, shardings.bank)

    sharded_step = sharded_steps(mesh, config)

    def step_args(step: int):  # the step's k/v as the model makes them: G heads (sharded_attend repeats)
        table = np.concatenate([unrepeated["tables"][d][step] for d in range(data)])
        inputs = unrepeated["inputs"]
        rows = [
            tuple(np.concatenate([inputs[d][step][i][l] for d in range(data)]) for l in range(L))
            for i in range(3)
        ]
        where = (shardings.rows, shardings.step_kv, shardings.step_kv)
        placed = [jax.device_put(x, s) for x, s in zip(rows, where, strict=True)]
        return (jax.device_put(table, shardings.table), *placed)

    compiled = sharded_step.lower(cache, bank, *step_args(0)).compile()
    hlo = compiled.as_text()
    outputs_equal, finite, max_diff, max_diff_unrepeated = True, True, 0.0, 0.0
    for step in range(STEPS):
        cache, outs = compiled(cache, bank, *step_args(step))
        outs = np.stack(jax.device_get(outs))
        finite &= bool(np.isfinite(outs).all())
        for d in range(data):
            expected = oracle["outputs"][d][step]
            got = outs[:, d * ROWS * config.rows_per_request : (d + 1) * ROWS * config.rows_per_request]
            outputs_equal &= bool(np.array_equal(got, expected))
            max_diff = max(max_diff, float(np.nanmax(np.abs(got - expected))))
            diff = np.nanmax(np.abs(got - unrepeated["outputs"][d][step]))
            max_diff_unrepeated = max(max_diff_unrepeated, float(diff))
    expected_k, expected_v = global_cache(oracle["final"])
    caches_equal = all(
        np.array_equal(np.asarray(got), want, equal_nan=True)
        for got, want in zip((*cache.k, *cache.v), (*expected_k, *expected_v), strict=True)
    )
    per_device = {device.id: 0 for device in mesh.devices.flat}
    for layer in (*cache.k, *cache.v):
        for shard in layer.addressable_shards:
            per_device[shard.device.id] += shard.data.nbytes
    return {
        "outputs_equal": outputs_equal,
        "max_abs_diff": max_diff,
        "max_abs_diff_unrepeated": max_diff_unrepeated,
        "outputs_finite": finite,
        "caches_equal": caches_equal,
        "collectives": {op: hlo.count(op) for op in COLLECTIVES},
        "cache_bytes": cache.nbytes,
        "cache_bytes_per_device": sorted(per_device.values()),
        "stored_heads": cache.k[0].shape[2],
        "max_written": oracle["max_written"],
        "ring_entries": shard_config(kv_heads).slot_tokens,
    }


def control_collectives() -> dict[str, int]:
    """The same count on a program that must communicate (a sum over a sharded axis): proves it sees them."""
    mesh = sh.make_mesh(8, 1)
    x = jax.device_put(np.ones((8, 4), np.float32), jax.sharding.NamedSharding(mesh, sh.TABLE_SPEC))
    hlo = jax.jit(lambda x: x.sum(axis=0)).lower(x).compile().as_text()
    return {op: hlo.count(op) for op in COLLECTIVES}


def main() -> None:
    start = time.perf_counter()
    assert jax.device_count() == 8, jax.devices()
    shards: dict[tuple[int, int, int], int] = {}  # (G, H, copies) -> the most data shards a case needs
    for name, (data, _, g, h) in CASES.items():
        for heads in {(g, h, copies(name)), (g, h, 1)}:
            shards[heads] = max(shards.get(heads, 0), data)
    oracles = {(g, h, n): run_oracle(g, h, shards=count, copies=n) for (g, h, n), count in shards.items()}
    result = {
        name: run_case(name, oracles[g, h, copies(name)], oracles[g, h, 1])
        for name, (_, _, g, h) in CASES.items()
    }
    result["control"] = control_collectives()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
