"""RMS normalisation whose rounding does not depend on the batch a row is computed in.

`nnx.RMSNorm` takes its mean square with `jnp.mean`, which XLA:CPU reduces in a loop order chosen from
the whole array's shape, so a request's outputs changed in the last bits with its step's batch size.
`RMSNorm` here has the same parameters (`scale`) and formula, with the sum taken in a fixed pairwise
order (`ordered_sum`): a request's audio is bit-identical alone or in any crowd.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.sink_window_attention.ordered import ordered_sum

__all__ = ["RMSNorm"]


class RMSNorm(nnx.RMSNorm):
    """`nnx.RMSNorm` over the last axis, its statistics in float32 and summed in a fixed order."""

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        if mask is not None:
            raise NotImplementedError("RMSNorm here takes no mask")
        mean_square = ordered_sum(jnp.square(x.astype(jnp.float32)))[..., None] / x.shape[-1]
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(mean_square + self.epsilon)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (normed * scale).astype(x.dtype)
