"""A decoder's captured programs: each step feeds the next on the device, padded to one width.

`capture_decoder` captures a decoder's step for every bucket of every walk (`fed`: each program takes
the previous step's tokens first and returns its own, `[C, K]`), a decode walk's buckets of K > 1 tokens
as blocks of K one-token steps (`decode_block`); `DecoderPrograms` holds them, and `decoder_node` is the
`Node` that serves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.compile import Buckets, CapturedStep, capture
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.sharding import DATA
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.feed import fed
from mstar_jax.serving.model import Node
from mstar_jax.serving.steps import decode_block

__all__ = ["MAX_STOP_TOKENS", "DecoderPrograms", "capture_decoder", "decoder_node", "fed_width"]

MAX_STOP_TOKENS = 16
"""The most stop tokens a request may name: a decode block checks each row's on the device."""


def fed_width(buckets: Buckets, shards: int = 1) -> int:
    """`C`, the width every program of a feeding node pads its outputs to: the most rows any bucket has
    (every data shard's, on a mesh of `shards`)."""
    return shards * max(buckets.max_batch(walk) for walk in buckets.walks)


@dataclasses.dataclass(frozen=True, eq=False)
class DecoderPrograms:
    """A decoder's captured programs (`capture_decoder`).

    Attributes:
      buckets: its buckets, of one walk or more.
      steps: walk -> `CapturedStep`; each takes `(params, caches, banks, plans, prev_tokens i32[C, K],
        feed i32[B], tokens i32[B, T], lengths i32[B], *extra)` (a decode block's also `stop_tokens
        i32[B, MAX_STOP_TOKENS]` last) and returns the caches and every row's tokens, padded to `[C, K]`
        (on a mesh: replicated).
      shards: data shards of the mesh they were captured for (1: one device).
      decode_walk: the walk whose programs are decode blocks when its tokens are K > 1 (None: no block).
    """

    buckets: Buckets
    steps: dict[str, CapturedStep]
    shards: int = 1
    decode_walk: str | None = None

    @property
    def decode_steps(self) -> int:
        """K, the one-token steps a decode program runs (1 without a decode block)."""
        return 1 if self.decode_walk is None else self.buckets.max_tokens(self.decode_walk)

    @property
    def width(self) -> int:
        """`C` (`fed_width`)."""
        return fed_width(self.buckets, self.shards)


def capture_decoder(
    step: Callable,
    buckets: Buckets,
    params: Any,
    caches: Any,
    banks: Any,
    *,
    name: str,
    extra: Callable[[int, int], tuple] | None = None,
    mesh: Any = None,
    fingerprint: Any = None,
    progress: bool = False,
    decode_walk: str | None = None,
    **options: Any,
) -> dict[str, CapturedStep]:
    """`fed(step)` captured for every bucket of every walk, from abstract arguments of the arrays given.

    Args:
      step: `step(params, caches, banks, plans, tokens i32[B, T], lengths i32[B], *extra, **static) ->
        (caches, i32[B])`.
      buckets: the buckets.
      params, caches, banks: the node's weights, caches and source banks (a cache and its bank, or
        tuples of them: the plans are then a tuple too, one a cache).
      name: the programs' name (each walk's adds the walk).
      extra: `extra(B, T)`, the abstract inputs the step takes after `lengths` (`shaped`, unplaced; on a
        mesh they are split on `data` like the rows); None: none.
      mesh: the `(data, model)` mesh the arrays live on (None: one device); a bucket's `B` then counts
        one data shard's rows, and its arrays hold every shard's.
      fingerprint: what `step` closes over (`capture`); the padding width is added to it.
      progress: show a progress bar per walk.
      decode_walk: the walk whose buckets of K > 1 tokens run K one-token steps (`decode_block`, with
        the rows' stop tokens); None: every program is one step.
      options: the rest of `capture`'s keywords (`static_kwargs`, `store`).

    Returns:
      walk -> `CapturedStep` (`DecoderPrograms.steps`).
    """
    shards = 1 if mesh is None else mesh.shape[DATA]
    width = fed_width(buckets, shards)
    k = 1 if decode_walk is None else buckets.max_tokens(decode_walk)
    several = isinstance(caches, tuple)
    split = None if mesh is None else NamedSharding(mesh, P(DATA))
    block_split = None if mesh is None else NamedSharding(mesh, P(None, DATA))  # [K, rows, ...]
    whole = None if mesh is None else NamedSharding(mesh, P())

    def arguments(bucket: BucketKey, block: bool) -> tuple:
        size, span = shards * bucket.bs, (1 if block else bucket.num_tokens)
        rows, ids = shaped((size,), jnp.int32, split), shaped((size, span), jnp.int32, split)
        if block:
            plan = BoundedKVPlan.abstract(size, 1, block_split, steps=bucket.num_tokens)
        else:
            plan = BoundedKVPlan.abstract(size, span, split)
        plans = (plan,) * len(caches) if several else plan
        sharded = mesh is not None
        head = tuple(abstract(x, sharded=sharded) for x in (params, caches, banks))
        extras = () if extra is None else extra(size, span)
        extras += (shaped((size, MAX_STOP_TOKENS), jnp.int32),) if block else ()
        extras = tuple(shaped(x.shape, x.dtype, split) for x in extras)
        return (*head, plans, shaped((width, k), jnp.int32, whole), rows, ids, rows, *extras)

    # Every program returns its tokens [C, K] where the next one reads them: on a mesh replicated, the
    # sharding `prev_tokens` is compiled for (and each process then holds every row it reads back).
    feeding = {"width": width, "steps": k, "sharding": whole}
    one_step = fed(step, **feeding)
    fingerprint = ("fed", width, *(() if fingerprint is None else fingerprint))
    steps = {}
    for walk in buckets.walks:
        block = walk == decode_walk and k > 1
        fn = fed(decode_block(step, steps=k, stops=True), **feeding) if block else one_step
        steps[walk] = capture(
            fn, buckets[walk].keys(), lambda key, block=block: arguments(key, block), donate_argnums=(1,),
            frozen_argnums=(0,), name=f"{name} {walk}", fingerprint=fingerprint, progress=progress, **options,
        )  # fmt: skip
    return steps


def decoder_node(
    name: str, runner: ResourceRunner, keys: tuple[str, ...], params: Any, programs: Any, *, mesh: Any = None,
    row_walks: Any = None,
) -> Node:  # fmt: skip
    """The `Node` of a decoder whose programs are `programs` (`capture_decoder`'s, padded to its width):
    it feeds, and with nothing in flight its programs read zeros."""
    no_feed = jnp.zeros((programs.width, getattr(programs, "decode_steps", 1)), jnp.int32)
    if mesh is not None:
        no_feed = jax.device_put(no_feed, NamedSharding(mesh, P()))
    walks = programs.buckets.walks
    return Node(name, runner, keys, params, walks, feeds=True, no_feed=no_feed, row_walks=row_walks)
