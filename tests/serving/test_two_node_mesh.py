"""The two-node model on a `(data=2, model=2)` mesh of simulated CPU devices, in a child process: pipelined
at K = 1 and in decode blocks of K = 8, every request's bytes those of one device and its floats theirs to
float32 rounding (the mesh splits the query heads: their sums meet across devices in another order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.serving.two_node_mesh_child import CASES, PROMPTS
from tests.simulated_devices import run_child

pytestmark = pytest.mark.slow


def test_a_mesh_gives_every_request_the_chunks_of_one_device():
    found = run_child(Path(__file__).with_name("two_node_mesh_child.py"), devices=4, timeout=600)
    reference = found["one device"]
    assert len(reference["outputs"]) == len(PROMPTS)
    for name in CASES:
        case = found[name]
        assert case["errors"] == [], name
        assert case["compilations"] == 0, name
        assert case["free"] == [4, 4], name  # every slot of both caches came back
        for rid, chunks in reference["outputs"].items():
            got = case["outputs"][rid]
            assert [c[:2] for c in got] == [c[:2] for c in chunks], (name, rid)  # starts and bytes
            for (_, _, values), (_, _, want) in zip(got, chunks, strict=True):
                np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-6, err_msg=f"{name} {rid}")
