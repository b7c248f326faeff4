"""`sampling.argmax` is `jnp.argmax` exactly: ties, NaN, infinities, ragged last blocks, any leading axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.serving.sampling import ARGMAX_BLOCK, argmax

B = ARGMAX_BLOCK


def _check(x: np.ndarray) -> None:
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("n", [3, 2 * B - 1, 2 * B, 2 * B + 1, 5 * B + 7, 262_144])
def test_random_rows(n):
    _check(np.random.default_rng(n).standard_normal((3, n)).astype(np.float32))


@pytest.mark.parametrize(
    "where",
    [
        [0, 1],  # both in the first block: the first index
        [B - 1, B],  # straddling a block boundary: the earlier block's
        [B + 5, 3 * B + 1, 4 * B],  # several blocks hold it: the first of them
        [5 * B + 6, 5 * B + 3],  # both in the ragged last block
    ],
)
def test_ties_go_to_the_first_index(where):
    x = np.zeros((1, 5 * B + 7), np.float32)
    x[0, where] = 2.0
    _check(x)


def test_nan_wins_as_jnp_argmax_has_it_and_infinities_and_padding():
    n = 4 * B + 3
    x = np.random.default_rng(0).standard_normal((5, n)).astype(np.float32)
    x[0, [3 * B + 1, 2 * B + 9]] = np.nan  # the first NaN, though a later block's is found first by max
    x[1, 2 * B] = np.inf
    x[2] = -np.inf  # every entry equal (and below any finite padding): index 0
    x[3, -1] = np.float32(np.finfo(np.float32).max)  # the very last entry, in the ragged block
    x[4] = np.finfo(np.float32).min
    _check(x)
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x)))[:3], [2 * B + 9, 2 * B, 0])


def test_leading_axes_and_integers():
    rng = np.random.default_rng(1)
    _check(rng.standard_normal((2, 3, 3 * B + 1)).astype(np.float32))
    _check(rng.integers(-5, 5, (2, 3 * B + 1)).astype(np.int32))
