"""The public sink+window attention op: checks its inputs, then picks an implementation by platform.

Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

import jax

from kernels_pallas.sink_window_attention.dispatch import by_lowering_platform, jitted_kernel
from kernels_pallas.sink_window_attention.validate import validate_inputs
from kernels_pallas.sink_window_attention.xla import sink_window_attention_xla

if TYPE_CHECKING:
    from jax.experimental.pallas import tpu as pltpu

Implementation = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)


_KERNELS = {
    "pallas_tpu": ("tpu", "sink_window_attention_tpu"),
    "pallas_gpu": ("gpu", "sink_window_attention_gpu"),
}


def _pallas_implementation(name: str):
    return jitted_kernel(*_KERNELS[name], ("max_retained", "query_window", "scale", "interpret"))


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
    rel_bias: jax.Array | None = None,
    sink_logits: jax.Array | None = None,
    implementation: Implementation = "auto",
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Sink+window attention of a step's tokens over their rows' retained keys and the step's own keys.

    Each step token attends `stream[retained] ++ step keys` of its row (see `table` for the retained
    positions), masked by `query_window`; equivalent to `sink_window_attention_reference`. Scores and softmax
    statistics are float32. Jittable: everything but the arrays is static. Every implementation takes the
    two optional score terms, alone or together (and with token sinks and any window).

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
      rel_bias: None or [N, H, T, RB] (RB >= K + 2T - 1): Transformer-XL's per-distance term, added to
        `q . k` before scaling at column `(retained + i) - j + T - 1` for query token i and key j of the
        row's `retained ++ step keys` (compacted distances: the sink-window gap does not count).
      sink_logits: None or [H]: gpt-oss's learned sinks, one logit per query head (in the units of the
        scaled scores) added to the softmax denominator; no value goes with it.
      implementation: "xla", "pallas_tpu", "pallas_gpu", or "auto": the Pallas kernel of the platform the
        program is lowered for (TPU or CUDA, also when compiled ahead of time from a CPU host), the XLA
        path elsewhere and wherever the kernel raises NotImplementedError. An explicit Pallas
        implementation lowers only for its own platform, or anywhere with `interpret`.
      interpret: passed to the Pallas kernels: True (HLO interpreter) or `pltpu.InterpretParams` (TPU
        interpret mode) runs them on any backend, CPU included. Ignored by the XLA path.

    Returns:
      [N, T, H, D] in q's dtype; queries past a row's STEP_TOKENS and queries with no visible key give 0.

    Raises:
      ValueError: bad shapes, dtypes or settings.
      TypeError: a static setting of the wrong type.
      NotImplementedError: an explicitly requested Pallas implementation does not support the case.
    """
    score_terms = {"rel_bias": rel_bias, "sink_logits": sink_logits}
    validate_inputs(
        q, k, v, cache_k, cache_v, source_k, source_v, table,
        max_retained=max_retained, query_window=query_window, scale=scale, **score_terms,
    )  # fmt: skip
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected one of {IMPLEMENTATIONS}")
    # Only the terms given travel as operands: `platform_dependent` takes arrays, not None.
    given = tuple(name for name, x in score_terms.items() if x is not None)
    arrays = (q, k, v, cache_k, cache_v, source_k, source_v, table, *(score_terms[n] for n in given))
    settings = {"max_retained": max_retained, "query_window": query_window, "scale": scale}

    def call(fn, **options):
        def run(*arrays):
            return fn(*arrays[:8], **dict(zip(given, arrays[8:], strict=True)), **settings, **options)

        return run

    if implementation == "xla":
        return call(sink_window_attention_xla)(*arrays)
    if implementation != "auto":
        return call(_pallas_implementation(implementation), interpret=interpret)(*arrays)
    return by_lowering_platform(
        *arrays,
        tpu=call(_pallas_implementation("pallas_tpu"), interpret=interpret),
        cuda=call(_pallas_implementation("pallas_gpu"), interpret=interpret),
        default=call(sink_window_attention_xla),
    )
