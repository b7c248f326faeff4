"""Shared random test cases for every sink+window attention implementation (XLA, Pallas TPU, Pallas GPU).

A case is a tiny batch planned by the host layout (`mstar_jax.resources.kv.bounded.layout`) from stream
states, with NaN wherever nothing may be read: every slot entry the table does not read (idle slots and
the padding slot included), every source entry no row reads, and the step keys and values past each
row's `STEP_TOKENS`. An implementation passes a case when its output is finite and matches
`case.reference_output()` (the float64 oracle).

Shapes use the legend of `kernels_pallas.sink_window_attention.table`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import numpy.typing as npt

from kernels_pallas.sink_window_attention import reference
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.resources.kv.bounded import layout

__all__ = ["KernelCase", "make_case", "races_found", "score_term_cases", "score_terms", "standard_cases"]


@dataclasses.dataclass(frozen=True, eq=False)  # eq would compare arrays
class KernelCase:
    """One attention call's inputs (NumPy arrays) and its static settings.

    Attributes:
      name: what the case exercises.
      q: [N, T, H, D] queries, N = B * R (request-major).
      k, v: [N, T, G, D] the step's own keys and values; NaN past each row's STEP_TOKENS.
      cache_k, cache_v: [S + 1, R, G, C, D] one layer's slots; the last is the padding slot.
      source_k, source_v: [V, R, G, L, D] one layer's sources.
      table: i32[B, ROW_INTS] the plan table; padding rows (if any) last.
      max_retained: K, the static bound on any row's retained keys (sink + window).
      query_window: None, or the causal band width.
      rows_per_request: R.
      reverse: whether the step's tokens join the stream last-first (matters to writes only).
    """

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cache_k: np.ndarray
    cache_v: np.ndarray
    source_k: np.ndarray
    source_v: np.ndarray
    table: np.ndarray
    max_retained: int
    query_window: int | None
    rows_per_request: int
    reverse: bool = False

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The op's eight positional arrays, in order."""
        return self.q, self.k, self.v, self.cache_k, self.cache_v, self.source_k, self.source_v, self.table

    def reference_output(self, scale: float | None = None, **score_terms) -> np.ndarray:
        """f64[N, T, H, D], the oracle's output for this case (`score_terms`: rel_bias, sink_logits)."""
        return reference.sink_window_attention_reference(
            *self.arrays(), query_window=self.query_window, scale=scale, **score_terms
        )


def _per_request(name: str, value: npt.ArrayLike | None, batch: int, default: np.ndarray) -> np.ndarray:
    """`value` as i64[batch] (an int is every request's), or `default` when None."""
    if value is None:
        return default
    array = np.asarray(value)
    if array.ndim == 0:
        array = np.full(batch, array)
    if array.shape != (batch,):
        raise ValueError(f"{name} must have one entry per request ({batch}), got shape {array.shape}")
    return array.astype(np.int64)


def _poisoned(
    rng: np.random.Generator, shape: tuple[int, ...], finite: np.ndarray, dtype: npt.DTypeLike
) -> np.ndarray:
    """Random normal values where `finite` (broadcast over `shape`) holds, NaN elsewhere."""
    values = rng.standard_normal(shape, dtype=np.float32)
    return np.where(finite, values, np.float32(np.nan)).astype(dtype)


