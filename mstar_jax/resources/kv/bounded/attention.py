"""The per-layer entry point a model calls inside `jit`: attend over the retained stream, then store."""

from __future__ import annotations

import dataclasses

import jax

from kernels_pallas.sink_window_attention import sink_window_attention
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank, write_step
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

__all__ = ["attend"]


def attend(
    cache: BoundedKVCache,
    bank: SourceBank,
    plan: BoundedKVPlan,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: BoundedKVConfig,
    scale: float | None = None,
    implementation: str = "auto",
    interpret=False,
) -> tuple[jax.Array, BoundedKVCache]:
    """Attend layer `layer`'s step queries over `stream[R] ++ step keys`, then store the written keys.

    Attention runs before the store, so a step never reads the ring entries its own writes evict.

    Args:
      cache, bank: the cache state (donate it to the enclosing `jit`) and the source bank.
      plan: the manager's plan for this step.
      layer: static layer index.
      q: [N, T, H, D] queries (RoPE already applied), N = B * rows_per_request, request-major.
      k, v: [N, T, G, D] the step's keys (RoPE applied) and values.
      config: the cache's config (static).
      scale: passed to `sink_window_attention`.
      implementation, interpret: passed to `sink_window_attention` and to the store (`write_step`): "xla"
        means both XLA paths, "pallas_tpu" / "pallas_gpu" both kernels of that platform, and "auto" picks
        each op's own way (the store follows the platform the program is lowered for).

    Returns:
      (out [N, T, H, D] in q's dtype, the updated cache).
    """
    with jax.named_scope(f"bounded_kv_layer{layer}"):
        out = sink_window_attention(
            q, k, v, cache.k[layer], cache.v[layer], bank.k[layer], bank.v[layer], plan.table,
            max_retained=config.max_retained, query_window=config.query_window, scale=scale,
            implementation=implementation, interpret=interpret,
        )  # fmt: skip
        new_k, new_v, out = write_step(
            cache.k[layer], cache.v[layer], k, v, plan.table, reverse=config.reverse_step_order, after=out,
            implementation=implementation, interpret=interpret,
        )  # fmt: skip
    replace_layer = lambda layers, new: (*layers[:layer], new, *layers[layer + 1 :])  # noqa: E731
    return out, dataclasses.replace(cache, k=replace_layer(cache.k, new_k), v=replace_layer(cache.v, new_v))
