"""A decoder step that reads its input tokens from the previous step's outputs on the device.

A pipelined engine dispatches a feeding node's step t + 1 before it reads step t back: a decode row of
t + 1 whose token is step t's output names where that output sits (`feed[b] >= 0`, its row in step t's
outputs, flattened) and the program reads it there, instead of the placeholder the host wrote. Every
program of the node returns its per-row tokens padded to the same `[C, K]` (K the tokens a decode block
returns per row, `serving/steps.py`), so any program's outputs feed any other's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["fed"]


def fed(
    step: Callable,
    *,
    width: int,
    offset: Callable[..., Any] | None = None,
    steps: int = 1,
    sharding: Any = None,
) -> Callable:
    """`step` reading fed decode tokens from `prev_tokens`, its per-row outputs padded to `[width, steps]`.

    Args:
      step: `step(params, caches, banks, plans, tokens i32[B, T], *inputs, **static) -> (caches, out
        i32[B] or i32[B, steps])`: one token a row, or a block's `steps` (`decode_block`).
      width: `C`, the rows every program of the node pads its outputs to.
      offset: `offset(**static)`, added to a fed output to make it an input token (e.g. the TTS talker's
        codes follow its text vocabulary); None adds nothing.
      steps: K, the tokens a row of the node's decode block returns; a one-token step's output fills
        column 0 (the rest is zeros).
      sharding: where the padded outputs live (None: where XLA puts them). On a mesh every program's
        `prev_tokens` is compiled for one sharding, so the outputs that feed them must be given it.

    Returns:
      `fed_step(params, caches, banks, plans, prev_tokens i32[C, K], feed i32[B], tokens, *inputs,
      **static) -> (caches, i32[C, K])`; `feed[b]` indexes `prev_tokens` flattened (`row * K + column`).
    """

    def fed_step(params, cache, bank, plan, prev_tokens, feed, tokens, *inputs, **static):
        from_device = jnp.take(prev_tokens.reshape(-1), jnp.maximum(feed, 0), axis=0)
        if offset is not None:
            from_device = from_device + offset(**static)
        tokens = jnp.where((feed >= 0)[:, None], from_device[:, None], tokens)
        cache, out = step(params, cache, bank, plan, tokens, *inputs, **static)
        out = out[:, None] if out.ndim == 1 else out
        out = jnp.pad(out, ((0, width - out.shape[0]), (0, steps - out.shape[1])))
        return cache, out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)

    inner = getattr(step, "func", step)  # a functools.partial names its function
    fed_step.__qualname__ = f"fed({inner.__qualname__})"  # the executable store tells walks apart by it
    return fed_step
