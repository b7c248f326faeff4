"""The float64 oracle on tiny cases whose answers are worked out by hand in the comments.

Most cases use D = 1 and scale = 1, so a score is just q * k, and keys are logs (ln 3, ln 4) so the softmax
weights are small integers over their sum.
"""

import math

import numpy as np
import pytest

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.reference import (
    retained_keys_reference,
    sink_window_attention_reference,
)

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)


def _row(reads=(), **cols) -> np.ndarray:
    """A table row with the named columns set (e.g. STREAM_LEN=4) and `reads` as {index: (start, len)}."""
    row = np.zeros(tbl.ROW_INTS, np.int32)
    for name, value in cols.items():
        row[getattr(tbl, name)] = value
    for i, (start, length) in dict(reads).items():
        row[tbl.read_start(i)], row[tbl.read_len(i)] = start, length
    return row


def _store(entries, *, rows=1, groups=1, dim=1) -> np.ndarray:
    """[1, rows, groups, len(entries), dim] store whose entry t has every component equal to entries[t]."""
    e = np.asarray(entries, np.float32)[None, None, None, :, None]
    return np.broadcast_to(e, (1, rows, groups, len(entries), dim)).copy()


def _step(values, heads=1, dim=1) -> np.ndarray:
    """[N, T, heads, dim] from values[n][t] (one number per token, repeated over heads and dim)."""
    x = np.asarray(values, np.float32)[:, :, None, None]
    return np.broadcast_to(x, (*x.shape[:2], heads, dim)).copy()


# Stream with a one-entry source and sink = window = 1, written = 3, so n = 4 and the retained positions
# are [0, min(1, 4)) ∪ [max(1, 4 - 1), 4) = {0, 3}: position 0 in the source (read 0), position 3 in the
# ring at slot offset 0 (read 3). Keys: pos 0 -> 0, pos 3 -> ln 3; the step's own key (pos 4) -> ln 4.
# Values: 4, 8, 12.
SOURCE_ROW = _row({0: (0, 1), 3: (0, 1)}, STREAM_LEN=4, SINK=1, SINK_KEPT=1, WINDOW_START=3, STEP_TOKENS=1)
SOURCE_K, SOURCE_V = _store([0.0]), _store([4.0])
CACHE_K, CACHE_V = _store([LN3]), _store([8.0])


def _source_case(q, k, v, *, row=SOURCE_ROW, **kwargs) -> np.ndarray:
    return sink_window_attention_reference(
        q, k, v, CACHE_K, CACHE_V, SOURCE_K, SOURCE_V, row[None], scale=1.0, **kwargs
    )


@pytest.mark.parametrize(
    ("query_window", "expected"),
    [
        # Weights e^0 : e^ln3 : e^ln4 = 1 : 3 : 4 (sum 8): (1*4 + 3*8 + 4*12) / 8 = 76 / 8 = 9.5.
        (None, 9.5),
        # The query sits at p = 4 and sees pk <= 4 with pk < sink = 1 or pk > 4 - 1: positions 0 and 4.
        # (1*4 + 4*12) / 5 = 52 / 5 = 10.4.
        (1, 10.4),
        # pk > 4 - 2 admits position 3 again: 9.5.
        (2, 9.5),
    ],
)
def test_one_query_three_keys(query_window, expected):
    out = _source_case(_step([[1.0]]), _step([[LN4]]), _step([[12.0]]), query_window=query_window)
    np.testing.assert_allclose(out, [[[[expected]]]], rtol=1e-6)


def test_default_scale_is_inverse_sqrt_head_dim():
    # D = 4, q = (2, 0, 0, 0), every key component equal to its D = 1 value: q.k / sqrt(4) = k, so the
    # weights and the answer are those of the first case, 9.5, in every component.
    dim = 4
    q = np.zeros((1, 1, 1, dim), np.float32)
    q[..., 0] = 2.0
    stores = [_store(e, dim=dim) for e in ([LN3], [8.0], [0.0], [4.0])]
    out = sink_window_attention_reference(
        q, _step([[LN4]], dim=dim), _step([[12.0]], dim=dim), *stores, SOURCE_ROW[None]
    )
    np.testing.assert_allclose(out, np.full((1, 1, 1, dim), 9.5), rtol=1e-6)


