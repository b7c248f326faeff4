"""One workload served by two processes over one mesh (docs/design.md §10, `engine/lockstep.py`).

Two processes of 4 simulated CPU devices each form one `(data=4, model=2)` mesh on localhost (JAX's
multi-controller runtime, gloo collectives). Each runs the engine on its own half of the requests,
admitted into its own two data shards, and every request must get the codes it gets served alone on one
device in this process, and the same audio within float rounding (two model shards sum the row-parallel
projections in another order). `mstar-jax run` does the same from the command line, as the "Serving on
a TPU pod" section of docs/guides/devices.md shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.engine.mesh_child import MODEL, REQUESTS, serve
from tests.simulated_devices import ROOT, last_json, run_processes

pytestmark = pytest.mark.slow

PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> list[dict]:
    outputs = run_processes(
        ["-m", "tests.engine.multiprocess_child"],
        tmp_path_factory.mktemp("processes"),
        processes=PROCESSES,
        devices=LOCAL_DEVICES,
        timeout=TIMEOUT_S,
    )
    return [last_json(stdout) for stdout in outputs]


def test_each_process_serves_its_own_requests_on_its_own_shards(served):
    for p, result in enumerate(served):
        assert result["process"] == p
        assert result["lockstep"]
        assert result["local_shards"] == [2 * p, 2 * p + 1]
        assert sorted(result["served"]) == [f"r{i}" for i in range(p, REQUESTS, PROCESSES)]
        assert result["done"] == REQUESTS // PROCESSES
        assert result["errors"] == []
        assert result["compilations"] == 0
        mesh = result["mesh"]
        assert (mesh["processes"], mesh["process"], mesh["local_data_shards"]) == (2, p, [2 * p, 2 * p + 1])
        for cache in mesh["caches"].values():
            assert cache["bytes_per_device"] == [cache["total_bytes"] // (PROCESSES * LOCAL_DEVICES)]
            placed = cache["requests_per_data_shard"]
            assert sum(placed[2 * p : 2 * p + 2]) == REQUESTS // PROCESSES  # all on its own shards
            assert sum(placed) == REQUESTS // PROCESSES
    # The streams differ in length, so a process that finishes first keeps entering the others' steps.
    assert sum(result["empty_steps"] for result in served) > 0


@pytest.fixture(scope="module")
def alone() -> dict:
    """Every request's codes and audio from the one-device engine, one frame a dispatch."""
    return serve(1, 1, MODEL)[1]


def assert_heard_alone(run: dict, result: dict, alone: dict) -> None:
    """`run` served the same requests as `result`, each with its one-device codes and audio."""
    assert sorted(run["served"]) == sorted(result["served"])
    for rid, (codes, audio) in run["served"].items():
        assert codes == alone[rid][0], rid
        np.testing.assert_allclose(np.asarray(audio, np.float32), alone[rid][1], rtol=0, atol=1e-5)


def test_every_request_hears_what_it_hears_alone_on_one_device(served, alone):
    """One frame a dispatch: where any process brings decode rows and any prefill rows, both processes
    run them together on the combined walk (each shard's decode rows, then its prefill rows), and every
    request still hears what it hears alone."""
    entered = [sum(result["walks"].values()) + result["empty_steps"] for result in served]
    assert entered[0] == entered[1]  # as many programs in each process (those with rows, and without)
    for result in served:
        assert_heard_alone(result, result, alone)


def test_a_process_whose_new_rows_are_all_prefill_joins_the_others_decoding(served):
    """Process 1 submits its three requests only once process 0 decodes: its first rows are all prefill
    rows, two on one shard, beyond the combined step's room (1): it runs as many as the room holds and
    the rest wait (every process once failed with "exceed the room of the largest bucket")."""
    assert served[1]["empty_steps"] > 0  # it entered process 0's first steps with no rows
    assert served[1]["walks"].get("talker_mixed", 0) > 0  # its prefill rows beside process 0's decode


