"""Pure-XLA sink+window attention: gather the retained keys through the plan table, then one softmax.

Shape legend: see `kernels_pallas.sink_window_attention.table` (N rows, T step tokens, H query heads,
G KV heads, I = H // G query heads per KV head, D head dim, K max retained keys, P keys of one part).

The retained keys of a row live in two stores: the source bank (reads 0 and 2) and the row's slot (reads 1,
3 and 4). Each store is gathered into its own buffer, `min(K, L)` and `min(K, C)` keys long (the most a
valid table reads of one row from it), rather than gathering both stores for all `K` keys and selecting:
the step gathers `O(N * (min(K, L) + min(K, C)))` entries whatever `S` and `V` are, and buffer entries
past a row's reads re-read entry 0 and are masked. The step's own `T` keys form a third part. The three
parts share one softmax (their scores are masked, then reduced together); attention ignores key order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.ordered import ordered_sum

# f32 inputs keep f32 products on TPU/GPU (the default would round them to bf16 / TF32); bf16 is exact.
_PRECISION = lax.Precision.HIGHEST
SCORES_KEYS_LEFT = 16
"""Queries per KV head in a step up to which the scores' product takes the keys on its left (`_scores`)."""


@dataclasses.dataclass(frozen=True)
class _Part:
    """One group of keys sharing the softmax: K and V entries, stream positions, places and validity."""

    keys: jax.Array  # [N, G, P, D]
    values: jax.Array  # [N, G, P, D], zero where not valid
    positions: jax.Array  # i32[N, P]
    index: jax.Array  # i32[N, P]: the key's place j in `retained ++ step keys` (for rel_bias)
    valid: jax.Array  # bool[N, P]


def _gather_part(
    rows: jax.Array,
    store_k: jax.Array,
    store_v: jax.Array,
    store_index: jax.Array,
    reads: tuple[int, ...],
    size: int,
) -> _Part:
    """Gathers the keys of `reads` (in table order) from one store into a `size`-long buffer per row.

    Args:
      rows: i32[N, ROW_INTS], each attention row's table row.
      store_k, store_v: [S or V, R, G, C or L, D], the store the reads address.
      store_index: i32[N], the slot or source each row reads (its `SLOT` or `SOURCE` column).
      reads: which of the five read ranges live in this store.
      size: buffer length; a valid table never puts more than this many of a row's keys in the store.

    Returns:
      The part, `size` keys per row; entries past the row's reads are invalid and read index 0.
    """
    n_rows = rows.shape[0]
    n_stores, rows_per_request, _, store_len, _ = store_k.shape
    t = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, P]
    index = jnp.zeros((n_rows, size), jnp.int32)  # into the store's token axis
    retained_j = jnp.zeros((n_rows, size), jnp.int32)  # in the row's retained list (all five reads)
    valid = jnp.zeros((n_rows, size), bool)
    buffer_begin = retained_begin = jnp.zeros((n_rows, 1), jnp.int32)
    for i in range(tbl.NUM_READS):
        length = rows[:, tbl.read_len(i)][:, None]  # [N, 1]
        if i in reads:
            local = t - buffer_begin
            inside = (local >= 0) & (local < length)
            index = jnp.where(inside, rows[:, tbl.read_start(i)][:, None] + local, index)
            retained_j = jnp.where(inside, retained_begin + local, retained_j)
            valid |= inside
            buffer_begin = buffer_begin + length
        retained_begin = retained_begin + length
    store = store_index[:, None]  # [N, 1]
    # A malformed table must not read another store's or row's memory: mask, then clamp to index 0.
    valid &= (index >= 0) & (index < store_len) & (store >= 0) & (store < n_stores)
    index = jnp.where(valid, index, 0)
    store = jnp.where(valid, store, 0)
    within = (jnp.arange(n_rows, dtype=jnp.int32) % rows_per_request)[:, None]  # [N, 1]: row c of R

    kept, window_start = rows[:, tbl.SINK_KEPT][:, None], rows[:, tbl.WINDOW_START][:, None]
    positions = tbl.retained_position(retained_j, kept, window_start, xp=jnp)
    # Gathering [N, G, P, D] (one D-long run per key and head) hands the dots their batch-major layout.
    head = jnp.arange(store_k.shape[2], dtype=jnp.int32)[None, :, None]  # [1, G, 1]
    at = (store[:, None, :], within[:, None, :], head, index[:, None, :])
    keys, values = store_k[at], store_v[at]
    # Unread entries may hold anything (NaN in tests); 0 * NaN would leak through the value product.
    values = jnp.where(valid[:, None, :, None], values, jnp.zeros((), values.dtype))
    return _Part(keys, values, positions, retained_j, valid)


