"""Readable float64 oracle for sink+window attention: a per-row NumPy loop over the plan table.

Not jittable and not fast: it exists to be obviously right. Every implementation is tested against it.
"""

import numpy as np

from kernels_pallas.sink_window_attention import table as tbl


def retained_keys_reference(
    row: np.ndarray, cache: np.ndarray, source: np.ndarray, c: int
) -> tuple[np.ndarray, np.ndarray]:
    """The retained keys (or values) of one attention row, in stream order, with their positions.

    Args:
      row: i32[ROW_INTS], the request's table row.
      cache: [S, R, G, C, D], one layer's slots (keys or values).
      source: [V, R, G, L, D], one layer's sources (keys or values).
      c: the row within the request (0 <= c < R).

    Returns:
      (entries [G, K_row, D], positions i64[K_row]).
    """
    parts = []
    for i, from_source in enumerate(tbl.READ_FROM_SOURCE):
        start, length = int(row[tbl.read_start(i)]), int(row[tbl.read_len(i)])
        store = source[row[tbl.SOURCE], c] if from_source else cache[row[tbl.SLOT], c]
        parts.append(np.asarray(store[:, start : start + length], np.float64))
    entries = np.concatenate(parts, axis=1)
    kept = int(row[tbl.SINK_KEPT])
    j = np.arange(entries.shape[1])
    return entries, tbl.retained_position(j, kept, row[tbl.WINDOW_START], xp=np)


def sink_window_attention_reference(
    q,
    k,
    v,
    cache_k,
    cache_v,
    source_k,
    source_v,
    table,
    *,
    query_window=None,
    scale=None,
    rel_bias=None,
    sink_logits=None,
) -> np.ndarray:
    """Attention of each step token over `stream[R] ++ step tokens`, in float64.

    Args:
      q: [N, T, H, D] queries, N = B * R.
      k, v: [N, T, G, D] the step's own keys and values.
      cache_k, cache_v: [S, R, G, C, D] one layer's slots.
      source_k, source_v: [V, R, G, L, D] one layer's sources.
      table: i32[B, ROW_INTS] plan table.
      query_window: None (every query sees every key) or q >= 1 (causal band, sinks always visible).
      scale: score scale; defaults to 1 / sqrt(D).
      rel_bias: None or [N, H, T, RB], added to `q . k` before scaling at column
        `(retained + i) - j + T - 1` for query token i and key j of `retained ++ step keys` (see `table`).
      sink_logits: None or [H], one more logit per query head in the softmax denominator.

    Returns:
      f64[N, T, H, D]; queries past a row's STEP_TOKENS and rows with no visible key give zeros.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cache_k, cache_v, source_k, source_v = (np.asarray(x) for x in (cache_k, cache_v, source_k, source_v))
    table = np.asarray(table)
    rel_bias, sink_logits = (
        None if x is None else np.asarray(x, np.float64) for x in (rel_bias, sink_logits)
    )
    n_rows, steps, heads, dim = q.shape
    rows_per_request = n_rows // table.shape[0]
    groups = heads // k.shape[2]
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    out = np.zeros_like(q)
    for n in range(n_rows):
        row = table[n // rows_per_request]
        c = n % rows_per_request
        own = int(row[tbl.STEP_TOKENS])
        keys, key_pos = retained_keys_reference(row, cache_k, source_k, c)
        values, _ = retained_keys_reference(row, cache_v, source_v, c)
        keys = np.concatenate([keys, k[n, :own].transpose(1, 0, 2)], axis=1)  # [G, K_row + own, D]
        values = np.concatenate([values, v[n, :own].transpose(1, 0, 2)], axis=1)
        retained = len(key_pos)
        key_pos = np.concatenate([key_pos, row[tbl.STREAM_LEN] + np.arange(own)])
        key_index = np.arange(len(key_pos))  # j in retained ++ step keys
        for i in range(own):
            visible = np.ones(len(key_pos), bool)
            if query_window is not None:
                p = row[tbl.STREAM_LEN] + i
                visible = tbl.query_window_visible(key_pos, p, row[tbl.SINK], query_window)
            if not visible.any():
                continue
            columns = tbl.rel_bias_column(key_index[visible], i, retained, steps)
            for h in range(heads):
                g = h // groups
                s = keys[g][visible] @ q[n, i, h]
                if rel_bias is not None:
                    s = s + rel_bias[n, h, i, columns]
                s = s * scale
                logits = s if sink_logits is None else np.append(s, sink_logits[h])
                p_ = np.exp(logits - logits.max())
                out[n, i, h] = (p_[: len(s)] / p_.sum()) @ values[g][visible]
    return out