def make_case(
    name: str,
    *,
    seed: int,
    batch: int,
    rows_per_request: int = 1,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    steps: int = 4,
    slots: int = 6,
    sources: int = 2,
    max_source_len: int = 24,
    sink: int = 6,
    window: int = 16,
    window_includes_step: bool = False,
    query_window: int | None = None,
    reverse: bool = False,
    dtype: npt.DTypeLike = np.float32,
    written: npt.ArrayLike | None = None,
    source_len: npt.ArrayLike | None = None,
    spans: npt.ArrayLike | None = None,
    step_tokens: npt.ArrayLike | None = None,
    padding_rows: int = 0,
    min_slot_tokens: int = 1,
    slot_ids: npt.ArrayLike | None = None,
    source_ids: npt.ArrayLike | None = None,
) -> KernelCase:
    """Builds one case with a constant `SinkWindow(sink, window, window_includes_step)` policy.

    Per-request stream states not given are drawn at random: `source_len` in [0, max_source_len],
    `written` up to a few windows past the sink (so rings wrap), `step_tokens = steps`, `spans =
    step_tokens`. Slots are distinct (`slot_ids`, else random, so `slots - batch` stay idle) and sources
    random (`source_ids`). The slot cache is `C = max(sink_capacity + window, min_slot_tokens, 1)` tokens
    with `sink_capacity = max(0, sink - min(source_len))`, the tightest slot these rows fit.

    Args:
      name: what the case exercises.
      seed: seeds every random draw.
      batch: B, real requests; `padding_rows` more rows are appended, naming the padding slot S.
      rows_per_request: R.
      heads, kv_heads, head_dim: H, G, D.
      steps: T, step tokens per row (the bucket).
      slots, sources: S real slots and V sources.
      max_source_len: L.
      sink, window, window_includes_step: the retention policy, the same for every request.
      query_window: None or the causal band width.
      reverse: step tokens join the stream last-first (refused with a query window).
      dtype: of q, k, v, caches and sources (float32 or bfloat16).
      written, source_len, spans, step_tokens: i[B] stream states (or one int for all requests).
      padding_rows: how many padding rows to append.
      min_slot_tokens: a lower bound on C, for kernels that want C block-aligned.
      slot_ids, source_ids: i[B] each request's slot and source.

    Returns:
      The case.
    """
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=}")
    if not 1 <= batch <= slots:
        raise ValueError(f"{batch=} must be in [1, {slots=}]: every request needs its own slot")
    if reverse and query_window is not None:
        raise ValueError("reverse step order with a query_window is a config error")
    rng = np.random.default_rng(seed)
    source_len = _per_request("source_len", source_len, batch, rng.integers(0, max_source_len + 1, batch))
    if source_len.max() > max_source_len:
        raise ValueError(f"source_len {source_len} must be <= {max_source_len=}")
    written = _per_request("written", written, batch, rng.integers(0, sink + 4 * window + 8, batch))
    step_tokens = _per_request("step_tokens", step_tokens, batch, np.full(batch, steps, np.int64))
    if step_tokens.max() > steps:
        raise ValueError(f"step_tokens {step_tokens} must be <= {steps=}")
    spans = _per_request("spans", spans, batch, step_tokens)
    slot_ids = _per_request("slot_ids", slot_ids, batch, rng.permutation(slots)[:batch])
    if len(set(slot_ids.tolist())) != batch or slot_ids.max() >= slots:
        raise ValueError(f"slot_ids {slot_ids} must be distinct and < {slots=}")
    source_ids = _per_request("source_ids", source_ids, batch, rng.integers(0, sources, batch))

    sink_capacity = max(0, sink - int(source_len.min()))
    slot_tokens = max(sink_capacity + window, min_slot_tokens, 1)
    real = layout.plan_table(
        slot=slot_ids,
        source=source_ids,
        source_len=source_len,
        written=written,
        span=spans,
        step_tokens=step_tokens,
        sink=np.full(batch, sink),
        window=np.full(batch, window),
        window_includes_step=np.full(batch, window_includes_step),
        sink_capacity=sink_capacity,
        reverse=reverse,
        slot_tokens=slot_tokens,
    )
    table = np.concatenate([real, layout.padding_rows(padding_rows, slots)])

    # Only what the table reads is finite: a kernel that touches anything else produces NaN.
    slot_live = np.zeros((slots + 1, slot_tokens), bool)
    source_live = np.zeros((sources, max_source_len), bool)
    for row in real:
        for i, from_source in enumerate(tbl.READ_FROM_SOURCE):
            start, length = row[tbl.read_start(i)], row[tbl.read_len(i)]
            live = source_live[row[tbl.SOURCE]] if from_source else slot_live[row[tbl.SLOT]]
            live[start : start + length] = True
    rows, tokens = table.shape[0] * rows_per_request, np.repeat(table[:, tbl.STEP_TOKENS], rows_per_request)
    step_live = (np.arange(steps) < tokens[:, None])[:, :, None, None]
    cache_shape = (slots + 1, rows_per_request, kv_heads, slot_tokens, head_dim)
    source_shape = (sources, rows_per_request, kv_heads, max_source_len, head_dim)
    step_shape = (rows, steps, kv_heads, head_dim)
    return KernelCase(
        name=name,
        q=rng.standard_normal((rows, steps, heads, head_dim), dtype=np.float32).astype(dtype),
        k=_poisoned(rng, step_shape, step_live, dtype),
        v=_poisoned(rng, step_shape, step_live, dtype),
        cache_k=_poisoned(rng, cache_shape, slot_live[:, None, None, :, None], dtype),
        cache_v=_poisoned(rng, cache_shape, slot_live[:, None, None, :, None], dtype),
        source_k=_poisoned(rng, source_shape, source_live[:, None, None, :, None], dtype),
        source_v=_poisoned(rng, source_shape, source_live[:, None, None, :, None], dtype),
        table=table,
        max_retained=sink + window,
        query_window=query_window,
        rows_per_request=rows_per_request,
        reverse=reverse,
    )


