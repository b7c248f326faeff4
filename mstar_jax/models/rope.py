"""Rotary position embedding at absolute stream positions.

The talker rotates queries and keys by their absolute stream position before the keys are cached, so
a key keeps its rotation after the ring wraps and scores depend only on the distance between query and
key (as in Moshi's ring cache). Nothing is re-rotated when entries are evicted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_rope"]


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float = 10_000.0) -> jax.Array:
    """Rotate feature pairs `(x[..., i], x[..., i + D/2])` by `positions * theta**(-2i/D)`.

    Angles are computed in float32 (positions grow without bound in a stream; a bf16 angle would be
    off by whole radians past a few thousand tokens).

    Args:
      x: [N, T, heads, D] queries or keys, D even.
      positions: i32[N, T] absolute stream positions.
      theta: the RoPE base.

    Returns:
      [N, T, heads, D] in x's dtype.
    """
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"head_dim={dim} must be even for rotary embeddings")
    inv_freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [D/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq[None, None, None, :]  # [N, T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
