"""benchmarks/timing.py: every case once per repeat in a fresh order, ratios per repeat, median and spread."""

import argparse
import re

import pytest

from benchmarks import timing


def test_every_case_runs_once_per_repeat_in_shuffled_orders():
    calls: list[str] = []
    cases = {name: (lambda n=name: calls.append(n)) for name in "abcd"}
    samples = timing.interleaved_times(cases, repeats=12, warmup=2, number=3)
    assert list(samples) == list("abcd")
    assert all(len(s) == 12 and min(s) >= 0 for s in samples.values())
    warm, timed = calls[:8], calls[8:]
    assert warm == [n for n in "abcd" for _ in range(2)]
    repeats = [timed[i : i + 12] for i in range(0, len(timed), 12)]  # 4 cases x 3 calls a repeat
    assert all(sorted(r) == sorted("abcd" * 3) for r in repeats)
    orders = {tuple(r[::3]) for r in repeats}
    assert len(orders) > 1  # not one fixed order
    firsts = {r[0] for r in repeats}
    assert len(firsts) > 1


def test_the_shuffle_is_seeded_and_rotation_is_available():
    def order(**kwargs):
        calls: list[int] = []
        timing.interleaved_times([lambda i=i: calls.append(i) for i in range(3)], 6, warmup=0, **kwargs)
        return calls

    assert order(seed=1) == order(seed=1)
    assert order(order="rotate") == [0, 1, 2, 1, 2, 0, 2, 0, 1] * 2


def test_self_timed_cases_report_their_own_seconds():
    samples = timing.interleaved_times([lambda: 0.25, lambda: 2.0], 3, self_timed=True)
    assert samples == [[0.25] * 3, [2.0] * 3]


def test_ratios_pair_repeats_and_spread_formats_median_and_range():
    assert timing.ratios([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == [2.0, 3.0, 4.0]
    assert timing.ratios([2.0, 4.0], [1.0, 1.0], inverse=True) == [0.5, 0.25]
    with pytest.raises(ValueError, match="time them together"):
        timing.ratios([1.0], [1.0, 2.0])
    assert timing.describe([2.0, 3.0, 4.0]) == "3.00 (2.00–4.00, 3 repeats)"
    assert timing.describe([2.0, 3.0, 4.0], ".1f", repeats=False, unit="x") == "3.0x (2.0–4.0)"
    assert timing.describe([1.0, 2.0, 3.0, 4.0, 5.0], ".1f", iqr=True) == "3.0 (IQR 2.0–4.0, 5 repeats)"
    spread = timing.Spread.of([0.001, 0.003, 0.002], scale=1e3)
    assert (spread.median, spread.low, spread.high, spread.repeats) == (2.0, 1.0, 3.0, 3)
    assert timing.describe([7.0]) == "7.00 (7.00–7.00, 1 repeat)"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="repeats=0"):
        timing.interleaved_times([lambda: None], 0)
    with pytest.raises(ValueError, match="order="):
        timing.interleaved_times([lambda: None], 1, order="fixed")
    with pytest.raises(ValueError, match="no samples"):
        timing.Spread.of([])


def test_quick_label():
    assert timing.quick_label(False, "x") == ""
    assert "--quick: 2 repeats" in timing.quick_label(True, "2 repeats")


def test_positive_int_takes_counts_and_names_what_it_refuses():
    assert timing.positive_int("1") == 1
    assert timing.positive_int("32") == 32
    refused = [
        ("0", "0 must be at least 1"), ("-3", "-3 must be at least 1"),
        ("1.5", "'1.5' is not an integer"), ("nan", "'nan' is not an integer"),
    ]  # fmt: skip
    for text, message in refused:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            timing.positive_int(text)
