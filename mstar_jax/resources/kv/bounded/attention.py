"""The per-layer entry point a model calls inside `jit`: attend over the retained stream, then store."""

from __future__ import annotations

import dataclasses

import jax

from kernels_pallas.sink_window_attention import sink_window_attention
from mstar_jax.checks import is_int
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank, write_step
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

__all__ = ["attend", "check_layer", "check_step_width", "readable_source"]


def check_layer(layer: object, config: BoundedKVConfig) -> None:
    """Refuse a layer index the cache's per-layer arrays do not have.

    A Python or NumPy int must be in `[0, config.num_layers)` (a bool is refused: it is an int by
    accident). A JAX array (a tracer inside `jit` or `scan`) is left to the indexing itself, which
    decides what it accepts: it is not checked here.

    Raises:
      TypeError: for a bool, or a value that is neither an int nor a JAX array.
      ValueError: for an int outside `[0, config.num_layers)`.
    """
    if isinstance(layer, jax.Array):
        return
    if not is_int(layer, numpy=True):
        allowed = f"[0, num_layers={config.num_layers})"
        raise TypeError(f"layer={layer!r} must be an int in {allowed}, got {type(layer).__name__}")
    if not 0 <= layer < config.num_layers:
        raise ValueError(
            f"layer={layer} is outside [0, num_layers={config.num_layers}): the cache holds "
            f"{config.num_layers} layer(s), numbered from 0"
        )


def check_step_width(plan: BoundedKVPlan, q: jax.Array) -> None:
    """Refuse step arrays whose token axis is not the width the plan was made for.

    Tokens past a row's declared step tokens are never attended, so arrays wider than the step declares
    would lose their lookahead silently, and narrower ones would leave declared tokens unread.

    Args:
      plan: the manager's plan (`num_tokens` None: nothing to check).
      q: [N, T, H, D] the step's queries.

    Raises:
      ValueError: `T != plan.num_tokens`.
    """
    width, tokens = plan.num_tokens, q.shape[1]
    if width is None or tokens == width:
        return
    if tokens > width:
        raise ValueError(
            f"q carries {tokens} tokens per row (q.shape={tuple(q.shape)}), but the step declares at most "
            f"{width} (plan.num_tokens={width}): tokens past a row's step_tokens would be dropped, not "
            "attended. Declare every token a row brings in BoundedKVStep.step_tokens (span counts the "
            "written ones, the rest are lookahead), or run the step in a bucket as wide as the arrays "
            "(pad_step, or a StepContext whose slot_lease names the bucket)"
        )
    raise ValueError(
        f"q carries {tokens} tokens per row (q.shape={tuple(q.shape)}), but the step declares rows of up "
        f"to {width} (plan.num_tokens={width}); pass arrays that wide (the bucket's width, or the largest "
        "step_tokens; PaddedStep.pad pads them)"
    )


def readable_source(store: jax.Array, config: BoundedKVConfig) -> jax.Array:
    """One layer's source store `[V, R, G, L, D]` as attention reads it: empty (`L = 0`) when the config
    has no source prefix (`max_source_len = 0`).

    Such a bank still allocates one store tile (`store_capacity`) that no plan reads; every kernel takes
    an empty store, and the XLA path then drops the part (it gathered, scored and masked the tile's 8
    entries in every layer of every step).
    """
    return store[:, :, :, :0] if config.max_source_len == 0 else store


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
    rel_bias: jax.Array | None = None,
    sink_logits: jax.Array | None = None,
    write: bool = True,
    implementation: str = "auto",
    interpret=False,
) -> tuple[jax.Array, BoundedKVCache]:
    """Attend layer `layer`'s step queries over `stream[R] ++ step keys`, then store the written keys.

    Attention runs before the store, so a step never reads the ring entries its own writes evict.

    Args:
      cache, bank: the cache state (donate it to the enclosing `jit`) and the source bank.
      plan: the manager's plan for this step.
      layer: static layer index, in `[0, config.num_layers)`.
      q: [N, T, H, D] queries (RoPE already applied), N = B * rows_per_request, request-major.
      k, v: [N, T, G, D] the step's keys (RoPE applied) and values.
      config: the cache's config (static).
      scale: passed to `sink_window_attention`.
      rel_bias: None or float [N, H, T, RB]: a per-head Transformer-XL bias added to the raw scores before
        scaling, indexed by compacted distance: query `i` and key `j` of the concatenation
        `retained ++ own` read column `(total + i) - j + T - 1`, `total` the row's retained count
        (`RB >= max_retained + 2T - 1`).
      sink_logits: None or float [H]: gpt-oss's learned sink logit per query head, in the softmax
        denominator.
      write: False attends without storing the step's keys (the cache is returned as it came).
      implementation, interpret: passed to `sink_window_attention` and to the store (`write_step`): "xla"
        means both XLA paths, "pallas_tpu" / "pallas_gpu" both kernels of that platform, and "auto" picks
        each op's own way (the store follows the platform the program is lowered for).

    Returns:
      (out [N, T, H, D] in q's dtype, the updated cache).

    Raises:
      TypeError: `layer` is a bool or not an int (`check_layer`).
      ValueError: `layer` is outside `[0, config.num_layers)` (`check_layer`), q's token axis is not the
        plan's `num_tokens` (`check_step_width`), and whatever `sink_window_attention` refuses; raised
        while tracing, before anything runs.
    """
    check_layer(layer, config)
    check_step_width(plan, q)
    terms = {name: x for name, x in (("rel_bias", rel_bias), ("sink_logits", sink_logits)) if x is not None}
    with jax.named_scope(f"bounded_kv_layer{layer}"):
        out = sink_window_attention(
            q, k, v, cache.k[layer], cache.v[layer],
            readable_source(bank.k[layer], config), readable_source(bank.v[layer], config), plan.table,
            max_retained=config.max_retained, query_window=config.query_window, scale=scale, **terms,
            implementation=implementation, interpret=interpret,
        )  # fmt: skip
        if not write:
            return out, cache
        new_k, new_v, out = write_step(
            cache.k[layer], cache.v[layer], k, v, plan.table, reverse=config.reverse_step_order, after=out,
            implementation=implementation, interpret=interpret,
        )  # fmt: skip
    replace_layer = lambda layers, new: (*layers[:layer], new, *layers[layer + 1 :])  # noqa: E731
    return out, dataclasses.replace(cache, k=replace_layer(cache.k, new_k), v=replace_layer(cache.v, new_v))
