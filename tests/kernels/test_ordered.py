"""`ordered_sum` and the model's `RMSNorm`: right against float64, and the same bits in any batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas.sink_window_attention.ordered import ordered_sum
from mstar_jax.models.norm import RMSNorm


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 24, 64, 100])
def test_ordered_sum_matches_a_float64_sum(rng, width):
    x = rng.standard_normal((5, 3, width)).astype(np.float32)
    np.testing.assert_allclose(
        ordered_sum(jnp.asarray(x)), x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("width", [24, 64, 96])
def test_ordered_sum_rounds_a_row_the_same_whatever_the_batch(rng, width):
    x = jnp.asarray(rng.standard_normal((64, 8, width)).astype(np.float32) * 10)
    summed = jax.jit(ordered_sum)
    full = np.asarray(summed(x))
    for rows in (1, 2, 3, 4, 6, 8, 16, 32):
        np.testing.assert_array_equal(np.asarray(summed(x[:rows])), full[:rows])


def test_rms_norm_matches_flax_and_keeps_its_parameters(rng):
    ours, theirs = RMSNorm(48, rngs=nnx.Rngs(0)), nnx.RMSNorm(48, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(ours)) == jax.tree.map(jnp.shape, nnx.state(theirs))
    ours.scale[...] = theirs.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 48).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((3, 5, 48)).astype(np.float32))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    full = np.asarray(jax.jit(lambda m, x: m(x))(ours, x))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, x: m(x))(ours, x[:1])), full[:1])