def _own_part(rows: jax.Array, k: jax.Array, v: jax.Array) -> _Part:
    """The step's own keys: token `i` at stream position `STREAM_LEN + i`, valid below `STEP_TOKENS`."""
    steps = k.shape[1]
    i = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    valid = i < rows[:, tbl.STEP_TOKENS][:, None]  # [N, T]
    values = jnp.where(valid[:, :, None, None], v, jnp.zeros((), v.dtype))
    # [N, T, G, D] -> [N, G, T, D], the layout of the gathered parts.
    return _Part(
        k.transpose(0, 2, 1, 3),
        values.transpose(0, 2, 1, 3),
        rows[:, tbl.STREAM_LEN][:, None] + i,
        tbl.retained_count(rows)[:, None] + i,
        valid,
    )


def rel_bias_at(rel_bias: jax.Array, key_index: jax.Array, retained: jax.Array, kv_heads: int) -> jax.Array:
    """f32[N, G, T, H/G, P]: `rel_bias [N, H, T, RB]` under keys `key_index` (i32[N, P], places in
    `retained ++ step keys`, see `table`), heads split by KV head as the scores are.

    One scalar gather from the flattened bias, its index built in the output's own shape: the output's
    minor dim is the key, so no backend stages it through relayouts (a batched gather over heads put the
    small head dims minor, which TPU pads to whole tiles). Columns outside `[0, RB)` (only keys masked
    anyway) are clamped.
    """
    n_rows, heads, steps, width = rel_bias.shape
    if rel_bias.size >= 2**31:
        raise ValueError(f"rel_bias has shape {tuple(rel_bias.shape)}; expected fewer than 2**31 entries")
    group = heads // kv_heads
    token = jnp.arange(steps, dtype=jnp.int32)
    column = tbl.rel_bias_column(key_index[:, None, :], token[None, :, None], retained[:, None, None], steps)
    column = jnp.clip(column, 0, width - 1)[:, None, :, None, :]  # [N, 1, T, 1, P]
    head = jnp.arange(heads, dtype=jnp.int32).reshape(1, kv_heads, 1, group, 1)
    row = jnp.arange(n_rows, dtype=jnp.int32).reshape(n_rows, 1, 1, 1, 1)
    flat = ((row * heads + head) * steps + token.reshape(1, 1, steps, 1, 1)) * width + column
    return jnp.asarray(rel_bias, jnp.float32).reshape(-1).at[flat].get(mode="promise_in_bounds")


def _rel_bias_scores(rel_bias: jax.Array, rows: jax.Array, part: _Part, kv_heads: int) -> jax.Array:
    """f32[N, G, T, I, P]: the `rel_bias` term of each query and key of `part` (see `table`)."""
    return rel_bias_at(rel_bias, part.index, tbl.retained_count(rows), kv_heads)


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """An einsum accumulated (and returned) in float32."""
    return jnp.einsum(spec, a, b, precision=_PRECISION, preferred_element_type=jnp.float32)


def _scores(qg: jax.Array, keys: jax.Array) -> jax.Array:
    """f32[N, G, T, I, P]: each query's product with each key.

    A few queries per KV head (a decode step) take the keys as the left operand: their head dim is then
    its contracting dim, minor as stored, and nothing lays the keys out again (with the queries on the
    left, XLA:CPU transposed every layer's gathered keys each step, 4 ms of Gemma 3's 43). Many queries
    (a prefill chunk) keep them on the right, where the product's output needs no transpose.
    """
    n_rows, steps, groups, per_group, dim = qg.shape
    if steps * per_group > SCORES_KEYS_LEFT:
        return _dot("ntgid,ngpd->ngtip", qg, keys)
    queries = qg.transpose(0, 2, 1, 3, 4).reshape(n_rows, groups, steps * per_group, dim)
    s = lax.dot_general(
        keys, queries, (((3,), (3,)), ((0, 1), (0, 1))), precision=_PRECISION,
        preferred_element_type=jnp.float32,
    )  # [N, G, P, T * I]  # fmt: skip
    return s.reshape(n_rows, groups, -1, steps, per_group).transpose(0, 1, 3, 4, 2)


