"""Gemma 3 served by the engine on a mesh of simulated CPU devices (`test_mesh.py`).

Run as a script (one process, `run_child`: a pipelined deployment with a `(data=2, model=2)` mesh of 4
devices, its model read from a GGUF file, its greedy tokens through the screen where `SCREEN_VARIABLE`
is 1), or as a module with the `MSTAR_*` variables set (`run_processes`: each of 2 processes of 2
devices, one mesh over the 4, each serving every other prompt on its own data shard, pipelined). Prints
one JSON line: every request's tokens, the process's data shards, compilations after warm-up and the
steps it entered with no rows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script (`run_child`): the repository's root makes `tests` a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.simulated_devices import report_as_process

DATA, MODEL = 2, 2
SLOTS = 4  # over both data shards
NEW_TOKENS = 12
SAMPLED = {"temperature": 0.9, "seed": 21}  # the last prompt is sampled, the others greedy


SCREEN_VARIABLE = "MSTAR_TEST_GREEDY_SCREEN"
"""Set to 1: the one-process deployment takes its greedy tokens through the screen."""


def prompts() -> list[tuple[int, ...]]:
    rng = np.random.default_rng(5)
    return [tuple(int(t) for t in rng.integers(0, 64, n)) for n in (5, 19, 1, 12, 9, 3)]


def fields(index: int) -> dict:
    return SAMPLED if index == len(prompts()) - 1 else {}


def deployment_engine():
    """The engine of a deployment on the mesh (`build_text_engine`), its model from a GGUF file."""
    import tempfile

    from mstar_jax.deployment import parse_deployment
    from mstar_jax.models.gemma3.run import build_text_engine
    from tests.models.gemma3.test_deployment import mapping, write_gguf

    path = Path(tempfile.mkdtemp()) / "tiny.gguf"
    write_gguf(path)
    settings = mapping(path, max_slots=SLOTS, greedy_screen=os.environ.get(SCREEN_VARIABLE) == "1")
    # Pipelined: one process on a mesh feeds each decode step's tokens to the next on the device.
    settings.update(engine={"max_batch": SLOTS, "pipelined": True}, mesh={"data": DATA, "model": MODEL})
    return build_text_engine(parse_deployment(settings, "mesh.yaml"), progress=False)


def direct_engine(*, pipelined: bool):
    """The engine of a `Gemma3Streams` built on the mesh (`text_engine`)."""
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.run import text_engine
    from mstar_jax.models.gemma3.stream import Gemma3Streams
    from mstar_jax.resources.kv.bounded.sharding import make_mesh
    from mstar_jax.settings import EngineSettings
    from tests.models.gemma3.test_model import CONFIG, random_tensors
    from tests.models.gemma3.test_serving import RETENTION

    model = Gemma3.from_tensors(CONFIG, random_tensors(CONFIG))
    streams = Gemma3Streams(
        CONFIG, model, global_retention=RETENTION, max_slots=SLOTS, chunk=8, batch_sizes=(1, 2),
        mesh=make_mesh(DATA, MODEL),
    )  # fmt: skip
    return text_engine(streams, EngineSettings(max_batch=SLOTS, pipelined=pipelined), progress=False)


def serve(engine, share: tuple[int, int] = (0, 1)) -> dict:
    """Serve prompt `i` for every `i % share[1] == share[0]`; return what the test checks."""
    import jax

    from mstar_jax.models.gemma3.serving import TextRequest

    streams = engine.served.streams
    mine = [i for i in range(len(prompts())) if i % share[1] == share[0]]
    submitted = [engine.submit(TextRequest(f"p{i}", prompts()[i], NEW_TOKENS, **fields(i))) for i in mine]
    while engine.busy_anywhere(bool(engine.streams)):
        engine.step()
    return {
        "process": jax.process_index(),
        "lockstep": engine.lockstep,
        "local_shards": list(streams.local.local_data_shards),
        "tokens": {s.request_id: s.tokens for s in submitted},
        "errors": sorted({s.error for s in submitted if s.error}),
        "compilations": engine.compilations,
        "empty_steps": engine.stats.lockstep_empty_steps,
        "placed": [list(m.placed) for m in streams.managers],
        "free_slots": [m.free_slots for m in streams.managers],
        "pipelined": engine.pipelined,
        "rows_fed_on_device": engine.stats.rows_fed_on_device,
    }


def main_process() -> dict:
    from mstar_jax.distributed import DistributedSettings, initialize

    initialize(DistributedSettings.from_env(initialization_timeout_s=60))
    import jax  # after joining: nothing may start a JAX backend before `initialize`

    # Each process dispatches a decode step before it reads the last, its tokens fed on the device.
    return serve(direct_engine(pipelined=True), (jax.process_index(), jax.process_count()))


if __name__ == "__main__":
    if "MSTAR_PROCESS_ID" in os.environ:
        report_as_process(main_process)
    else:
        report_as_process(lambda: serve(deployment_engine()))
