"""Input checks shared by every sink+window attention implementation (XLA, Pallas TPU, Pallas GPU).

One validator, so every implementation refuses the same inputs with the same typed error naming the argument,
its value and what is allowed. Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import table as tbl

__all__ = ["validate_inputs"]


def _shape_error(name: str, array, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {tuple(array.shape)}; expected {expected}")


def validate_inputs(
    q,
    k,
    v,
    cache_k,
    cache_v,
    source_k,
    source_v,
    table,
    *,
    max_retained,
    query_window=None,
    scale=None,
    rel_bias=None,
    sink_logits=None,
) -> None:
    """Checks shapes, dtypes and static settings of a `sink_window_attention` call.

    Works on arrays, tracers and `jax.ShapeDtypeStruct`s (only `.shape` and `.dtype` are read).

    Raises:
      ValueError: naming the offending argument, what it is and what is expected.
      TypeError: when a static setting has the wrong type.
    """
    floats = {"q": q, "k": k, "v": v, "cache_k": cache_k, "cache_v": cache_v}
    floats |= {"source_k": source_k, "source_v": source_v}
    ranks = {"q": 4, "k": 4, "v": 4, "cache_k": 5, "cache_v": 5, "source_k": 5, "source_v": 5, "table": 2}
    for name, x in (floats | {"table": table}).items():
        if len(x.shape) != ranks[name]:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} (rank {len(x.shape)}); expected rank {ranks[name]}"
            )
    for name, x in floats.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {x.dtype}; expected a floating dtype (float32, bfloat16)")
        if x.dtype != q.dtype:
            raise ValueError(
                f"{name} has dtype {x.dtype} but q has {q.dtype}; all of q, k, v, the cache and "
                "the source bank must share one dtype (cast them before the call)"
            )
    if table.dtype != np.int32:
        raise ValueError(f"table has dtype {table.dtype}; expected int32 (the plan table, i32[B, ROW_INTS])")

    n_rows, steps, heads, dim = q.shape
    if k.shape[:2] != (n_rows, steps) or k.shape[3] != dim:
        expected = f"[N, T, G, D] = [{n_rows}, {steps}, G, {dim}] to match q {tuple(q.shape)}"
        raise _shape_error("k", k, expected)
    if v.shape != k.shape:
        raise _shape_error("v", v, f"k's shape {tuple(k.shape)}")
    groups = k.shape[2]
    if groups == 0 or heads % groups:
        raise ValueError(
            f"q has {heads} heads and k has {groups} KV heads (q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}); query heads H must be a multiple of KV heads G"
        )
    _, rows_per_request, cache_groups, _, cache_dim = cache_k.shape
    if (cache_groups, cache_dim) != (groups, dim):
        raise _shape_error("cache_k", cache_k, f"[S, R, G, C, D] with G = {groups}, D = {dim}")
    if cache_v.shape != cache_k.shape:
        raise _shape_error("cache_v", cache_v, f"cache_k's shape {tuple(cache_k.shape)}")
    _, source_rows, source_groups, _, source_dim = source_k.shape
    if (source_rows, source_groups, source_dim) != (rows_per_request, groups, dim):
        raise _shape_error(
            "source_k", source_k, f"[V, R, G, L, D] with R = {rows_per_request}, G = {groups}, D = {dim}"
        )
    if source_v.shape != source_k.shape:
        raise _shape_error("source_v", source_v, f"source_k's shape {tuple(source_k.shape)}")
    if table.shape[1] != tbl.ROW_INTS:
        raise _shape_error("table", table, f"[B, ROW_INTS] with ROW_INTS = {tbl.ROW_INTS}")
    if table.shape[0] * rows_per_request != n_rows:
        raise ValueError(
            f"table has {table.shape[0]} rows and the cache {rows_per_request} rows per request, so q should "
            f"have {table.shape[0] * rows_per_request} attention rows (B * R, request-major); q has {n_rows}"
        )

    if isinstance(max_retained, bool) or not isinstance(max_retained, (int, np.integer)):
        raise TypeError(f"max_retained={max_retained!r} must be a Python int (a static bound, K)")
    if max_retained < 0:
        raise ValueError(f"{max_retained=} must be >= 0")
    if isinstance(table, np.ndarray) and table.size:  # a host table is checked for free (a device one: sync)
        retained = tbl.retained_count(table)
        row = int(np.argmax(retained))
        if retained[row] > max_retained:
            raise ValueError(
                f"table row {row} retains {int(retained[row])} keys but max_retained={max_retained}; every "
                "row must retain at most max_retained keys (the implementations read no more of a row)"
            )
    if query_window is not None:
        if isinstance(query_window, bool) or not isinstance(query_window, (int, np.integer)):
            raise TypeError(f"query_window={query_window!r} must be None or a Python int")
        if query_window < 1:
            raise ValueError(f"{query_window=} must be None or >= 1")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"scale={scale!r} must be None or a Python float (it is static)")
        if not math.isfinite(scale):
            raise ValueError(f"{scale=} must be finite")
    _validate_score_terms(q, max_retained, rel_bias, sink_logits)


def _validate_score_terms(q, max_retained: int, rel_bias, sink_logits) -> None:
    """Checks the optional `rel_bias [N, H, T, RB]` and `sink_logits [H]` against q's shape."""
    n_rows, steps, heads, _ = q.shape
    if rel_bias is not None:
        width = max_retained + 2 * steps - 1
        expected = f"[N, H, T, RB] = [{n_rows}, {heads}, {steps}, RB] with RB >= K + 2T - 1 = {width}"
        if len(rel_bias.shape) != 4 or tuple(rel_bias.shape[:3]) != (n_rows, heads, steps):
            raise _shape_error("rel_bias", rel_bias, expected)
        if rel_bias.shape[3] < width:
            raise _shape_error("rel_bias", rel_bias, expected)
        if not jnp.issubdtype(rel_bias.dtype, jnp.floating):
            raise ValueError(f"rel_bias has dtype {rel_bias.dtype}; expected a floating dtype")
    if sink_logits is not None:
        if tuple(sink_logits.shape) != (heads,):
            raise _shape_error("sink_logits", sink_logits, f"[H] = [{heads}], one logit per query head")
        if not jnp.issubdtype(sink_logits.dtype, jnp.floating):
            raise ValueError(f"sink_logits has dtype {sink_logits.dtype}; expected a floating dtype")
