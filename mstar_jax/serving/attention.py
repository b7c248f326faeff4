"""A model's attention layers on a bounded cache: one function per (cache, plan) that every layer calls.

A model's transformer calls `fn(cache, layer, q, k, v) -> (out, cache)` for each attention layer; this
builds that function once per step from the cache's config, its source bank and the step's plan, casting
the projections to the cache's dtype and running `attend` (or `sharded_attend` on a mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig
from mstar_jax.resources.kv.bounded.sharding import sharded_attend

__all__ = ["LayerAttention", "layer_attention"]

LayerAttention = Callable[
    [BoundedKVCache, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, BoundedKVCache]
]
"""`(cache, layer, q, k, v) -> (out, cache)`: one attention layer over the retained stream."""


def layer_attention(
    config: BoundedKVConfig,
    bank: SourceBank,
    plan: BoundedKVPlan | jax.Array,
    *,
    implementation: str = "auto",
    interpret: Any = False,
    mesh: jax.sharding.Mesh | None = None,
    write: bool = True,
) -> LayerAttention:
    """The attention every layer of a step calls on one bounded cache.

    Args:
      config: the cache's config (its dtype is what q, k and v are cast to).
      bank: the cache's source bank.
      plan: the step's plan of this cache, or its table i32[B, ROW_INTS].
      implementation, interpret: as `sink_window_attention` takes them.
      mesh: run `sharded_attend` over this mesh (the arrays global and shard-major); None: one device.
      write: store the step's keys and values (False: read the retained stream only).
    """
    plan = plan if isinstance(plan, BoundedKVPlan) else BoundedKVPlan(plan)
    options = {"config": config, "implementation": implementation, "interpret": interpret, "write": write}

    def attention(cache, layer, q, k, v):
        dt = config.dtype
        args = (cache, bank, plan, layer, q.astype(dt), k.astype(dt), v.astype(dt))
        if mesh is not None:
            return sharded_attend(mesh, *args, **options)
        return attend(*args, **options)

    return attention
