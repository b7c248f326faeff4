"""Many hosts: settings, which data shards a process serves, and a sharded step run by two processes.

The two-process test starts this module twice as a script (`python -m tests.test_distributed`), on
localhost, each process with 4 simulated CPU devices: together one 8-device `(data=4, model=2)` mesh,
process 0 holding data shards 0 and 1, process 1 shards 2 and 3. Each child joins through
`mstar_jax.distributed.initialize`, runs the oracle of `sharding_child.py` (independent single-device
`BoundedKVManager`s, stepped with `attend`) up to its last shard, builds the global cache, bank, plan and step
inputs from ONLY its local shards' data (`jax.make_array_from_process_local_data`), runs
`sharded_attend` for every step (prefills, decodes, a slot reused, past the ring's wrap), and compares
its shards' outputs and final cache with the oracle's bit for bit. It then gathers every process's
shard list over gloo (a real cross-process collective) and prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from mstar_jax import distributed
from mstar_jax.distributed import DistributedSettings, initialize, local_data_shards
from tests.simulated_devices import last_json, report_as_process, run_processes

PROCESSES = 2
LOCAL_DEVICES = 4
MESH = (4, 2)  # (data, model): data shards 0-1 on process 0, 2-3 on process 1
CHILD_TIMEOUT_S = 120
ADDRESS = "127.0.0.1:1234"


# --- settings -------------------------------------------------------------------------------------


def test_settings_keep_explicit_values_and_make_device_ids_a_tuple():
    settings = DistributedSettings(
        coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1, local_device_ids=[4, 5]
    )
    assert settings.local_device_ids == (4, 5)
    assert settings.initialization_timeout_s == 300
    assert DistributedSettings(coordinator_address="[::1]:80", num_processes=1, process_id=0).process_id == 0


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("coordinator_address", 1234, TypeError, r"coordinator_address=1234 must be a str 'host:port'"),
        ("coordinator_address", "10.0.0.1", ValueError, r"'10.0.0.1' must be 'host:port'"),
        ("coordinator_address", ":1234", ValueError, r"':1234' must be 'host:port'"),
        ("coordinator_address", "host:0", ValueError, r"port in \[1, 65535\]"),
        ("coordinator_address", "host:65536", ValueError, r"port in \[1, 65535\]"),
        ("num_processes", 0, ValueError, r"num_processes=0 must be an int >= 1"),
        ("num_processes", True, TypeError, r"num_processes=True must be an int >= 1, got bool"),
        ("num_processes", "2", TypeError, r"num_processes='2' must be an int >= 1, got str"),
        ("process_id", -1, ValueError, r"process_id=-1 must be an int >= 0"),
        ("process_id", 2, ValueError, r"process_id=2 must be < num_processes=2 \(process ids are 0, 1"),
        ("local_device_ids", "0,1", TypeError, r"local_device_ids='0,1' must be a sequence of ints"),
        ("local_device_ids", [0, -1], ValueError, r"local_device_ids\[1\]=-1 must be an int >= 0"),
        ("local_device_ids", [0, 1.0], TypeError, r"local_device_ids\[1\]=1.0 must be an int >= 0, got"),
        ("local_device_ids", [1, 1], ValueError, r"local_device_ids=\[1, 1\] must be non-empty and distinct"),
        ("local_device_ids", (), ValueError, r"local_device_ids=\[\] must be non-empty"),
        ("initialization_timeout_s", 0, ValueError, r"initialization_timeout_s=0 must be an int >= 1"),
    ],
)  # fmt: skip
def test_settings_refuse_bad_fields_naming_field_value_and_what_is_allowed(field, value, error, match):
    fields = {"coordinator_address": ADDRESS, "num_processes": 2, "process_id": 0, field: value}
    with pytest.raises(error, match=match):
        DistributedSettings(**fields)


ENV = {"MSTAR_COORDINATOR_ADDRESS": "10.0.0.1:1234", "MSTAR_NUM_PROCESSES": "2", "MSTAR_PROCESS_ID": "1"}


def test_settings_from_env():
    assert DistributedSettings.from_env({"PATH": "/bin"}) is None  # single process: nothing to join
    assert DistributedSettings.from_env(ENV) == DistributedSettings(
        coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1
    )
    settings = DistributedSettings.from_env(
        {**ENV, "MSTAR_LOCAL_DEVICE_IDS": "4, 5,6"}, initialization_timeout_s=30
    )
    assert settings.local_device_ids == (4, 5, 6)
    assert settings.initialization_timeout_s == 30


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        (
            {"MSTAR_NUM_PROCESSES": "2"},
            r"MSTAR_COORDINATOR_ADDRESS, MSTAR_PROCESS_ID must be set too: .*\(only MSTAR_NUM_PROCESSES",
        ),
        ({"MSTAR_LOCAL_DEVICE_IDS": "0"}, r"\(only MSTAR_LOCAL_DEVICE_IDS found\)"),
        ({**ENV, "MSTAR_NUM_PROCESSES": "two"}, r"MSTAR_NUM_PROCESSES='two' must be an integer"),
        ({**ENV, "MSTAR_LOCAL_DEVICE_IDS": "0;1"}, r"MSTAR_LOCAL_DEVICE_IDS='0;1' must be comma-separated"),
        (
            {**ENV, "MSTAR_PROCESS_ID": "2"},
            r"process_id=2 must be < num_processes=2 .*\(settings read from MSTAR_COORDINATOR_ADDRESS",
        ),
    ],
)
def test_settings_from_env_name_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        DistributedSettings.from_env(environ)


# --- initialize (in this process, with jax.distributed replaced: the real one runs in the children) ---


@pytest.fixture
def fake_jax_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "_initialized", None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    before = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", None)
    yield calls
    jax.config.update("jax_cpu_collectives_implementation", before)


def test_initialize_joins_once_with_gloo_cpu_collectives(fake_jax_distributed):
    settings = DistributedSettings(
        coordinator_address=ADDRESS, num_processes=2, process_id=1, local_device_ids=(4, 5)
    )
    initialize(settings)
    initialize(dataclasses.replace(settings))  # equal settings: nothing more happens
    assert fake_jax_distributed == [
        {
            "coordinator_address": ADDRESS,
            "num_processes": 2,
            "process_id": 1,
            "local_device_ids": [4, 5],
            "cluster_detection_method": "deactivate",  # the settings are the whole truth
            "initialization_timeout": 300,
        }
    ]
    assert jax.config.jax_cpu_collectives_implementation == "gloo"
    with pytest.raises(RuntimeError, match=r"already joined .* cannot join another with .*process_id=0"):
        initialize(dataclasses.replace(settings, process_id=0))


def test_initialize_refuses_a_job_joined_some_other_way(fake_jax_distributed):
    fake_jax_distributed.append("initialized outside")
    with pytest.raises(RuntimeError, match=r"already called outside mstar_jax.distributed.initialize"):
        initialize(DistributedSettings(coordinator_address=ADDRESS, num_processes=2, process_id=0))
    with pytest.raises(TypeError, match=r"settings must be a DistributedSettings, got dict"):
        initialize({"coordinator_address": ADDRESS})


# --- local_data_shards (fake meshes of objects with a process_index) --------------------------------


def fake_mesh(owners: list[list[int]], axis_names=("data", "model")) -> SimpleNamespace:
    """A mesh of fake devices: `owners[i][j]` is the process of the device at mesh position (i, j)."""
    devices = np.empty((len(owners), len(owners[0])), dtype=object)
    for (i, j), owner in np.ndenumerate(np.asarray(owners)):
        devices[i, j] = SimpleNamespace(id=i * devices.shape[1] + j, process_index=int(owner))
    return SimpleNamespace(axis_names=axis_names, devices=devices)


def test_local_data_shards_are_the_shards_a_process_holds_whole():
    mesh = fake_mesh([[0, 0], [0, 0], [1, 1], [1, 1]])  # data=4 x model=2 over 2 processes of 4 devices
    assert local_data_shards(mesh, process_index=0) == (0, 1)
    assert local_data_shards(mesh, process_index=1) == (2, 3)
    assert local_data_shards(mesh, process_index=2) == ()  # a process with no device in the mesh
    # The same mesh laid out (model, data): shards are still read along the data axis.
    transposed = SimpleNamespace(axis_names=("model", "data"), devices=mesh.devices.T)
    assert local_data_shards(transposed, process_index=1) == (2, 3)
    interleaved = fake_mesh([[1, 1], [0, 0], [1, 1], [0, 0]])
    assert local_data_shards(interleaved, process_index=1) == (0, 2)


def test_local_data_shards_refuse_a_shard_spanning_processes():
    # data=2 x model=4 over 4 processes of 2 devices: every shard's heads sit in two processes.
    mesh = fake_mesh([[0, 0, 1, 1], [2, 2, 3, 3]])
    with pytest.raises(
        ValueError,
        match=r"data shard 0 on devices \[0, 1, 2, 3\] spans processes \[0, 1\]; data shard 1 .* spans "
        r"processes \[2, 3\]: .* a data shard's 4 model devices must belong to one process",
    ):
        local_data_shards(mesh, process_index=0)
    with pytest.raises(ValueError, match=r"mesh axes \('x', 'model'\) must be \('data', 'model'\)"):
        local_data_shards(fake_mesh([[0]], axis_names=("x", "model")), process_index=0)


def test_local_data_shards_of_a_single_process_mesh_are_all_of_them():
    from mstar_jax.resources.kv.bounded.sharding import make_mesh

    assert local_data_shards(make_mesh(1, 1)) == (0,)  # jax.process_index() == 0 here


# --- two processes ----------------------------------------------------------------------------------


def test_host_local_of_one_process_is_device_get_and_keeps_no_device_array_alive():
    """One process's `host_local` gives what `jax.device_get` gives, the tree's other leaves as they are,
    and its host copies hold no reference to the device arrays (a view through the buffer protocol would
    keep each alive as long as any output read from it)."""
    import gc
    import weakref

    arrays = {"codes": jax.numpy.arange(12, dtype=jax.numpy.int32).reshape(3, 4), "mel": jax.numpy.ones(5)}
    tree = (arrays, np.arange(3), 7)
    got, want = distributed.host_local(tree), jax.device_get(tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert type(a) is type(b)
        np.testing.assert_array_equal(a, b)
    assert got[1] is tree[1]
    assert got[2] == 7
    alive = [weakref.ref(x) for x in arrays.values()]
    del arrays, tree, want
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    np.testing.assert_array_equal(got[0]["codes"][2], [8, 9, 10, 11])  # the copies outlive them


@pytest.mark.slow
def test_two_processes_run_the_sharded_step_on_their_own_shards(tmp_path):
    outputs = run_processes(
        ["-m", "tests.test_distributed"],
        tmp_path,
        processes=PROCESSES,
        devices=LOCAL_DEVICES,
        timeout=CHILD_TIMEOUT_S,
    )
    results = [last_json(stdout) for stdout in outputs]
    for p, result in enumerate(results):
        assert result["process"] == p
        assert result["process_count"] == PROCESSES
        assert result["devices"] == [LOCAL_DEVICES, LOCAL_DEVICES * PROCESSES]  # local, global
        assert result["local_shards"] == [2 * p, 2 * p + 1]
        # The same reductions as single-device `attend` on each shard: f32 on CPU agrees to the bit.
        assert result["outputs_equal"], f"process {p}: max |diff| = {result['max_abs_diff']}"
        assert result["outputs_finite"]  # NaN-poisoned slots stayed unread
        assert result["caches_equal"]
        assert result["max_written"] > result["ring_entries"]  # past the ring's wrap
        assert result["collectives"] == 0  # the step itself communicates nothing
        assert result["all_shards"] == [[0, 1], [2, 3]]  # gathered over gloo from both processes
    assert results[0]["steps"] == results[1]["steps"] > 0


# --- the child ---------------------------------------------------------------------------------------


def host_local(array: jax.Array) -> np.ndarray:
    """`array`'s addressable shards in an array of its global shape; NaN where another process holds it."""
    out = np.full(array.shape, np.nan, dtype=array.dtype)
    for shard in array.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def child() -> dict:
    """One process of the two-process test (the module docstring): returns its JSON report."""
    start = time.perf_counter()
    settings = DistributedSettings.from_env(initialization_timeout_s=CHILD_TIMEOUT_S // 2)
    initialize(settings)
    initialize(settings)  # idempotent

    # Imported after joining: nothing may start a JAX backend before `initialize`.
    from jax.experimental import multihost_utils

    from mstar_jax.resources.kv.bounded import sharding as sh
    from mstar_jax.resources.kv.bounded.cache import BoundedKVCache
    from tests.resources.kv.bounded import sharding_child as oracle_child

    data, model = MESH
    kv_heads, query_heads = 8, 16  # the "4x2" case of sharding_child.py
    mesh = sh.make_mesh(data, model)
    local = local_data_shards(mesh)
    # The oracle steps shards 0, 1, ... in turn, so it runs up to this process's last shard; only the
    # local shards' data reaches the sharded step.
    oracle = oracle_child.run_oracle(kv_heads, query_heads, shards=max(local) + 1)
    config = dataclasses.replace(oracle_child.shard_config(kv_heads), max_slots=data * oracle_child.SLOTS)
    shardings = sh.BoundedKVShardings.create(mesh, config)
    L, R = config.num_layers, config.rows_per_request
    rows = oracle_child.ROWS * R  # q rows per data shard

    def global_array(per_shard: list[np.ndarray], sharding, *, heads_axis: int | None = None) -> jax.Array:
        """The global array whose local data shards are `per_shard` (local shards, in order)."""
        local_data = np.concatenate(per_shard)
        if heads_axis is not None:
            local_data = sh.repeat_kv_heads(local_data, model, axis=heads_axis)
        shape = (local_data.shape[0] * data // len(local), *local_data.shape[1:])
        return jax.make_array_from_process_local_data(sharding, local_data, shape)

    def cache_layers(which: str) -> list[list[np.ndarray]]:
        return [
            [getattr(oracle[which][d], name)[layer] for d in local] for name in "kv" for layer in range(L)
        ]

    layers = [global_array(x, shardings.cache, heads_axis=2) for x in cache_layers("initial")]
    cache = BoundedKVCache(k=tuple(layers[:L]), v=tuple(layers[L:]))
    bank = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            shardings.bank, sh.repeat_kv_heads(x, model, axis=2), x.shape
        ),
        oracle["bank"],
    )  # replicated over data shards: every process holds all of it

    sharded_step = oracle_child.sharded_steps(mesh, config)

    def step_args(step: int):
        table = global_array([oracle["tables"][d][step] for d in local], shardings.table)
        qkv = [
            tuple(
                global_array([oracle["inputs"][d][step][i][layer] for d in local], sharding)
                for layer in range(L)
            )
            for i, sharding in enumerate((shardings.rows, shardings.step_kv, shardings.step_kv))
        ]
        return (table, *qkv)

    compiled = sharded_step.lower(cache, bank, *step_args(0)).compile()
    collectives = sum(compiled.as_text().count(op) for op in oracle_child.COLLECTIVES)
    outputs_equal, finite, max_diff = True, True, 0.0
    for step in range(oracle_child.STEPS):
        cache, outs = compiled(cache, bank, *step_args(step))
        outs = np.stack([host_local(out) for out in outs])
        for d in local:
            got, expected = outs[:, d * rows : (d + 1) * rows], oracle["outputs"][d][step]
            finite &= bool(np.isfinite(got).all())
            outputs_equal &= bool(np.array_equal(got, expected))
            max_diff = max(max_diff, float(np.nanmax(np.abs(got - expected))))
    slots = config.max_slots // data + 1  # S + 1 global slots per data shard
    caches_equal = all(
        np.array_equal(host_local(got)[d * slots : (d + 1) * slots], want[i], equal_nan=True)
        for got, want in zip((*cache.k, *cache.v), cache_layers("final"), strict=True)
        for i, d in enumerate(local)
    )
    gathered = multihost_utils.process_allgather(np.asarray(local, dtype=np.int32))
    return {
        "process": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [jax.local_device_count(), jax.device_count()],
        "local_shards": list(local),
        "steps": oracle_child.STEPS,
        "outputs_equal": outputs_equal,
        "outputs_finite": finite,
        "max_abs_diff": max_diff,
        "caches_equal": caches_equal,
        "collectives": collectives,
        "max_written": oracle["max_written"],
        "ring_entries": oracle_child.shard_config(kv_heads).slot_tokens,
        "all_shards": np.asarray(gathered).tolist(),
        "seconds": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    report_as_process(child)


def test_a_child_s_findings_are_its_last_json_line_not_its_last_line():
    # Gloo writes to stdout too, at times after the child's findings (seen in CI).
    gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    stdout = f'{{"process": 0}}\n{gloo}\n'
    assert last_json(stdout) == {"process": 0}
    with pytest.raises(AssertionError, match="no JSON object"):
        last_json("[Gloo] Rank 1 is connected to 1 peer ranks.\n[1, 2]\n")
