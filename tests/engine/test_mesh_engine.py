"""The engine on meshes of 8 simulated CPU devices (docs/design.md §10): one workload gives every request
the codes it gets on one device, the same audio (to the bit with one model shard; within float rounding
with several, whose row-parallel projections sum in another order), decode and prefill rows meet on the
combined walk (each shard's decode rows, then its prefill rows), nothing compiles after warm-up, and
each device holds an even share of every cache.

The meshes need the device-count flag set before jax starts, so they run in a child process
(`mesh_child.py`), which prints its findings as JSON. `mstar-jax run` on `configs/mesh_cpu8.yaml` runs in
test_multiprocess_engine.py, over the same 8 devices in two processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.mesh_child import MESHES, PIPELINED, REQUESTS
from tests.simulated_devices import run_child

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("mesh_child.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_child(CHILD, devices=8)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_request_hears_what_it_hears_on_one_device(results, mesh):
    found = results[mesh]
    assert found["done"] == REQUESTS
    assert found["codes_equal"]
    assert found["compilations"] == 0
    assert "talker_mixed" in found["walks"]  # decode and prefill rows met on the combined walk
    # Splitting the combined step per shard adds no collective: its programs hold the decode ones'.
    assert found["collectives"]["talker_mixed"] == found["collectives"]["talker_decode"]
    if MESHES[mesh][1] == 1:
        assert found["max_audio_diff"] == 0.0
    else:
        assert found["max_audio_diff"] < 1e-5


def assert_hears_one_device(found: dict, *, decode_steps: int) -> None:
    """Every request done with the one-device K = 1 engine's codes and audio (within the rounding of
    several model shards), nothing compiled, and every decode program a block of `decode_steps`."""
    assert found["done"] == REQUESTS
    assert found["codes_equal"]
    assert found["max_audio_diff"] < 1e-5
    assert found["compilations"] == 0
    assert found["decode_tokens"] == [decode_steps]


@pytest.mark.parametrize("mesh", list(PIPELINED))
def test_a_pipelined_mesh_hears_what_one_synchronous_device_hears(results, mesh):
    """A pipelined engine on a mesh in one process: each talker step dispatched before the last is read,
    its codes fed on the device (replicated, where every program reads them), and every request's codes
    the one-device synchronous K = 1 engine's, its audio within the rounding of several model shards."""
    found = results[mesh]
    assert_hears_one_device(found, decode_steps=PIPELINED[mesh][2])
    # At K = 1 a decode row fed on the device may run beside a prefill row, on the combined walk.
    assert ("talker_mixed" in found["walks"]) == (PIPELINED[mesh][2] == 1)
    assert found["overlap"]["rows_fed_on_device"] > 0
    assert found["overlap"]["talker_steps_read_behind"] > 0


@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_device_holds_an_even_share_of_every_cache(results, mesh):
    data, model, _ = MESHES[mesh]
    report = results[mesh]["mesh"]
    assert (report["data"], report["model"], report["devices"]) == (data, model, data * model)
    for cache in report["caches"].values():
        assert cache["bytes_per_device"] == [cache["total_bytes"] // (data * model)]
        assert len(cache["requests_per_data_shard"]) == data
        assert sum(cache["requests_per_data_shard"]) == REQUESTS
