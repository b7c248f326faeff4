"""The streaming TTS model on (data, model) meshes of 8 simulated CPU devices (docs/design.md §10):
the same codes as one device for every request, the same mel within float rounding, and exactly the
Megatron all-reduces (one per attention block and one per MLP block) and no other collective.

The meshes need the device-count flag set before jax starts, so they run in a child process
(`mesh_child.py`), which prints its findings as JSON.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.mesh_child import CONFIG, MESHES
from tests.simulated_devices import run_child

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("mesh_child.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_child(CHILD, devices=8)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_request_gets_the_single_device_codes_and_mel(results, mesh):
    _, model = MESHES[mesh]
    assert results[mesh]["codes_equal"], results[mesh]
    assert results[mesh]["codes"] == 60  # 6 requests x (1 after the prompt + 9 decodes)
    if model == 1:  # data shards change no reduction: every bit agrees
        assert results[mesh]["max_mel_diff"] == 0.0
    else:  # the row-parallel projections sum partial products in another order
        assert results[mesh]["max_mel_diff"] < 1e-5


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_only_collectives_are_one_all_reduce_per_block(results, mesh):
    _, model = MESHES[mesh]
    blocks = {"talker": 2 * CONFIG.talker_layers, "flow": 2 * CONFIG.flow_layers * CONFIG.flow_steps}
    for step, found in results[mesh]["collectives"].items():
        expected = blocks[step] if model > 1 else 0
        assert found == {**dict.fromkeys(found, 0), "all-reduce": expected}, (step, found)