def test_decode_blocks_in_lockstep_hear_what_one_device_hears_at_one_step(served, alone):
    """Two processes decoding 4 frames a dispatch: each request's codes are the one-device K = 1 engine's,
    and the processes agree on a bucket once a block (fewer decode dispatches than one a frame)."""
    for result in served:
        blocks = result["blocks"]
        assert_heard_alone(blocks, result, alone)
        assert blocks["compilations"] == 0
        assert blocks["decode_tokens"] == [4]
        assert blocks["decode_dispatches"] < blocks["decode_dispatches_one_step"]


def test_two_processes_pipelined_hear_what_one_device_hears(served, alone):
    """Two processes pipelining decode blocks of 4: each dispatches a step before it reads the last, its
    rows' codes fed on the device, and every request still gets the one-device K = 1 engine's codes."""
    for result in served:
        piped = result["pipelined"]
        assert_heard_alone(piped, result, alone)
        assert piped["compilations"] == 0
        assert piped["errors"] == []
        assert piped["overlap"]["rows_fed_on_device"] > 0
        assert piped["overlap"]["talker_steps_read_behind"] > 0
        assert piped["in_flight_after"] is False  # nothing left in flight


def test_a_fault_in_one_process_is_recovered_from_its_snapshot_and_replayed_exactly(served, alone):
    """Both processes snapshot every 3 steps, at the same steps; process 0's 5th talker step fails after
    consuming its caches. It restores its own shards and requests from its last snapshot and replays them:
    every request of both processes still gets the one-device engine's codes and audio, none fails."""
    runs = [result["faulty"] for result in served]
    for p, faulty in enumerate(runs):
        assert_heard_alone(faulty, served[p], alone)
        assert faulty["errors"] == []
        assert faulty["compilations"] == 0
    first, second = (faulty["counters"] for faulty in runs)
    assert (first["faults"], second["faults"]) == (1, 0)
    assert first["requests_restored"] == first["requests_lost"] > 0
    assert second["requests_lost"] == 0
    # The processes counted the same steps and copied their caches at the same ones.
    assert runs[0]["steps_run"] == runs[1]["steps_run"]
    assert first["snapshots"] == second["snapshots"] > 0


def test_each_process_offloads_and_reloads_its_own_streams_exactly(served, alone):
    """After 4 steps each process moves one of its streams to host memory through its own shards of
    the caches; it is reloaded when next admitted, and every request still gets its one-device codes."""
    for result in served:
        moved = result["offloaded"]
        assert_heard_alone(moved, result, alone)
        assert moved["errors"] == []
        assert moved["compilations"] == 0
        assert moved["offloads"] == 1
        assert moved["reloads"] >= 1


def test_mstar_jax_run_serves_one_workload_from_two_processes(tmp_path):
    """The commands of "Serving on a TPU pod" in docs/guides/devices.md, on one CPU host:
    `configs/mesh_cpu8.yaml` over two processes of 4 devices, pipelined, each writing its share's report."""
    config = ROOT / "configs" / "mesh_cpu8.yaml"
    output = tmp_path / "run"
    stdouts = run_processes(
        ["-m", "mstar_jax.cli", "run", "--config", str(config), "--output", str(output), "--no-progress"],
        tmp_path,
        processes=PROCESSES,
        devices=LOCAL_DEVICES,
        timeout=TIMEOUT_S,
    )
    streams = 0
    for p, stdout in enumerate(stdouts):
        report = json.loads((output / f"process-{p}" / "report.json").read_text())
        assert report["mesh"]["processes"] == PROCESSES
        assert report["mesh"]["local_data_shards"] == [2 * p, 2 * p + 1]
        assert report["streams"]["done"] == report["streams"]["submitted"] == 8  # half of 16
        assert report["compile"]["compilations_after_warmup"] == 0
        assert report["pipeline"]["pipelined"]
        assert report["pipeline"]["rows_fed_on_device"] > 0
        assert "mesh                 data 4 x model 2 (8 devices)" in stdout
        assert f"process {p} of 2 serves data shards [{2 * p}, {2 * p + 1}]" in stdout
        for cache in report["mesh"]["caches"].values():
            assert cache["bytes_per_device"] == [cache["total_bytes"] // (PROCESSES * LOCAL_DEVICES)]
        streams += report["streams"]["done"]
    assert streams == 16
    assert not Path(output / "report.json").exists()  # each process writes only its own
