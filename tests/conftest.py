"""Strict numerics for every test: explicit dtype promotion, rank promotion raises, warnings are errors."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from tests import extras

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


# The heaviest files, with their seconds in a clean-clone CI run on 2 cores (setup and calls summed, each in
# the environment of .ci/run that runs it; most run children that compile whole engines). pytest-xdist
# hands a worker a file at a time, in the order collected: these go first, the heaviest first, so the last
# files to finish are light ones and no worker sits idle behind a long tail (its own reordering, by test
# count, sent these last).
HEAVIEST_FIRST = {
    "tests/engine/test_multiprocess_engine.py": 380,
    "tests/engine/test_mesh_engine.py": 300,
    "tests/kernels/test_tpu_offline.py": 420,
    "tests/models/gemma3/test_serving.py": 360,
    "tests/kernels/test_score_terms.py": 210,
    "tests/test_gemma_vs_llama_cpp_benchmark.py": 200,
    "tests/kernels/test_store.py": 180,
    "tests/test_greedy_screen_benchmark.py": 180,
    "tests/models/gemma3/test_real_model.py": 170,
    "tests/models/gemma3/test_greedy_screen.py": 150,
    "tests/models/gemma3/test_mesh.py": 140,
    "tests/test_device_session.py": 120,
    "tests/server/test_pod.py": 110,
    "tests/models/gemma3/test_deployment.py": 100,
    "tests/test_configs.py": 100,
    "tests/test_mesh_benchmark.py": 95,
    "tests/kernels/test_gpu.py": 95,
    "tests/models/gemma3/test_generate.py": 95,
    "tests/test_notebooks.py": 95,
    "tests/kernels/test_gpu_offline.py": 90,
    "tests/server/test_reliability.py": 90,
    "tests/compile/test_offline_tpu.py": 85,
    "tests/test_accelerators_benchmark.py": 75,
    "tests/test_engine_benchmark.py": 65,
    "tests/resources/kv/bounded/test_stream_oracle.py": 60,
    "tests/models/test_sharded_model.py": 60,
    "tests/kernels/test_tpu.py": 55,
    "tests/engine/test_soak.py": 45,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the `HEAVIEST_FIRST` files first, heaviest first; every other file after, as collected. Skips,
    naming the extra, every test marked with an extra that is not installed (`tests/extras.py`)."""
    cost = {path: -seconds for path, seconds in HEAVIEST_FIRST.items()}
    items.sort(key=lambda item: cost.get(item.nodeid.split("::", 1)[0], 0))
    extras.skip_marked_without_extras(items)