def standard_cases(dtype: npt.DTypeLike = np.float32) -> list[KernelCase]:
    """The cases every implementation must pass (docs/design.md §6), in `dtype` (float32 or bfloat16).

    Defaults: sink 6, window 16, 6 slots, 2 sources of up to 24 entries, H 4, G 2, D 32.
    """
    d = {"dtype": dtype}
    return [
        make_case("decode", seed=1, batch=4, steps=1, **d),
        make_case("chunk", seed=2, batch=3, steps=8, **d),
        # n = 3 + 85 = 88 > 11 windows; window 80..87 starts at ring slot (80 - 2) % 8 = 6: wraps.
        make_case("many_wraps", seed=3, batch=2, sink=2, window=8, source_len=[3, 0], written=[85, 58], **d),
        # sink 10 over sources of 3, 0, 7: the written sink part lives in the slot (read 1).
        make_case(
            "sink_over_source",
            seed=4,
            batch=3,
            sink=10,
            window=8,
            source_len=[3, 0, 7],
            written=[2, 30, 50],
            **d,
        ),
        make_case("sink0", seed=5, batch=3, sink=0, window=12, **d),
        # n = 5 < sink for row 0 (source 2 + slot 3), sink inside the source for row 1; no ring at all.
        make_case("window0", seed=6, batch=2, sink=6, window=0, source_len=[2, 10], written=[3, 9], **d),
        make_case("window3", seed=7, batch=3, sink=2, window=3, written=[1, 9, 40], **d),
        make_case("idle_slots", seed=8, batch=2, slots=6, **d),
        # One read-only row (span 0), one fresh row, sources of every length, three voices.
        make_case(
            "mixed",
            seed=9,
            batch=4,
            sources=3,
            source_len=[0, 5, 24, 13],
            written=[0, 7, 40, 90],
            spans=[4, 0, 2, 4],
            source_ids=[2, 0, 1, 2],
            **d,
        ),
        make_case("two_rows_per_request", seed=10, batch=3, rows_per_request=2, **d),
        make_case("query_window_chunk", seed=11, batch=3, steps=8, sink=2, window=6, query_window=3, **d),
        make_case("query_window_decode", seed=12, batch=4, steps=1, sink=2, window=8, query_window=4, **d),
        # spans 4, 2, 0 read the newest 12, 14 and 16 entries.
        make_case(
            "window_includes_step",
            seed=13,
            batch=3,
            window=16,
            window_includes_step=True,
            spans=[4, 2, 0],
            written=[30, 60, 90],
            source_len=[0, 3, 8],
            **d,
        ),
        make_case("padding_rows", seed=14, batch=2, padding_rows=2, **d),
        make_case("empty_retained", seed=15, batch=3, source_len=[0, 0, 5], written=[0, 0, 20], **d),
        make_case("gqa_kv1", seed=16, batch=3, heads=4, kv_heads=1, **d),
        make_case(
            "bucket_padded_tokens", seed=17, batch=3, steps=8, step_tokens=[5, 8, 1], spans=[5, 3, 1], **d
        ),
        make_case("head_dim64", seed=18, batch=2, head_dim=64, **d),
        # n = sink - 1, sink, sink + window, sink + window + 1 (the first wrap).
        make_case(
            "boundaries", seed=19, batch=4, sink=4, window=8, source_len=0, written=[3, 4, 12, 13], **d
        ),
        make_case("reverse", seed=20, batch=3, reverse=True, **d),
        make_case("padded_slot", seed=21, batch=3, min_slot_tokens=40, **d),
    ]


