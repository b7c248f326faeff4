"""Gemma 3 on a `(data=2, model=2)` mesh of simulated CPU devices, served by the one engine: in one
process (a deployment with a `mesh:` section, as `mstar-jax run` builds it), and as two processes of
one job in lockstep (`engine/lockstep.py`), pipelined, each admitting its own prompts into its own data
shard.
Every prompt's tokens must be those it gets served alone on one device (greedy, or the same request's
sampled tokens), nothing compiles after warm-up and every slot comes back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar_jax import native
from mstar_jax.engine import ServingEngine
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.serving import Gemma3Serving, TextRequest
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.settings import EngineSettings
from tests.models.gemma3.mesh_child import NEW_TOKENS, SCREEN_VARIABLE, SLOTS, fields, prompts
from tests.models.gemma3.test_model import CONFIG, random_tensors
from tests.models.gemma3.test_serving import RETENTION
from tests.simulated_devices import last_json, run_child, run_processes

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("mesh_child.py")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Each prompt served alone on one device."""
    model = Gemma3.from_tensors(CONFIG, random_tensors(CONFIG))
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, max_slots=1, chunk=8)
    engine = ServingEngine(Gemma3Serving(streams), settings=EngineSettings(max_batch=1))
    return {
        f"p{i}": list(engine.stream(TextRequest(f"p{i}", prompt, NEW_TOKENS, **fields(i))))
        for i, prompt in enumerate(prompts())
    }


@pytest.mark.gemma
@pytest.mark.parametrize("screen", [False, True], ids=["float32", "greedy screen"])
def test_one_process_on_a_mesh_gives_every_prompt_its_tokens_alone(alone, screen, monkeypatch):
    if screen and not native.available():
        pytest.skip("no C++ compiler to build mstar_jax.native")
    monkeypatch.setenv(SCREEN_VARIABLE, "1" if screen else "0")
    found = run_child(CHILD, devices=4, timeout=TIMEOUT_S)
    assert found["tokens"] == alone
    assert found["errors"] == []
    assert found["compilations"] == 0
    assert not found["lockstep"]
    assert found["pipelined"]
    assert found["rows_fed_on_device"] > 0  # decode tokens fed on the device, replicated over the mesh
    assert all(min(placed) > 0 for placed in found["placed"])  # both data shards took prompts
    assert found["free_slots"] == [SLOTS, SLOTS]


def test_two_processes_in_lockstep_pipelined_each_serve_their_own_prompts_on_their_own_shard(alone, tmp_path):
    outputs = run_processes(
        ["-m", "tests.models.gemma3.mesh_child"], tmp_path, processes=2, devices=2, timeout=TIMEOUT_S
    )
    results = [last_json(out) for out in outputs]
    for p, found in enumerate(results):
        assert found["process"] == p
        assert found["lockstep"]
        assert found["local_shards"] == [p]
        assert found["tokens"] == {rid: alone[rid] for rid in alone if int(rid[1:]) % 2 == p}
        assert found["errors"] == []
        assert found["compilations"] == 0
        assert found["pipelined"]
        assert found["rows_fed_on_device"] > 0
        assert [placed[1 - p] for placed in found["placed"]] == [0, 0]  # nothing on the other's shard
        assert found["free_slots"] == [SLOTS // 2, SLOTS // 2]  # a process counts its own shard's
    # Prompts differ in length, so a process that is done first keeps entering the other's steps.
    assert sum(found["empty_steps"] for found in results) > 0
