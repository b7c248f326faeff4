"""Strict numerics for every test: explicit dtype promotion, rank promotion raises, warnings are errors."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)