def fast_compile_options() -> dict | None:
    """XLA:CPU options that halve the compile time of an interpreted kernel, where this jaxlib has them.

    An interpreted kernel runs in milliseconds; compiling it takes seconds, so compile less hard. Option
    names change between jaxlib versions, so each set is tried on a trivial function first.
    """
    if jax.default_backend() != "cpu":
        return None
    for options in (
        {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
        {"xla_backend_optimization_level": 0},
    ):
        try:
            jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
        except Exception:  # an unknown option name: try the next set
            continue
        return options
    return None


def races_found() -> bool | None:
    """Whether TPU interpret mode's race detector flagged the last kernel; None where JAX hides it."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    except ImportError:
        return None
    races = getattr(interpret_pallas_call, "races", None)
    return None if races is None else bool(races.races_found)


def score_terms(
    case: KernelCase, *, seed: int, rel_bias: bool = True, sink_logits: bool = True, extra_width: int = 3
) -> dict[str, np.ndarray]:
    """Random `rel_bias` (f32[N, H, T, K + 2T - 1 + extra_width], x4 as the original's test) and sinks.

    The sink logits span both signs and a logit far above any score, so a sink that took all the mass or
    none would show. The bias is NaN wherever no (query, key) pair of a row reads it: the columns past
    or before the row's distances, and the rows of padding tokens.
    """
    rng = np.random.default_rng(seed)
    rows, steps, heads, _ = case.q.shape
    terms = {}
    if rel_bias:
        width = case.max_retained + 2 * steps - 1 + extra_width
        bias = 4 * rng.standard_normal((rows, heads, steps, width), dtype=np.float32)
        table = np.repeat(case.table, case.rows_per_request, axis=0)
        retained = tbl.retained_count(table)[:, None, None]
        own = table[:, tbl.STEP_TOKENS][:, None, None]
        i, column = np.arange(steps)[None, :, None], np.arange(width)[None, None, :]
        # Keys j in [0, retained + own) give columns retained + i - j + T - 1 for real tokens i < own.
        read = (i < own) & (column >= i - own + steps) & (column <= retained + i + steps - 1)
        terms["rel_bias"] = np.where(read[:, None], bias, np.float32(np.nan))
    if sink_logits:
        logits = rng.uniform(-3.0, 3.0, heads).astype(np.float32)
        logits[0] = 8.0
        terms["sink_logits"] = logits
    return terms


def score_term_cases(dtype: npt.DTypeLike = np.float32) -> list[KernelCase]:
    """Standard cases that cover what the score terms must honour: sinks inside and past the source,
    wrapped windows, read-only and padded rows, reverse order, query windows, GQA and several rows per
    request."""
    names = {
        "decode", "chunk", "many_wraps", "sink_over_source", "sink0", "window0", "mixed",
        "two_rows_per_request", "query_window_chunk", "query_window_decode", "window_includes_step",
        "padding_rows", "empty_retained", "gqa_kv1", "bucket_padded_tokens", "reverse",
    }  # fmt: skip
    return [case for case in standard_cases(dtype) if case.name in names]