def _visible(rows: jax.Array, part: _Part, steps: int, query_window: int | None) -> jax.Array:
    """bool[N, T, P]: which keys of `part` each step token sees (validity and the query window)."""
    visible = jnp.broadcast_to(part.valid[:, None, :], (part.valid.shape[0], steps, part.valid.shape[1]))
    if query_window is None:
        return visible
    query_pos = rows[:, tbl.STREAM_LEN][:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [N, T]
    key_pos = part.positions[:, None, :]  # [N, 1, P]
    query_pos = query_pos[:, :, None]  # [N, T, 1]
    sink = rows[:, tbl.SINK][:, None, None]
    return visible & tbl.query_window_visible(key_pos, query_pos, sink, query_window)


def sink_window_attention_xla(
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
) -> jax.Array:
    """Attention of each step token over its row's retained keys and the step's own keys, in pure XLA.

    Equivalent to `sink_window_attention_reference` (stream order aside, which softmax ignores). Inputs are
    not checked here; `sink_window_attention` validates them. Jittable with `max_retained`,
    `query_window` and `scale` static. Costs O(N * K) gathered keys, independent of S and V.

    Args:
      q: [N, T, H, D] queries, N = B * R, request-major.
      k, v: [N, T, G, D] the step's own keys and values; tokens past a row's STEP_TOKENS are ignored.
      cache_k, cache_v: [S, R, G, C, D] one layer's slots.
      source_k, source_v: [V, R, G, L, D] one layer's source bank.
      table: i32[B, ROW_INTS] plan table; row n uses table row n // R and cache/source row n % R.
      max_retained: K, the static bound on a row's retained keys (keys past it are not read).
      query_window: None (every query sees every key) or q >= 1 (causal band, sinks always visible).
      scale: score scale; defaults to 1 / sqrt(D).
      rel_bias: None or [N, H, T, RB], the per-distance term added before scaling (see `table`).
      sink_logits: None or [H], one learned logit per query head in the softmax denominator.

    Returns:
      [N, T, H, D] in q's dtype; queries past a row's STEP_TOKENS and queries with no visible key give 0.
    """
    with jax.named_scope("sink_window_attention_xla"):
        n_rows, steps, heads, dim = q.shape
        groups = k.shape[2]
        scale = dim**-0.5 if scale is None else scale
        rows = jnp.repeat(table.astype(jnp.int32), cache_k.shape[1], axis=0)  # [N, ROW_INTS]: row n // R

        parts = []
        with jax.named_scope("gather"):
            source_size = min(max_retained, source_k.shape[3])
            if source_size and source_k.shape[0]:
                source, reads = rows[:, tbl.SOURCE], tbl.SOURCE_READS
                parts.append(_gather_part(rows, source_k, source_v, source, reads, source_size))
            slot_size = min(max_retained, cache_k.shape[3])
            if slot_size and cache_k.shape[0]:
                slot, reads = rows[:, tbl.SLOT], tbl.SLOT_READS
                parts.append(_gather_part(rows, cache_k, cache_v, slot, reads, slot_size))
            parts.append(_own_part(rows, k, v))

        with jax.named_scope("scores"):
            qg = q.reshape(n_rows, steps, groups, heads // groups, dim)  # [N, T, G, I, D]
            scores = []  # [N, G, T, I, P] per part: (n, g) lead, as the dots batch them
            for part in parts:
                s = _scores(qg, part.keys)
                if rel_bias is not None:
                    s = s + _rel_bias_scores(rel_bias, rows, part, groups)
                s = s * scale
                visible = _visible(rows, part, steps, query_window)[:, None, :, None, :]  # [N, 1, T, 1, P]
                scores.append(jnp.where(visible, s, -jnp.inf))

        with jax.named_scope("softmax"):
            m = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)  # [N, G, T, I]
            if sink_logits is not None:
                sinks = sink_logits.astype(jnp.float32).reshape(1, groups, 1, heads // groups)
                m = jnp.maximum(m, sinks)
            # A query that sees nothing has m = -inf; shifting by 0 keeps exp(-inf) = 0 instead of NaN.
            m = jnp.where(jnp.isfinite(m), m, 0.0)
            probs = [jnp.exp(s - m[..., None]) for s in scores]
            total = sum(ordered_sum(p) for p in probs)  # [N, G, T, I], rounded alike in any batch
            if sink_logits is not None:
                total = total + jnp.exp(sinks - m)
            out = sum(
                _dot("ngtip,ngpd->ngtid", p.astype(part.values.dtype), part.values)
                for p, part in zip(probs, parts, strict=True)
            )
            out = out / jnp.where(total > 0, total, 1.0)[..., None]

        out = out.transpose(0, 2, 1, 3, 4).reshape(n_rows, steps, heads, dim)
        query_valid = jnp.arange(steps, dtype=jnp.int32)[None, :] < rows[:, tbl.STEP_TOKENS][:, None]
        # Padding queries may be NaN themselves; select (not multiply) so nothing leaks.
        out = jnp.where(query_valid[:, :, None, None], out, 0.0)
        return out.astype(q.dtype)
