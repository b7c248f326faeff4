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


# The heaviest files, with their seconds in a clean-clone CI run on 2 cores (setup and calls summed;
# most run children that compile whole engines). pytest-xdist hands a worker a file at a time, in the
# order collected: these go first, the heaviest first, so the last files to finish are light ones and
# no worker sits idle behind a long tail (its own reordering, by test count, sent these last).
HEAVIEST_FIRST = {
    "tests/engine/test_mesh_engine.py": 435,
    "tests/engine/test_multiprocess_engine.py": 415,
    "tests/models/gemma3/test_serving.py": 285,
    "tests/test_device_session.py": 195,
    "tests/test_gemma_vs_llama_cpp_benchmark.py": 190,
    "tests/models/gemma3/test_real_model.py": 165,
    "tests/test_mesh_benchmark.py": 155,
    "tests/compile/test_offline_tpu.py": 140,
    "tests/models/gemma3/test_mesh.py": 120,
    "tests/kernels/test_store.py": 110,
    "tests/models/gemma3/test_deployment.py": 110,
    "tests/test_notebooks.py": 105,
    "tests/kernels/test_tpu_offline.py": 100,
    "tests/server/test_pod.py": 95,
    "tests/test_accelerators_benchmark.py": 95,
    "tests/models/test_sharded_model.py": 95,
    "tests/server/test_reliability.py": 85,
    "tests/engine/test_soak.py": 80,
    "tests/test_engine_benchmark.py": 65,
    "tests/models/gemma3/test_generate.py": 60,
    "tests/models/gemma3/test_greedy_screen.py": 80,
    "tests/test_greedy_screen_benchmark.py": 45,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the `HEAVIEST_FIRST` files first, heaviest first; every other file after, as collected. Skips,
    naming the extra, every test marked with an extra that is not installed (`tests/extras.py`)."""
    cost = {path: -seconds for path, seconds in HEAVIEST_FIRST.items()}
    items.sort(key=lambda item: cost.get(item.nodeid.split("::", 1)[0], 0))
    extras.skip_marked_without_extras(items)
