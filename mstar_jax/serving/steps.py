"""K decode steps in one program: a one-token decode step run `steps` times on the device.

A block's plan holds one table per step (`BoundedKVStep.steps`, `BoundedKVPlan.steps`), each the plan of a
one-token step at that row's position then, so every step attends, writes and samples exactly as the same step
dispatched alone would (sampling is keyed by seed and stream position, which the table holds). Step `j`'s
sampled token is step `j + 1`'s input, on the device. A row the host gave fewer steps (its stream ends inside
the block) is a padding row in the steps it does not take; a row that samples one of its stop tokens takes no
further step's write (`stops`), so nothing it writes past its end ever lands in its slot, and its later
outputs repeat that token. A row whose input is a stop token (a pipelined block dispatched before its stop
token was read, planned past the block that sampled it) writes nothing at all: a live stream's next turn reads
that token first (`serving/decoder.py`).

The program returns every step's token, `i32[B, steps]`; a row's are valid up to the steps it took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.sink_window_attention import table as tbl

__all__ = ["decode_block", "without_writes"]

_WRITE_LENGTHS = tuple(tbl.write_cols(i)[2] for i in range(tbl.NUM_WRITES))


def without_writes(table: jax.Array, keep: jax.Array) -> jax.Array:
    """`table` (i32[B, ROW_INTS]) with the write ranges of the rows not in `keep` (bool[B]) emptied."""
    lengths = table[:, _WRITE_LENGTHS]
    return table.at[:, _WRITE_LENGTHS].set(jnp.where(keep[:, None], lengths, 0))


def decode_block(
    step: Callable,
    *,
    steps: int,
    offset: Callable[..., Any] | None = None,
    stops: bool = False,
) -> Callable:
    """`step` (one decode token a row) run `steps` times in one program (module doc).

    Args:
      step: `step(params, caches, banks, plans, tokens i32[B, 1], lengths i32[B], *inputs, **static) ->
        (caches, out i32[B])`, `plans` one `BoundedKVPlan` or a tuple of them (one per cache).
      steps: K, the block's steps.
      offset: `offset(**static)`, added to a sampled output to make it the next input token (the TTS
        talker's codes follow its text vocabulary); None adds nothing.
      stops: the block takes a last input `stop_tokens i32[B, S]` (-1: none) and masks a row's writes
        from the step after it samples one of them, and all of them if its input token is one.

    Returns:
      `block(params, caches, banks, plans, tokens, lengths, *inputs[, stop_tokens], **static) ->
      (caches, i32[B, steps])`, its plans' tables i32[steps, B, ROW_INTS].
    """

    def block(params, caches, banks, plans, tokens, lengths, *inputs, **static):
        several = isinstance(plans, tuple)
        block_plans = plans if several else (plans,)
        stop_tokens = inputs[-1] if stops else None
        inputs = inputs[:-1] if stops else inputs
        shift = 0 if offset is None else offset(**static)

        def one(carry, tables):
            caches, tokens, alive = carry
            if stops:
                tables = tuple(without_writes(t, alive) for t in tables)
            these = tuple(p.step(t) for p, t in zip(block_plans, tables, strict=True))
            plan = these if several else these[0]
            caches, out = step(params, caches, banks, plan, tokens, lengths, *inputs, **static)
            if stops:  # a row past its stop token repeats it, so a block fed its last output sees it
                out = jnp.where(alive, out, tokens[:, 0] - shift)
                alive = alive & ~jnp.any(out[:, None] == stop_tokens, axis=1)
            return (caches, (out + shift)[:, None].astype(tokens.dtype), alive), out

        alive = jnp.ones(tokens.shape[0], bool)
        if stops:  # a row that came in on a stop token ran past its end
            alive = ~jnp.any((tokens[:, :1] - shift) == stop_tokens, axis=1)
        tables = tuple(p.table for p in block_plans)
        (caches, _, _), outs = jax.lax.scan(one, (caches, tokens, alive), tables, length=steps)
        return caches, outs.T

    inner = getattr(step, "func", step)  # a functools.partial names its function
    block.__qualname__ = f"decode_block({inner.__qualname__}, steps={steps})"  # the store keys walks by it
    return block