def test_chunk_attends_itself_unless_query_window():
    # Two step tokens at positions 4 and 5: own keys ln 4, ln 2, own values 12, 2; both queries q = 1.
    row = SOURCE_ROW.copy()
    row[tbl.STEP_TOKENS] = 2
    q, k, v = _step([[1.0, 1.0]]), _step([[LN4, LN2]]), _step([[12.0, 2.0]])
    # No window: both queries see all four keys, weights 1 : 3 : 4 : 2 (sum 10):
    # (4 + 24 + 48 + 4) / 10 = 8.
    np.testing.assert_allclose(_source_case(q, k, v, row=row), [[[[8.0]], [[8.0]]]], rtol=1e-6)
    # query_window = 1: token 0 (p = 4) sees positions 0, 4 -> 10.4 (not the later token 5: causal);
    # token 1 (p = 5) sees the sink 0 and itself 5: weights 1 : 2, (4 + 2*2) / 3 = 8 / 3.
    out = _source_case(q, k, v, row=row, query_window=1)
    np.testing.assert_allclose(out, [[[[10.4]], [[8 / 3]]]], rtol=1e-6)


def test_queries_past_step_tokens_and_padding_rows_give_zeros():
    # Row 0 has STEP_TOKENS = 1 of T = 2: its second token (NaN query, key and value) is padding, never
    # attended and answered with zeros. Row 1 is a padding row: every range empty, STEP_TOKENS = 0.
    table = np.stack([SOURCE_ROW, np.zeros(tbl.ROW_INTS, np.int32)])
    nan = math.nan
    q, k, v = _step([[1.0, nan], [nan, nan]]), _step([[LN4, nan], [nan, nan]]), _step([[12.0, nan]] * 2)
    out = sink_window_attention_reference(q, k, v, CACHE_K, CACHE_V, SOURCE_K, SOURCE_V, table, scale=1.0)
    np.testing.assert_array_equal(np.isfinite(out), True)
    np.testing.assert_allclose(out[:, :, 0, 0], [[9.5, 0.0], [0.0, 0.0]], rtol=1e-6)


def test_grouped_query_heads_share_their_kv_head():
    # H = 4 query heads over G = 2 KV heads: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1, whose
    # values are doubled. q = +1 gives 9.5 (first case). q = -1 gives scores 0, -ln 3, -ln 4: weights
    # 1 : 1/3 : 1/4 (sum 19/12), (4 + 8/3 + 12/4) / (19/12) = (29/3) * (12/19) = 116/19.
    kv_k = [_store(e, groups=2) for e in ([LN3], [0.0])]
    kv_v = [_store(e, groups=2) * np.array([1, 2], np.float32)[:, None, None] for e in ([8.0], [4.0])]
    q = np.array([1.0, -1.0, 1.0, -1.0], np.float32).reshape(1, 1, 4, 1)
    k = np.full((1, 1, 2, 1), LN4, np.float32)
    v = np.array([12.0, 24.0], np.float32).reshape(1, 1, 2, 1)
    out = sink_window_attention_reference(
        q, k, v, kv_k[0], kv_v[0], kv_k[1], kv_v[1], SOURCE_ROW[None], scale=1.0
    )
    np.testing.assert_allclose(out.ravel(), [9.5, 116 / 19, 19.0, 232 / 19], rtol=1e-6)


