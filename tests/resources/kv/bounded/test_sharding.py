"""`sharded_attend` on (data, model) meshes: the single-device results, no collective, the cache split evenly.

The mesh runs need eight simulated CPU devices, which XLA only creates when the flag is set before jax
starts, so they run once in a child process (`sharding_child.py`, described there) that prints its
findings as JSON; the tests here assert on them. The TPU checks compile the sharded step with libtpu for
a v5e 2x2 topology's compile-only devices (`mstar_jax.compile.offline_tpu`), in this process.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import offline_tpu
from mstar_jax.resources.kv.bounded import sharding as sh
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, SinkWindow
from tests.resources.kv.bounded.sharding_child import CASES, COLLECTIVES
from tests.simulated_devices import run_child

CHILD = Path(__file__).with_name("sharding_child.py")
DEVICES = 8


@pytest.fixture(scope="module")
def mesh_results() -> dict:
    return run_child(CHILD, devices=DEVICES)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_attend_matches_independent_single_device_pools(mesh_results, case):
    # Sharding changes no reduction (each shard runs the oracle's XLA attention over whole GQA groups of
    # its size, and the writes are copies), so float32 on CPU must agree to the bit; NaN-poisoned slots
    # stay unread. Replicated heads make a shard's groups smaller than unrepeated pools' (2 query heads
    # per KV head, not 4), which XLA's CPU dots may sum in another order on another ISA: within rounding.
    result = mesh_results[case]
    assert result["outputs_equal"], f"max |sharded - single device| = {result['max_abs_diff']}"
    assert result["max_abs_diff_unrepeated"] <= 1e-5
    assert result["outputs_finite"]
    assert result["caches_equal"]
    assert result["max_written"] > result["ring_entries"]  # the run went past the ring's wrap


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_step_has_no_collective(mesh_results, case):
    assert mesh_results[case]["collectives"] == dict.fromkeys(COLLECTIVES, 0)


def test_collective_count_sees_a_collective(mesh_results):
    # The same count on a sum over a data-sharded axis finds its all-reduce: a zero above means none.
    assert mesh_results["control"]["all-reduce"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_cache_bytes_split_evenly_over_devices(mesh_results, case):
    _, model, kv_heads, _ = CASES[case]
    result = mesh_results[case]
    assert result["cache_bytes_per_device"] == [result["cache_bytes"] // DEVICES] * DEVICES
    # Replicated KV heads cost model / G times the cache of the G heads (the documented price).
    assert result["stored_heads"] == sh.stored_heads(kv_heads, model) == max(kv_heads, model)


def test_make_mesh_names_sizes_and_devices():
    present = len(jax.devices())
    with pytest.raises(ValueError, match=r"data=2 x model=2 needs 4 devices; 1 cpu device\(s\) are given"):
        sh.make_mesh(2, 2, jax.devices()[:1])
    with pytest.raises(
        ValueError,
        match=rf"data={present + 1} x model=1 needs {present + 1} devices; {present} cpu device\(s\) are "
        rf"present \(on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count={present + 1} ",
    ):
        sh.make_mesh(present + 1, 1)
    with pytest.raises(ValueError, match=r"model=0 must be an int >= 1"):
        sh.make_mesh(1, 0)
    mesh = sh.make_mesh(1, 1)  # a smaller mesh takes the first devices
    assert mesh.axis_names == (sh.DATA, sh.MODEL)
    assert list(mesh.devices.flat) == jax.devices()[:1]


@pytest.mark.parametrize(
    ("kv_heads", "model", "stored"),
    [(8, 1, 8), (8, 2, 8), (8, 8, 8), (2, 4, 4), (1, 8, 8), (4, 8, 8)],
)
def test_stored_heads_shard_or_replicate(kv_heads, model, stored):
    assert sh.stored_heads(kv_heads, model) == stored


def test_head_counts_the_model_axis_cannot_split_are_refused():
    with pytest.raises(ValueError, match=r"kv_heads=6 cannot be split over model=4 shards"):
        sh.stored_heads(6, 4)
    with pytest.raises(ValueError, match=r"kv_heads=2 cannot be split over model=3 shards"):
        sh.check_heads(6, 2, 3)
    with pytest.raises(ValueError, match=r"query_heads=6 must be divisible by model=4"):
        sh.check_heads(6, 2, 4)


def test_repeat_kv_heads_puts_copies_of_head_j_together():
    x = np.arange(2 * 3 * 2 * 1, dtype=np.float32).reshape(2, 3, 2, 1)  # [N, T, G=2, D]
    repeated = sh.repeat_kv_heads(x, 4)
    assert isinstance(repeated, np.ndarray)
    np.testing.assert_array_equal(repeated, x[:, :, [0, 0, 1, 1]])  # stored head j = head j // 2
    assert sh.repeat_kv_heads(x, 2) is x  # already split evenly: no copy
    cache = jnp.zeros((5, 1, 1, 8, 4))  # [S + 1, R, G=1, C, D]
    assert sh.repeat_kv_heads(cache, 8, axis=2).shape == (5, 1, 8, 8, 4)


def config(kv_heads: int, slots: int, **kwargs) -> BoundedKVConfig:
    return BoundedKVConfig(
        num_layers=2, num_heads=kv_heads, head_dim=kwargs.pop("head_dim", 8), rows_per_request=1,
        max_source_len=kwargs.pop("source_len", 5), retention=kwargs.pop("retention", SinkWindow(3, 6)),
        max_slots=slots, **kwargs,
    )  # fmt: skip


def test_sharded_config_is_one_shards_geometry():
    mesh = AbstractMesh((2, 4), (sh.DATA, sh.MODEL))
    local = sh.sharded_config(config(kv_heads=8, slots=6), mesh)
    assert (local.max_slots, local.num_heads) == (3, 2)
    replicated = sh.sharded_config(config(kv_heads=2, slots=6), mesh)
    assert (replicated.max_slots, replicated.num_heads) == (3, 1)
    with pytest.raises(ValueError, match=r"max_slots=5 must be divisible by the mesh's data=2 shards"):
        sh.sharded_config(config(kv_heads=8, slots=5), mesh)


MISSING = offline_tpu.tpu_toolchain_missing()
_ATTENTION_CALL = re.compile(r"%sink_window_attention_tpu[\w.]* = .* custom-call\(")
TPU_CASES = {  # (data, model, KV heads, query heads, implementation) on v5e:2x2's four chips
    "2x2-pallas_tpu": (2, 2, 2, 4, "pallas_tpu"),
    "4x1-pallas_tpu": (4, 1, 2, 4, "pallas_tpu"),
    "2x2_replicated_kv-auto": (2, 2, 1, 4, "auto"),  # "auto" must pick the kernel for the TPU lowering
}


@pytest.mark.aot
@pytest.mark.skipif(MISSING is not None, reason=f"no offline TPU compiler: {MISSING}")
@pytest.mark.parametrize("case", list(TPU_CASES))
def test_sharded_step_compiles_for_tpu_with_the_kernel_and_no_collective(case):
    from jax.experimental import topologies

    data, model, kv_heads, query_heads, implementation = TPU_CASES[case]
    offline_tpu.tpu_device("v5e")  # sets libtpu's environment before it loads
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    mesh = sh.make_mesh(data, model, devices)
    batch = 4  # rows per data shard, one token each (decode)
    cfg = config(
        kv_heads, slots=8 * data, head_dim=128, source_len=24, min_source_len=24,
        retention=lambda s: SinkWindow(s + 4, 1000), dtype=jnp.bfloat16,
    )  # fmt: skip
    shardings = sh.BoundedKVShardings.create(mesh, cfg)
    rows = lambda heads, sharding: jax.ShapeDtypeStruct(  # noqa: E731
        (data * batch, 1, heads, 128), jnp.bfloat16, sharding=sharding
    )
    table = jax.ShapeDtypeStruct((data * batch, tbl.ROW_INTS), jnp.int32, sharding=shardings.table)
    q, kv = rows(query_heads, shardings.rows), rows(kv_heads, shardings.step_kv)

    def step(cache, bank, table, q, k, v):
        for layer in range(cfg.num_layers):  # each layer's output feeds the next: none is dead code
            q, cache = sh.sharded_attend(
                mesh, cache, bank, BoundedKVPlan(table), layer, q, k, v, config=cfg,
                implementation=implementation,
            )  # fmt: skip
        return q, cache

    cache, bank = sh.abstract_cache(cfg, mesh), sh.abstract_bank(cfg, mesh, num_sources=2)
    traced = jax.jit(step, donate_argnums=0).trace(cache, bank, table, q, kv, kv)
    compiled = traced.lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    assert {op: text.count(op) for op in COLLECTIVES} == dict.fromkeys(COLLECTIVES, 0)
    assert len(_ATTENTION_CALL.findall(text)) == cfg.num_layers
    # Each chip updates its share of every layer in place: the donated cache is aliased whole.
    cache_bytes = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v))
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes // len(devices)
