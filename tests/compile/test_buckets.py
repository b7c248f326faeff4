"""Bucket sets: the tightest bucket against a brute-force search over every batch, defaults from the
deployment's compile settings, caps, combined walks, splitting, and the errors' messages."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from mstar_jax.compile import (
    BatchChunk,
    BatchTooLargeError,
    Buckets,
    BucketSet,
    CombinedRows,
    NoBucketError,
    cap_batch_sizes,
)
from mstar_jax.deployment import CompileSettings
from mstar_jax.resources.spec import CombinedSplit
from mstar_jax.resources.step import BucketKey

SPLIT = CombinedSplit("mixed", ("prefill_a", "prefill_b"))

PLAIN_SETS = [
    BucketSet(graph_walk="decode", batch_sizes=(1, 2, 4, 8), token_counts=(1,)),
    BucketSet(graph_walk="prefill", batch_sizes=(1, 2, 4), token_counts=(16, 32, 64)),
    BucketSet(graph_walk="odd", batch_sizes=(3, 5, 6), token_counts=(2, 7)),
]
# Uncapped; one row per walk; one walk of 3 rows; no room for prefill rows at all.
COMBINED_CAPS = [
    {},
    {"prefill_a": 1, "prefill_b": 1},
    {"prefill_a": 0, "prefill_b": 3},
    {"prefill_a": 0, "prefill_b": 0},
]
COMBINED_SETS = [
    BucketSet.combined(SPLIT, batch_sizes=(1, 2, 4, 8), token_counts=(4, 8), max_rows_in_combined=caps)
    for caps in COMBINED_CAPS
]


def brute_force(buckets: BucketSet, bs: int, tokens: int, prefill: int = 0) -> BucketKey | None:
    """The least (tokens, rows) bucket that holds the batch, by checking every bucket."""
    fits = [
        key
        for key in buckets
        if key.bs >= bs
        and key.num_tokens >= tokens
        and (key.cg_key_info.prefill_rows if key.cg_key_info else 0) >= prefill
    ]
    return min(fits, key=lambda key: (key.num_tokens, key.bs), default=None)


@pytest.mark.parametrize("buckets", PLAIN_SETS, ids=lambda b: b.graph_walk)
def test_tightest_bucket_matches_brute_force(buckets):
    for bs, tokens in itertools.product(range(1, buckets.max_batch + 3), range(1, buckets.max_tokens + 3)):
        want = brute_force(buckets, bs, tokens)
        if want is None:
            with pytest.raises(NoBucketError):
                buckets.bucket_for(bs, tokens)
        else:
            assert buckets.bucket_for(bs, tokens) == want, (bs, tokens)


@pytest.mark.parametrize("buckets", COMBINED_SETS, ids=lambda b: str(b.prefill_rows))
def test_tightest_combined_bucket_matches_brute_force(buckets):
    for bs, tokens in itertools.product(range(1, 10), range(1, 10)):
        for prefill in range(bs + 1):
            want = brute_force(buckets, bs, tokens, prefill)
            if want is None:
                with pytest.raises(NoBucketError):
                    buckets.bucket_for(bs, tokens, prefill_rows=prefill)
            else:
                assert buckets.bucket_for(bs, tokens, prefill_rows=prefill) == want, (bs, tokens, prefill)


def test_a_remembered_answer_is_the_brute_force_one_and_bad_arguments_are_still_refused():
    """`bucket_for` remembers its answers to plain ints: asked again it gives the brute-force bucket, and
    an argument of another type equal to a remembered one (True == 1, 1.0 == 1) is still checked."""
    buckets = BucketSet(graph_walk="w", batch_sizes=(1, 2, 4), token_counts=(1, 8))
    for _ in range(2):
        for bs, tokens in itertools.product(range(1, 5), range(1, 9)):
            assert buckets.bucket_for(bs, tokens) == brute_force(buckets, bs, tokens)
    assert buckets.bucket_for(np.int64(3), np.int32(2)) == brute_force(buckets, 3, 2)
    with pytest.raises(ValueError, match="bs=True must be an int"):
        buckets.bucket_for(True, 1)
    with pytest.raises(ValueError, match=r"num_tokens=1\.0 must be an int"):
        buckets.bucket_for(1, 1.0)
    with pytest.raises(BatchTooLargeError):
        buckets.bucket_for(5, 1)
    assert buckets == BucketSet(graph_walk="w", batch_sizes=(1, 2, 4), token_counts=(1, 8))


def test_combined_keys_name_their_decode_and_prefill_rows():
    uncapped, capped, one_walk, no_room = COMBINED_SETS
    assert uncapped.prefill_rows == (1, 2, 4, 8)
    assert capped.prefill_rows == (1, 2, 2, 2)
    assert one_walk.prefill_rows == (1, 2, 3, 3)
    assert no_room.prefill_rows == (0, 0, 0, 0)
    for buckets, caps in zip(COMBINED_SETS, COMBINED_CAPS, strict=True):
        assert buckets.is_combined
        for key in buckets:
            assert key.cg_key_info == CombinedRows(key.bs, SPLIT.max_prefill_rows(caps, key.bs))
    assert str(capped.key(4, 8)) == "mixed[bs=4,tokens=8,key=CombinedRows(decode_rows=4, prefill_rows=2)]"


def test_keys_are_sorted_least_tokens_then_least_rows():
    buckets = PLAIN_SETS[1]
    keys = buckets.keys()
    assert len(keys) == len(buckets) == 9
    assert list(keys) == sorted(keys, key=lambda k: (k.num_tokens, k.bs))
    assert keys[0] == BucketKey("prefill", 1, 16)
    assert (buckets.max_batch, buckets.max_tokens) == (4, 64)


def test_defaults_from_compile_settings():
    # The deployment's defaults: batch 1, 2, 4 up to max_batch; tokens 1 up to 16 doubling.
    buckets = Buckets.from_settings(
        CompileSettings(), max_batch=4, decode_walks=("decode",), prefill_walks=("prefill",),
        combined=(SPLIT,), max_rows_in_combined={"prefill_a": 1, "prefill_b": 0},
    )  # fmt: skip
    assert buckets.walks == ("decode", "prefill", "mixed")
    assert buckets["decode"] == BucketSet(graph_walk="decode", batch_sizes=(1, 2, 4), token_counts=(1,))
    assert buckets["prefill"].token_counts == (1, 2, 4, 8, 16)
    assert buckets["mixed"].prefill_rows == (1, 1, 1)
    assert len(buckets) == 3 + 15 + 15
    assert buckets.keys()[:3] == tuple(BucketKey("decode", bs, 1) for bs in (1, 2, 4))
    assert buckets.max_tokens("prefill") == 16
    assert buckets.max_batch("decode") == 4
    assert "mixed" in buckets
    assert "other" not in buckets

    settings = CompileSettings(min_batch=2, min_tokens=16, max_tokens=100)
    derived = Buckets.from_settings(settings, max_batch=24, prefill_walks=("p",))
    assert derived["p"].batch_sizes == (2, 4, 8, 16, 24)
    assert derived["p"].token_counts == (16, 32, 64, 100)


def test_batch_sizes_are_capped_at_the_largest_batch_that_can_form():
    assert cap_batch_sizes((1, 3, 8, 16), 4) == (1, 3, 4)
    assert cap_batch_sizes((1, 2, 4), 4) == (1, 2, 4)
    assert cap_batch_sizes((1, 2), 4) == (1, 2, 4)
    settings = CompileSettings(batch_sizes=(1, 8, 32), token_counts=(1, 8))
    assert Buckets.from_settings(settings, max_batch=6, decode_walks=("d",))["d"].batch_sizes == (1, 6)


def test_a_batch_larger_than_any_bucket_names_the_split():
    buckets = Buckets((PLAIN_SETS[0],))
    with pytest.raises(BatchTooLargeError, match=re.escape("split it with split_batch('decode', 11)")) as err:
        buckets.bucket_for("decode", 11, 1)
    assert isinstance(err.value, ValueError)
    assert (err.value.graph_walk, err.value.bs, err.value.largest) == ("decode", 11, 8)
    assert "exceeds the largest 'decode' bucket (8 rows)" in str(err.value)


def test_other_refusals_say_why():
    buckets = Buckets((PLAIN_SETS[1], COMBINED_SETS[3]))
    assert not buckets["prefill"].is_combined
    with pytest.raises(
        NoBucketError, match=r"65 tokens exceeds .* \(64 tokens per row\); admission must refuse"
    ):
        buckets.bucket_for("prefill", 1, 65)
    with pytest.raises(
        NoBucketError, match=r"no buckets for graph walk 'decode'; compiled walks: \['prefill'"
    ):
        buckets.bucket_for("decode", 1, 1)
    with pytest.raises(NoBucketError, match="not a combined walk"):
        buckets.bucket_for("prefill", 2, 16, prefill_rows=1)
    with pytest.raises(NoBucketError, match="makes room for no prefill rows"):
        buckets.bucket_for("mixed", 2, 4, prefill_rows=1)
    with pytest.raises(ValueError, match="prefill_rows=3 must be <= bs=2"):
        buckets.bucket_for("prefill", 2, 16, prefill_rows=3)
    with pytest.raises(
        BatchTooLargeError, match=r"3 prefill rows exceed the room of the largest 'mixed' bucket \(2\)"
    ):
        Buckets((COMBINED_SETS[1],)).bucket_for("mixed", 4, 4, prefill_rows=3)
    with pytest.raises(ValueError, match="bs=0 must be an int >= 1"):
        buckets.bucket_for("prefill", 0, 1)


def test_split_batch_chunks_fit_and_only_the_last_pads():
    for buckets in PLAIN_SETS:
        for bs in range(3 * buckets.max_batch + 2):
            chunks = buckets.split_batch(bs)
            assert sum(c.rows for c in chunks) == bs
            assert all(c.prefill_rows == 0 for c in chunks)
            assert all(c.rows == buckets.max_batch for c in chunks[:-1])
            for chunk in chunks:
                buckets.bucket_for(chunk.rows, 1)
    assert PLAIN_SETS[0].split_batch(19) == (BatchChunk(8), BatchChunk(8), BatchChunk(3))


def test_split_combined_batch_spreads_prefill_rows_over_chunks():
    for buckets in COMBINED_SETS[:3]:
        for bs in range(1, 20):
            for prefill in range(bs + 1):
                chunks = buckets.split_batch(bs, prefill_rows=prefill)
                assert sum(c.rows for c in chunks) == bs
                assert sum(c.prefill_rows for c in chunks) == prefill
                for chunk in chunks:
                    buckets.bucket_for(chunk.rows, 4, prefill_rows=chunk.prefill_rows)
    assert COMBINED_SETS[1].split_batch(10, prefill_rows=5) == (
        BatchChunk(7, 2), BatchChunk(2, 2), BatchChunk(1, 1)
    )  # fmt: skip
    with pytest.raises(NoBucketError, match="makes room for no prefill rows"):
        COMBINED_SETS[3].split_batch(3, prefill_rows=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"graph_walk": "", "batch_sizes": (1,), "token_counts": (1,)},
            "graph_walk='' must be a non-empty str",
        ),
        (
            {"graph_walk": "w", "batch_sizes": (), "token_counts": (1,)},
            r"batch_sizes=\(\) must hold at least one",
        ),
        ({"graph_walk": "w", "batch_sizes": (2, 2), "token_counts": (1,)}, "must be strictly increasing"),
        (
            {"graph_walk": "w", "batch_sizes": (1,), "token_counts": (0,)},
            r"token_counts\[0\]=0 must be an int >= 1",
        ),
        (
            {"graph_walk": "w", "batch_sizes": (True,), "token_counts": (1,)},
            r"batch_sizes\[0\]=True must be an int",
        ),
        (
            {"graph_walk": "w", "batch_sizes": (1, 2), "token_counts": (1,), "prefill_rows": (1,)},
            "one count per",
        ),
        (
            {"graph_walk": "w", "batch_sizes": (1, 2), "token_counts": (1,), "prefill_rows": (2, 2)},
            "<= its batch",
        ),
        (
            {"graph_walk": "w", "batch_sizes": (1, 2), "token_counts": (1,), "prefill_rows": (1, 0)},
            "not decrease",
        ),
    ],
)
def test_invalid_bucket_sets_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketSet(**kwargs)


def test_a_walk_is_given_one_bucket_set():
    with pytest.raises(ValueError, match=r"name a walk twice"):
        Buckets((PLAIN_SETS[0], PLAIN_SETS[0]))
    with pytest.raises(TypeError, match="must be a BucketSet"):
        Buckets(("decode",))
    with pytest.raises(ValueError, match=r"\(bs=3, num_tokens=1\) is not a bucket of 'decode'"):
        PLAIN_SETS[0].key(3, 1)
