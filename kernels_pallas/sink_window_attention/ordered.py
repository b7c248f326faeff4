"""A sum whose rounding does not depend on the batch it is computed in.

XLA:CPU picks a reduction's loop order from the whole array's shape: `jnp.sum(x, axis=-1)` over rows of
64 rounds one way when there are 2 x 8 rows and another when there are 8 x 8 (measured with jaxlib
0.10), so a request's outputs change in the last bits with the batch it is served in. `ordered_sum`
adds halves pairwise (elementwise adds, which XLA does not reassociate), a fixed tree per row whatever
the other axes hold. It costs log2(n) elementwise adds, negligible beside the matmuls around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ordered_sum"]


def ordered_sum(x: jax.Array) -> jax.Array:
    """`x` summed over its last axis in a fixed pairwise order (padded with zeros to a power of two)."""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    if width != x.shape[-1]:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
