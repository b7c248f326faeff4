"""Timing shared by the benchmarks: every case once per repeat, in a fresh random order, summarised as a
median with its spread over the repeats.

Why the order is shuffled rather than fixed or rotated: a case that runs right after one that evicts the
CPU caches (a 100 ms dense attention over a long stream) starts cold. A fixed order makes the same case
pay that in every repeat, and so does a rotation, which keeps each case's predecessor. A fixed order once
made `bounded_kv.py` report a 64k step at 0.67 of a 1k step, impossible for equal work. A fresh
permutation per repeat (seeded, so a run can be repeated) spreads that cost over every case alike.

Ratios are taken per repeat (case ÷ baseline within the same repeat) before the median, so load that
drifts across the run cancels, and their min–max shows how much to trust a figure.

Usage, from the repository root (`python -m benchmarks.NAME`, or imported as `benchmarks.timing`):

    samples = interleaved_times([short, long], repeats=30)
    print(describe(ratios(samples[1], samples[0])))  # "1.01 (0.97–1.08, 30 repeats)"
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeVar

__all__ = [
    "ORDER_NOTE", "Spread", "describe", "interleaved_times", "positive_int", "quick_label", "ratios",
]  # fmt: skip

K = TypeVar("K")
Order = Literal["shuffle", "rotate"]

ORDER_NOTE = "every case timed once per repeat, in a fresh random order each repeat"


def interleaved_times(
    cases: Sequence[Callable[[], object]] | Mapping[K, Callable[[], object]],
    repeats: int,
    *,
    warmup: int = 1,
    number: int = 1,
    order: Order = "shuffle",
    seed: int = 0,
    self_timed: bool = False,
) -> list[list[float]] | dict[K, list[float]]:
    """Time each case once per repeat, the cases interleaved, so machine noise reaches all of them alike.

    Args:
      cases: zero-argument callables (a sequence, or a mapping from names) that block until their work is
        done (e.g. `jax.block_until_ready`).
      repeats: samples per case, >= 1.
      warmup: untimed calls of each case first (the first compiles).
      number: calls per sample, back to back; a sample is their mean, so that a case the previous one left
        with cold caches pays that once, not in every call.
      order: "shuffle" (a fresh permutation per repeat, the default) or "rotate" (repeat `r` starts at
        case `r mod n`: every case in every position equally often, but always after the same neighbour).
      seed: the shuffle's seed.
      self_timed: each case returns its own seconds (a float), which are used instead of the wall time of
        the call (for a case whose call includes setup that is not to be timed).

    Returns:
      Per case (in the order or keys of `cases`), its `repeats` samples in seconds per call.

    Raises:
      ValueError: `repeats` or `number` below 1, `warmup` below 0, or an unknown `order`.
    """
    if repeats < 1 or number < 1 or warmup < 0:
        raise ValueError(f"{repeats=} and {number=} must be >= 1, {warmup=} >= 0")
    if order not in ("shuffle", "rotate"):
        raise ValueError(f"{order=} must be 'shuffle' or 'rotate'")
    names = list(cases) if isinstance(cases, Mapping) else None
    fns = [cases[name] for name in names] if names is not None else list(cases)
    for fn in fns:
        for _ in range(warmup):
            fn()
    shuffler = random.Random(seed)
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        indices = list(range(len(fns)))
        if order == "shuffle":
            shuffler.shuffle(indices)
        else:
            indices = indices[r % len(fns) :] + indices[: r % len(fns)]
        for i in indices:
            samples[i].append(_sample(fns[i], number, self_timed))
    return dict(zip(names, samples, strict=True)) if names is not None else samples


def _sample(fn: Callable[[], object], number: int, self_timed: bool) -> float:
    if self_timed:
        return sum(float(fn()) for _ in range(number)) / number
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def ratios(samples: Sequence[float], baseline: Sequence[float], *, inverse: bool = False) -> list[float]:
    """Per repeat, `samples[r] / baseline[r]` (`inverse`: `baseline[r] / samples[r]`, a throughput ratio).

    Raises:
      ValueError: the two have different repeat counts (they must come from one `interleaved_times` run).
    """
    if len(samples) != len(baseline):
        raise ValueError(f"{len(samples)} samples, {len(baseline)} of the baseline: time them together")
    return [b / s if inverse else s / b for s, b in zip(samples, baseline, strict=True)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """A median with its spread: min–max and the interquartile range, over `repeats` samples."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    repeats: int

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Spread:
        """The spread of `values`, each multiplied by `scale` (e.g. 1e3 for seconds to ms).

        Raises:
          ValueError: `values` is empty.
        """
        if not values:
            raise ValueError("no samples to summarise")
        scaled = sorted(v * scale for v in values)
        q1, _, q3 = statistics.quantiles(scaled, n=4, method="inclusive") if len(scaled) > 1 else scaled * 3
        median, count = statistics.median(scaled), len(scaled)
        return cls(median=median, low=scaled[0], high=scaled[-1], q1=q1, q3=q3, repeats=count)

    def format(self, fmt: str = ".2f", *, repeats: bool = True, iqr: bool = False, unit: str = "") -> str:
        """E.g. "1.01 (0.97–1.08, 30 repeats)"; `iqr`: "1.01 (IQR 0.99–1.03, 30 repeats)"; `repeats=False`
        leaves the count out (for a table whose header states it)."""
        low, high = (self.q1, self.q3) if iqr else (self.low, self.high)
        inner = f"{'IQR ' if iqr else ''}{low:{fmt}}–{high:{fmt}}"
        if repeats:
            inner += f", {self.repeats} repeat{'s' if self.repeats != 1 else ''}"
        return f"{self.median:{fmt}}{unit} ({inner})"


def describe(
    values: Sequence[float], fmt: str = ".2f", *, scale: float = 1.0, repeats: bool = True, iqr: bool = False,
    unit: str = "",
) -> str:  # fmt: skip
    """`Spread.of(values, scale).format(...)`: the median and min–max (or IQR) of `values`."""
    return Spread.of(values, scale).format(fmt, repeats=repeats, iqr=iqr, unit=unit)


def quick_label(quick: bool, what: str) -> str:
    """The label a `--quick` run prints beside its figures (empty for a full run)."""
    return f" [--quick: {what}; not a full run's figures]" if quick else ""


def positive_int(text: str) -> int:
    """An argparse `type` for counts: an int of at least 1, else a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
