"""Child process of `test_two_node_mesh.py`: the two-node model served on a `(data=2, model=2)` mesh of 4
simulated CPU devices, pipelined at K = 1 and in decode blocks of K = 8, and on one device. Prints one
JSON line: per case, each request's chunks (start, tokens, floats), and the compilations after warm-up.

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (the parent sets it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (`run_child`): the repository's root makes `tests` a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mstar_jax.engine import ServingEngine
from mstar_jax.resources.kv.bounded.sharding import make_mesh
from mstar_jax.settings import EngineSettings
from tests.serving.two_node_model import TwoNodeConfig, TwoNodeRequest, TwoNodeServing

PROMPTS = (b"hello", b"mstar-jax!", b"x", b"two nodes", b"on a mesh")
CASES = {"one device": (None, 1), "2x2 pipelined": ((2, 2), 1), "2x2 blocks of 8": ((2, 2), 8)}


def serve(mesh_shape: tuple[int, int] | None, decode_steps: int) -> dict:
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    served = TwoNodeServing(TwoNodeConfig(slots=4), batch_sizes=(1, 2), decode_steps=decode_steps, mesh=mesh)
    settings = EngineSettings(max_batch=4, pipelined=True, decode_steps=decode_steps)
    engine = ServingEngine(served, settings=settings)
    engine.warm_up()
    streams = [engine.submit(TwoNodeRequest(f"p{i}", p, 11)) for i, p in enumerate(PROMPTS)]
    engine.run_until_idle()
    return {
        "outputs": {
            s.request_id: [[o.start, o.tokens.tolist(), o.values.tolist()] for o in s.outputs]
            for s in streams
        },
        "errors": [s.error for s in streams if s.error],
        "compilations": engine.compilations,
        "free": [m.free_slots for m in served.managers],
    }


if __name__ == "__main__":
    print(json.dumps({name: serve(*case) for name, case in CASES.items()}))
