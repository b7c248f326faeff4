"""Random weights for the model's modules, drawn on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["draw_weights"]


def draw_weights(abstract: nnx.State, rng: np.random.Generator, dtype: np.dtype) -> nnx.State:
    """Random weights for an abstract state, drawn on the host in NumPy and stored as `dtype`.

    Kernels are normal with std `1 / sqrt(fan_in)`, embeddings standard normal, norm scales one and
    biases zero. NumPy rather than `jax.random`: the weights are the same on every backend, and the
    host draws them in milliseconds where compiling an initialiser of every threefry call takes
    seconds on a CPU.
    """

    def draw(path, leaf):
        name = next(
            str(getattr(k, "key", "")) for k in reversed(path) if isinstance(getattr(k, "key", None), str)
        )
        if name == "scale":
            value = np.ones(leaf.shape, np.float32)
        elif name == "bias":
            value = np.zeros(leaf.shape, np.float32)
        elif name == "embedding":
            value = rng.standard_normal(leaf.shape, np.float32)
        else:
            value = rng.standard_normal(leaf.shape, np.float32) / np.float32(np.sqrt(leaf.shape[0]))
        return jnp.asarray(value, dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)
