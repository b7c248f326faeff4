"""Sampling a decoder's next token reproducibly: the noise depends only on a request's seed and the
stream position, never on the batch, bucket, slot or step that computes it.

Gumbel-max with the key `fold_in(key(seed), position)`: a request draws the same token at the same
position alone or in a crowd, synchronous or pipelined, after an offload, and when a fault's replay
regenerates it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["gumbel_noise", "sample"]


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """f32[B, vocab]: row b's Gumbel noise, keyed by `(seeds[b], positions[b])`."""

    def row(seed, position):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), position), (vocab,))

    return jax.vmap(row)(seeds, positions)


def sample(logits: jax.Array, temperatures: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """i32[B]: one token per row, `argmax(logits / t + noise)` at temperature t > 0, the argmax at 0.

    Args:
      logits: f32[B, V].
      temperatures: f32[B], each >= 0.
      seeds: u32[B] per-request seeds.
      positions: i32[B] the stream position of the token the logits were computed at.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(_):
        noise = gumbel_noise(seeds, positions, logits.shape[-1])
        scaled = logits / jnp.where(temperatures > 0, temperatures, 1.0)[:, None]
        return jnp.where(temperatures > 0, jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32), greedy)

    # A batch of greedy rows (the common case) draws no noise: a vocabulary of 262,144 costs.
    return jax.lax.cond(jnp.any(temperatures > 0), drawn, lambda _: greedy, None)
