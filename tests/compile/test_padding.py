"""Padding to a bucket and back: row and token axes, rows per request, fills, the combined groups,
and the errors that name the argument."""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.compile import BucketSet, CombinedRows, PadAxes, bucket_sizes, measure, pad, unpad
from mstar_jax.resources.spec import CombinedSplit
from mstar_jax.resources.step import BucketKey


def test_pad_then_unpad_round_trips_and_fills_only_the_padding():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 9, (3, 2)).astype(np.int32)  # [B=3, T=2]
    q = rng.standard_normal((6, 2, 4)).astype(np.float32)  # [N = B * R, T, H], R = 2
    lengths = np.array([2, 1, 2], np.int32)
    state = object()  # not an array: under None it passes through untouched
    args = (state, tokens, q, lengths)
    axes = (
        None,
        PadAxes(rows=0, tokens=1, fill=-1),
        PadAxes(rows=0, tokens=1, rows_per_request=2, fill=np.nan),
        PadAxes(rows=0),
    )
    sizes = measure(args, axes)
    assert sizes == {"rows": 3, "tokens": 2}

    padded = pad(args, axes, {"rows": 4, "tokens": 5})
    assert padded[0] is state
    assert padded[1].shape == (4, 5)
    assert padded[2].shape == (8, 5, 4)
    assert padded[3].shape == (4,)
    np.testing.assert_array_equal(padded[1][:3, :2], tokens)
    assert (padded[1][3] == -1).all()
    assert (padded[1][:, 2:] == -1).all()
    assert np.isnan(padded[2][6:]).all()
    assert np.isnan(padded[2][:, 2:]).all()
    assert padded[3][3] == 0
    assert padded[1].dtype == np.int32
    assert padded[2].dtype == np.float32

    back = unpad(padded, axes, sizes)
    assert back[0] is state
    for got, want in zip(back[1:], args[1:], strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_array_fill_broadcasts_one_padding_row():
    table = np.arange(6, dtype=np.int32).reshape(2, 3)
    row = np.array([7, 8, 9], np.int32)
    out = pad(table, PadAxes(rows=0, fill=row), {"rows": 4})
    np.testing.assert_array_equal(out, [[0, 1, 2], [3, 4, 5], [7, 8, 9], [7, 8, 9]])


def test_an_exact_fit_is_returned_unchanged():
    x = np.ones((2, 3), np.float32)
    assert pad(x, PadAxes(rows=0, tokens=1), {"rows": 2, "tokens": 3}) is x


def test_combined_groups_pad_to_their_own_rows():
    bucket = BucketSet.combined(
        CombinedSplit("mixed", ("prefill",)), batch_sizes=(4,), token_counts=(8,),
        max_rows_in_combined={"prefill": 2},
    ).key(4, 8)  # fmt: skip
    assert bucket.cg_key_info == CombinedRows(decode_rows=4, prefill_rows=2)
    sizes = bucket_sizes(bucket)
    assert sizes == {"rows": 4, "tokens": 8, "decode": 4, "prefill": 2}
    batch = {"decode": np.zeros((3, 1), np.int32), "prefill": np.zeros((1, 5), np.int32)}
    axes = {"decode": PadAxes(rows=0, group="decode"), "prefill": PadAxes(rows=0, tokens=1, group="prefill")}
    padded = pad(batch, axes, sizes)
    assert padded["decode"].shape == (4, 1)
    assert padded["prefill"].shape == (2, 8)
    assert measure(batch, axes) == {"decode": 3, "prefill": 1, "tokens": 5}


def test_errors_name_the_argument_and_the_fix():
    x = np.ones((5, 2), np.float32)
    with pytest.raises(ValueError, match=r"\[1\]: axis 0 holds 5 entries but the bucket holds 4.*bucket_for"):
        pad((None, x), (None, PadAxes(rows=0)), {"rows": 4})
    with pytest.raises(ValueError, match=r"fill=nan cannot be stored as int32"):
        pad(np.ones((1, 2), np.int32), PadAxes(rows=0, fill=np.nan), {"rows": 2})
    with pytest.raises(ValueError, match=r"\['b'\] has 3 rows but \['a'\] has 2"):
        measure({"a": np.ones(2), "b": np.ones(3)}, PadAxes(rows=0))
    with pytest.raises(ValueError, match=r"size 3 is not a multiple of r=2"):
        measure(np.ones(3), PadAxes(rows=0, rows_per_request=2))
    with pytest.raises(ValueError, match=r"pads its 'decode' axis.*only for a combined walk"):
        pad(np.ones(2), PadAxes(rows=0, group="decode"), bucket_sizes(BucketKey("w", 4, 1)))
    with pytest.raises(ValueError, match="group='other' must be one of"):
        PadAxes(group="other")
    with pytest.raises(ValueError, match="rows_per_request=0 must be an int >= 1"):
        PadAxes(rows_per_request=0)
    with pytest.raises(ValueError, match="rows=1 and tokens=1 must be different axes"):
        PadAxes(rows=1, tokens=1)
