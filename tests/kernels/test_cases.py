"""The shared kernel cases are sound: finite oracle outputs, strict poisoning, and each exercises its name."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import reference
from kernels_pallas.sink_window_attention import table as tbl
from tests.kernels.cases import KernelCase, make_case, standard_cases

CASES = {dtype: standard_cases(dtype) for dtype in (np.float32, jnp.bfloat16)}
SLOT_READS = [i for i, from_source in enumerate(tbl.READ_FROM_SOURCE) if not from_source]


def _col(case: KernelCase, column: int) -> np.ndarray:
    return case.table[:, column]


def _reads(case: KernelCase, i: int) -> np.ndarray:
    return case.table[:, tbl.read_len(i)]


def _real(case: KernelCase) -> np.ndarray:
    """Table rows of real requests (padding rows name the last slot)."""
    return case.table[case.table[:, tbl.SLOT] < case.cache_k.shape[0] - 1]


def _writes(row: np.ndarray) -> int:
    return sum(int(row[tbl.write_cols(i)[2]]) for i in range(tbl.NUM_WRITES))


def _window(case: KernelCase) -> int:
    return case.max_retained - int(_real(case)[0, tbl.SINK])


def _padding_rows_empty(case: KernelCase) -> bool:
    padding = case.table[case.table[:, tbl.SLOT] == case.cache_k.shape[0] - 1]
    return len(padding) > 0 and not padding[:, tbl.STREAM_LEN :].any()


# What each case's name promises, read off its arrays.
EXERCISES = {
    "decode": lambda c: c.q.shape[1] == 1,
    "chunk": lambda c: c.q.shape[1] > 1 and (_col(c, tbl.STEP_TOKENS) == c.q.shape[1]).all(),
    "many_wraps": lambda c: (_reads(c, 4) > 0).any() and _col(c, tbl.STREAM_LEN).max() > 10 * _window(c),
    "sink_over_source": lambda c: (_reads(c, 1) > 0).sum() >= 2,
    "sink0": lambda c: not _col(c, tbl.SINK).any() and (_reads(c, 3) > 0).all(),
    "window0": lambda c: (
        _window(c) == 0 and (_col(c, tbl.STREAM_LEN) > _col(c, tbl.SINK)).any() and not _reads(c, 3).any()
    ),
    "window3": lambda c: _window(c) == 3 and (_reads(c, 4) > 0).any(),
    "idle_slots": lambda c: c.cache_k.shape[0] - 1 - len(set(_col(c, tbl.SLOT))) >= 2,
    "mixed": lambda c: (
        len(set(_col(c, tbl.STREAM_LEN))) == len(c.table)
        and len(set(_col(c, tbl.SOURCE))) >= 3
        and any(_writes(row) == 0 and row[tbl.STEP_TOKENS] > 0 for row in c.table)
    ),
    "two_rows_per_request": lambda c: c.rows_per_request == 2 and c.q.shape[0] == 2 * len(c.table),
    "query_window_chunk": lambda c: c.query_window is not None and c.q.shape[1] > c.query_window,
    "query_window_decode": lambda c: c.query_window is not None and c.q.shape[1] == 1,
    # A full stream reads fewer than `window` newest entries: the window counts the step.
    "window_includes_step": lambda c: (
        (_col(c, tbl.STREAM_LEN) - _col(c, tbl.WINDOW_START) < _window(c)).any()
        and (_col(c, tbl.STREAM_LEN) - _window(c) > _col(c, tbl.SINK)).all()
    ),
    "padding_rows": lambda c: _padding_rows_empty(c) and len(_real(c)) < len(c.table),
    "empty_retained": lambda c: any(
        row[tbl.STREAM_LEN] == 0 and not row[tbl.READS : tbl.WRITES].any() for row in c.table
    ),
    "gqa_kv1": lambda c: c.k.shape[2] == 1 and c.q.shape[2] == 4,
    "bucket_padded_tokens": lambda c: (_col(c, tbl.STEP_TOKENS) < c.q.shape[1]).any(),
    "head_dim64": lambda c: c.q.shape[-1] == 64,
    "boundaries": lambda c: sorted(_col(c, tbl.STREAM_LEN) - _col(c, tbl.SINK)) == [-1, 0, 8, 9],
    # Reversed writes start from the step's last token: the first range's step offset is span - 1.
    "reverse": lambda c: c.reverse and any(row[tbl.write_cols(1)[0]] > 0 for row in c.table),
    "padded_slot": lambda c: c.cache_k.shape[3] > c.max_retained,
}


def test_every_standard_case_is_checked():
    assert [case.name for case in CASES[np.float32]] == list(EXERCISES)


@pytest.mark.parametrize("case", CASES[np.float32], ids=lambda case: case.name)
def test_case_exercises_its_name(case):
    assert EXERCISES[case.name](case)


@pytest.mark.parametrize("dtype", list(CASES), ids=["f32", "bf16"])
def test_cases_are_tiny_and_typed(dtype):
    for case in CASES[dtype]:
        assert case.q.dtype == case.cache_k.dtype == case.source_v.dtype == np.dtype(dtype)
        assert case.table.dtype == np.int32
        assert case.table.shape[1] == tbl.ROW_INTS
        assert len(case.table) <= 4
        assert case.q.shape[1] <= 8
        assert case.cache_k.shape[3] <= 64
        assert case.q.shape[0] == len(case.table) * case.rows_per_request
        assert case.q.shape[2] % case.k.shape[2] == 0


@pytest.mark.parametrize("dtype", list(CASES), ids=["f32", "bf16"])
def test_reference_output_is_finite(dtype):
    for case in CASES[dtype]:
        out = case.reference_output()
        assert out.shape == case.q.shape
        assert np.isfinite(out).all(), case.name
        # Queries past a row's real tokens (and padding rows) attend nothing: zeros.
        tokens = np.repeat(_col(case, tbl.STEP_TOKENS), case.rows_per_request)
        assert not out[np.arange(case.q.shape[1]) >= tokens[:, None]].any(), case.name


@pytest.mark.parametrize("case", CASES[np.float32], ids=lambda case: case.name)
def test_only_what_the_table_reads_is_finite(case):
    for c in range(case.rows_per_request):
        for row in case.table:
            keys, _ = reference.retained_keys_reference(row, case.cache_k, case.source_k, c)
            values, _ = reference.retained_keys_reference(row, case.cache_v, case.source_v, c)
            assert np.isfinite(keys).all()
            assert np.isfinite(values).all()
    # Slot ranges of different rows never overlap (distinct slots), so this counts every finite token.
    finite_tokens = np.isfinite(case.cache_k[:, 0, 0, :, 0]).sum()
    assert finite_tokens == sum(_reads(case, i).sum() for i in SLOT_READS)
    assert not np.isfinite(case.cache_k[-1]).any(), "the padding slot is poison"
    tokens = np.repeat(_col(case, tbl.STEP_TOKENS), case.rows_per_request)
    live = np.arange(case.q.shape[1]) < tokens[:, None]
    for step in case.k, case.v:
        assert np.isfinite(step[live]).all()
        assert np.isnan(step[~live]).all()
    assert np.isfinite(case.q).all()


def test_make_case_refuses_impossible_settings():
    with pytest.raises(ValueError, match="query_window"):
        make_case("x", seed=0, batch=1, reverse=True, query_window=2)
    with pytest.raises(ValueError, match="slots"):
        make_case("x", seed=0, batch=7, slots=6)
    with pytest.raises(ValueError, match="kv_heads"):
        make_case("x", seed=0, batch=1, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="step_tokens"):
        make_case("x", seed=0, batch=1, steps=4, step_tokens=[5])


def test_make_case_is_deterministic():
    a, b = (make_case("x", seed=3, batch=3, padding_rows=1) for _ in range(2))
    for name in ("q", "k", "cache_k", "source_v", "table"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