def test_rows_of_a_request_read_their_own_cache_and_source_rows():
    # R = 2 (e.g. classifier-free guidance): one table row, attention rows 0 and 1. Row 1's cache, source
    # and step values are 100 more than row 0's; keys are equal, so the weights stay 1 : 3 : 4 and
    # row 1 gives 9.5 + 100.
    shift = np.array([0.0, 100.0], np.float32)[None, :, None, None, None]
    cache_k, source_k = _store([LN3], rows=2), _store([0.0], rows=2)
    cache_v, source_v = _store([8.0], rows=2) + shift, _store([4.0], rows=2) + shift
    q, k, v = _step([[1.0], [1.0]]), _step([[LN4], [LN4]]), _step([[12.0], [112.0]])
    out = sink_window_attention_reference(
        q, k, v, cache_k, cache_v, source_k, source_v, SOURCE_ROW[None], scale=1.0
    )
    np.testing.assert_allclose(out.ravel(), [9.5, 109.5], rtol=1e-6)


# No source, sink = 1, window = 2, slot = [1 sink entry | 2 ring entries], written = 4 (n = 4): retained
# {0} ∪ [max(1, 4 - 2), 4) = {0, 2, 3}. Position 0 sits at slot offset 0 (read 1); ring position i >= 1
# sits at offset 1 + (i - 1) mod 2, so position 2 at offset 2 (read 3, up to the ring's end) and position 3
# wrapped to offset 1 (read 4). Slot offsets 0, 1, 2 hold positions 0, 3, 2.
WRAP_ROW = _row(
    {1: (0, 1), 3: (2, 1), 4: (1, 1)}, STREAM_LEN=4, SINK=1, SINK_KEPT=1, WINDOW_START=2, STEP_TOKENS=1
)


def test_retained_keys_come_in_stream_order_after_a_wrap():
    cache = np.arange(3, dtype=np.float32).reshape(1, 1, 1, 3, 1)  # entry value = slot offset
    entries, positions = retained_keys_reference(WRAP_ROW, cache, np.zeros((1, 1, 1, 1, 1)), 0)
    np.testing.assert_array_equal(positions, [0, 2, 3])
    np.testing.assert_array_equal(entries.ravel(), [0, 2, 1])  # offsets of positions 0, 2, 3


@pytest.mark.parametrize(
    ("query_window", "expected"),
    [
        # Keys by position: 0 -> 0, 2 -> ln 2, 3 -> ln 3, own 4 -> ln 4; values 4, 100, 8, 12.
        # All visible: weights 1 : 2 : 3 : 4 (sum 10): (4 + 200 + 24 + 48) / 10 = 27.6.
        (None, 27.6),
        (3, 27.6),  # pk > 4 - 3 = 1: all of 0 (sink), 2, 3, 4
        (2, 9.5),  # pk > 2 drops position 2 (offset 2), keeps the wrapped position 3: 76 / 8
        (1, 10.4),  # only the sink and the query's own key: 52 / 5
    ],
)
def test_query_window_uses_stream_positions_after_a_wrap(query_window, expected):
    cache_k = np.array([0.0, LN3, LN2], np.float32).reshape(1, 1, 1, 3, 1)
    cache_v = np.array([4.0, 8.0, 100.0], np.float32).reshape(1, 1, 1, 3, 1)
    empty = np.full((1, 1, 1, 1, 1), np.nan, np.float32)  # the source is never read: NaN proves it
    out = sink_window_attention_reference(
        _step([[1.0]]), _step([[LN4]]), _step([[12.0]]), cache_k, cache_v, empty, empty, WRAP_ROW[None],
        query_window=query_window, scale=1.0,
    )  # fmt: skip
    np.testing.assert_allclose(out, [[[[expected]]]], rtol=1e-6)


def test_first_step_attends_only_itself():
    # n = 0: nothing retained, one step token: its single key has weight 1, output = its value.
    row = _row(STEP_TOKENS=1, SINK=4)
    nan = np.full((1, 1, 1, 2, 1), np.nan, np.float32)
    out = sink_window_attention_reference(
        _step([[3.0]]), _step([[5.0]]), _step([[-7.0]]), nan, nan, nan, nan, row[None], query_window=1
    )
    np.testing.assert_allclose(out, [[[[-7.0]]]])
