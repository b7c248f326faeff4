"""The public sink+window attention op: checks its inputs, then picks an implementation by backend.

Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.xla import sink_window_attention_xla

if TYPE_CHECKING:
    from jax.experimental.pallas import tpu as pltpu

Implementation = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
# The backend each Pallas implementation compiles for; elsewhere it only runs in interpret mode.
_PALLAS_BACKEND = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def _shape_error(name: str, array, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {tuple(array.shape)}; expected {expected}")


def validate_inputs(
    q, k, v, cache_k, cache_v, source_k, source_v, table, *, max_retained, query_window=None, scale=None
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


def _pallas_implementation(name: str):
    # Imported on use so that the package imports without the Pallas kernels (and their lowering stacks).
    if name == "pallas_tpu":
        from kernels_pallas.sink_window_attention.tpu import sink_window_attention_tpu

        return sink_window_attention_tpu
    from kernels_pallas.sink_window_attention.gpu import sink_window_attention_gpu

    return sink_window_attention_gpu


def sink_window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    source_k: jax.Array,
    source_v: jax.Array,
    table: jax.Array,
    *,
    max_retained: int,
    query_window: int | None = None,
    scale: float | None = None,
    implementation: Implementation = "auto",
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Sink+window attention of a step's tokens over their rows' retained keys and the step's own keys.

    Each step token attends `stream[retained] ++ step keys` of its row (see `table` for the retained
    positions), masked by `query_window`; equivalent to `sink_window_attention_reference`. Scores and softmax
    statistics are float32. Jittable: everything but the arrays is static.

    Args:
      q: [N, T, H, D] queries, N = B * R, request-major.
      k, v: [N, T, G, D] the step's own keys and values (H % G == 0); tokens past a row's STEP_TOKENS are
        ignored.
      cache_k, cache_v: [S, R, G, C, D] one layer's slots.
      source_k, source_v: [V, R, G, L, D] one layer's source bank.
      table: i32[B, ROW_INTS] plan table; row n uses table row n // R and cache/source row n % R.
      max_retained: K, the static bound on a row's retained keys (`max_retained` of the KV config).
      query_window: None (every query sees all retained and step keys) or q >= 1 (causal band of q keys,
        sinks always visible).
      scale: score scale; defaults to 1 / sqrt(D).
      implementation: "xla", "pallas_tpu", "pallas_gpu", or "auto": the Pallas kernel of the default
        backend (TPU or GPU), the XLA path elsewhere and wherever the kernel raises NotImplementedError.
      interpret: passed to the Pallas kernels: True (HLO interpreter) or `pltpu.InterpretParams` (TPU
        interpret mode) runs them on any backend, CPU included. Ignored by the XLA path.

    Returns:
      [N, T, H, D] in q's dtype; queries past a row's STEP_TOKENS and queries with no visible key give 0.

    Raises:
      ValueError: bad shapes, dtypes or settings; a Pallas implementation asked for off its backend without
        `interpret`.
      TypeError: a static setting of the wrong type.
      NotImplementedError: an explicitly requested Pallas implementation does not support the case.
    """
    validate_inputs(
        q, k, v, cache_k, cache_v, source_k, source_v, table,
        max_retained=max_retained, query_window=query_window, scale=scale,
    )  # fmt: skip
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected one of {IMPLEMENTATIONS}")
    arrays = (q, k, v, cache_k, cache_v, source_k, source_v, table)
    settings = {"max_retained": max_retained, "query_window": query_window, "scale": scale}

    if implementation == "xla":
        return sink_window_attention_xla(*arrays, **settings)
    backend = jax.default_backend()
    if implementation == "auto":
        pallas = {backend: name for name, backend in _PALLAS_BACKEND.items()}.get(backend)
        if pallas is None:
            return sink_window_attention_xla(*arrays, **settings)
        try:
            return _pallas_implementation(pallas)(*arrays, **settings, interpret=interpret)
        except NotImplementedError:
            return sink_window_attention_xla(*arrays, **settings)
    if backend != _PALLAS_BACKEND[implementation] and not interpret:
        raise ValueError(
            f"implementation={implementation!r} compiles only on {_PALLAS_BACKEND[implementation]} but the "
            f"default backend is {backend!r}; pass interpret=True (or pltpu.InterpretParams()) to run it "
            "there, or use implementation='xla'"
        )
    return _pallas_implementation(implementation)(*arrays, **settings, interpret=interpret)
