"""The XLA half of the GPU kernel's split key walk (`gpu.py`): each split's softmax state merged.

A decode-shaped step's programs each walk a share of a row's keys and write their float32 state
(acc, m, l); this weighs them back together, splits in a fixed order, elementwise per row.
"""

import functools
import operator

import jax
import jax.numpy as jnp

__all__ = ["merge_splits"]


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, *, own: jax.Array, group: int, steps: int):
    """The tiles of a split walk: each row's split softmax states merged, splits in order.

    Args:
      acc: f32[N, G, S, Q, DP]; m, l: f32[N, G, S, Q], each split's state as `_online_softmax_step`
        leaves it (m = -inf where a split saw no visible key), for the Q = T * H/G query rows.
      own: i32[N] each row's step tokens (STEP_TOKENS, clipped to [0, T]).

    Returns:
      f32[N, G, Q, DP], as the unsplit kernel's tiles: zeros for query rows past `own` and rows that saw
      no key. The sums run over splits in a fixed order, elementwise, so a row rounds alike in any batch.
    """
    top = jnp.max(m, axis=2)  # exact in any order
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    weights = [jnp.exp(m[:, :, s] - shift) for s in range(m.shape[2])]
    total = functools.reduce(operator.add, [w * l[:, :, s] for s, w in enumerate(weights)])
    summed = functools.reduce(operator.add, [w[..., None] * acc[:, :, s] for s, w in enumerate(weights)])
    t = jnp.arange(m.shape[3], dtype=jnp.int32) // group
    live = (t[None, None, :] < jnp.minimum(own, steps)[:, None, None]) & (total > 0)
    out = summed / jnp.where(live, total, 1.0)[..., None]
    return jnp.where(live[..., None], out, 0.0)
