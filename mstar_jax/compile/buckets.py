"""Bucket sets: the (batch size, token count) shapes compiled ahead of time, and the choice among them.

A graph walk's `BucketSet` is the product of its batch sizes and its per-row token counts; each pair
names one compiled program, a `BucketKey`. Serving picks the tightest bucket a batch fits
(`bs' >= bs`, `num_tokens' >= num_tokens`, least tokens then least rows), pads up to it and slices
the padding off. A batch with more rows than the largest bucket is split by the caller
(`Buckets.split_batch`); a row with more tokens than the largest bucket is refused at admission
(`Buckets.max_tokens`).

Combined walks (`CombinedSplit`, docs/design.md §7). A combined program runs decode rows (one token each) and
prefill rows (`num_tokens` each) side by side. Its bucket at `bs` rows holds up to `bs` rows of which at
most `P = split.max_prefill_rows(max_rows_in_combined, bs)` are prefill rows, so the program is
compiled for `bs` decode rows and `P` prefill rows, whatever the mix. The key says so:
`BucketKey(walk, bs, num_tokens, cg_key_info=CombinedRows(decode_rows=bs, prefill_rows=P))`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from mstar_jax.checks import check_int
from mstar_jax.resources.spec import CombinedSplit
from mstar_jax.resources.step import BucketKey

__all__ = [
    "BatchChunk",
    "BatchTooLargeError",
    "BucketSet",
    "Buckets",
    "CombinedRows",
    "NoBucketError",
    "cap_batch_sizes",
]


_MAX_CHOSEN = 4096
"""Most `BucketSet.bucket_for` answers one set remembers (they are few: rows x tokens x prefill rows)."""


class NoBucketError(ValueError):
    """No compiled bucket can run this batch: an unknown walk, or a row with too many tokens."""


class BatchTooLargeError(NoBucketError):
    """More rows than the largest bucket of the walk; the caller splits the batch (`split_batch`)."""

    def __init__(self, message: str, *, graph_walk: str, bs: int, largest: int):
        super().__init__(message)
        self.graph_walk, self.bs, self.largest = graph_walk, bs, largest


class CombinedRows(NamedTuple):
    """`cg_key_info` of a combined walk's bucket: the rows its program is compiled for, per kernel."""

    decode_rows: int
    prefill_rows: int


class BatchChunk(NamedTuple):
    """One piece of a split batch: its rows, of which `prefill_rows` are prefill rows (combined walks)."""

    rows: int
    prefill_rows: int = 0


def _increasing(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise ValueError(f"{name}={values!r} must be a sequence of ints >= 1")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name}=() must hold at least one bucket")
    for i, value in enumerate(values):
        check_int(f"{name}[{i}]", value, minimum=1, numpy=True)
    values = tuple(int(value) for value in values)  # numpy ints would not make valid BucketKeys
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name}={list(values)} must be strictly increasing")
    return values


def cap_batch_sizes(batch_sizes: Sequence[int], cap: int) -> tuple[int, ...]:
    """The sizes below `cap`, then `cap` itself: no bucket holds more rows than can ever form a batch.

    Args:
      batch_sizes: strictly increasing sizes, e.g. `CompileSettings.resolved_batch_sizes(max_batch)`.
      cap: the most rows a batch can have (the engine's `max_batch`, at most every cache's `max_slots`).
    """
    check_int("cap", cap, minimum=1, numpy=True)
    return (*(size for size in _increasing("batch_sizes", batch_sizes) if size < cap), cap)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BucketSet:
    """One graph walk's buckets: every pair of `batch_sizes` x `token_counts`, sorted.

    Attributes:
      graph_walk: the walk every key names.
      batch_sizes: rows per program, strictly increasing.
      token_counts: step tokens per row, strictly increasing (`(1,)` for a decode walk).
      prefill_rows: None for a plain walk; for a combined walk, the prefill rows compiled at each batch
        size (`CombinedSplit.max_prefill_rows`), non-decreasing, each at most its batch size.
    """

    graph_walk: str
    batch_sizes: tuple[int, ...]
    token_counts: tuple[int, ...]
    prefill_rows: tuple[int, ...] | None = None
    # `bucket_for`'s answers to plain int arguments it accepted: the engine asks every step.
    _chosen: dict[tuple[int, int, int], BucketKey] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        if not isinstance(self.graph_walk, str) or not self.graph_walk:
            raise ValueError(f"graph_walk={self.graph_walk!r} must be a non-empty str")
        object.__setattr__(self, "batch_sizes", _increasing("batch_sizes", self.batch_sizes))
        object.__setattr__(self, "token_counts", _increasing("token_counts", self.token_counts))
        if self.prefill_rows is None:
            return
        prefill = tuple(self.prefill_rows)
        if len(prefill) != len(self.batch_sizes):
            raise ValueError(
                f"prefill_rows={list(prefill)} must give one count per batch size {list(self.batch_sizes)}"
            )
        for i, (rows, bs) in enumerate(zip(prefill, self.batch_sizes, strict=True)):
            check_int(f"prefill_rows[{i}]", rows, minimum=0, numpy=True)
            if rows > bs:
                raise ValueError(f"prefill_rows[{i}]={rows} must be <= its batch size {bs}")
        if any(a > b for a, b in itertools.pairwise(prefill)):
            raise ValueError(f"prefill_rows={list(prefill)} must not decrease as the batch grows")
        object.__setattr__(self, "prefill_rows", tuple(int(rows) for rows in prefill))

    @classmethod
    def combined(
        cls,
        split: CombinedSplit,
        *,
        batch_sizes: Sequence[int],
        token_counts: Sequence[int],
        max_rows_in_combined: Mapping[str, int | None] | None = None,
    ) -> BucketSet:
        """The buckets of `split.combined_walk`, each with room for `split.max_prefill_rows` prefill rows."""
        sizes = _increasing("batch_sizes", batch_sizes)
        caps = dict(max_rows_in_combined or {})
        return cls(
            graph_walk=split.combined_walk,
            batch_sizes=sizes,
            token_counts=tuple(token_counts),
            prefill_rows=tuple(split.max_prefill_rows(caps, bs) for bs in sizes),
        )

    @property
    def is_combined(self) -> bool:
        return self.prefill_rows is not None

    @property
    def max_batch(self) -> int:
        """The most rows one step of this walk may have."""
        return self.batch_sizes[-1]

    @property
    def max_tokens(self) -> int:
        """The most step tokens one row may bring."""
        return self.token_counts[-1]

    def key(self, bs: int, num_tokens: int) -> BucketKey:
        """The key of the bucket at exactly (`bs`, `num_tokens`), which must be in the set."""
        if bs not in self.batch_sizes or num_tokens not in self.token_counts:
            raise ValueError(
                f"({bs=}, {num_tokens=}) is not a bucket of {self.graph_walk!r}: batch sizes "
                f"{list(self.batch_sizes)}, token counts {list(self.token_counts)}"
            )
        info = None
        if self.prefill_rows is not None:
            info = CombinedRows(bs, self.prefill_rows[self.batch_sizes.index(bs)])
        return BucketKey(self.graph_walk, bs, num_tokens, info)

    def keys(self) -> tuple[BucketKey, ...]:
        """Every bucket, least tokens first, then least rows (the order `bucket_for` prefers)."""
        return tuple(self.key(bs, t) for t in self.token_counts for bs in self.batch_sizes)

    def __iter__(self) -> Iterator[BucketKey]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.batch_sizes) * len(self.token_counts)

    def bucket_for(self, bs: int, num_tokens: int, *, prefill_rows: int = 0) -> BucketKey:
        """The tightest bucket a batch fits: least tokens, then least rows.

        Args:
          bs: the batch's rows (for a combined walk, decode and prefill rows together).
          num_tokens: the most step tokens any row brings.
          prefill_rows: how many of the rows are prefill rows (combined walks only).

        Raises:
          BatchTooLargeError: `bs` (or `prefill_rows`) exceeds the largest bucket; split the batch.
          NoBucketError: `num_tokens` exceeds the largest token bucket (admission should have refused
            the row), or prefill rows on a walk that is not combined.
        """
        plain = type(bs) is int and type(num_tokens) is int and type(prefill_rows) is int
        if plain and (key := self._chosen.get((bs, num_tokens, prefill_rows))) is not None:
            return key
        key = self._bucket_for(bs, num_tokens, prefill_rows)
        if plain and len(self._chosen) < _MAX_CHOSEN:
            self._chosen[bs, num_tokens, prefill_rows] = key
        return key

    def _bucket_for(self, bs: int, num_tokens: int, prefill_rows: int) -> BucketKey:
        walk = self.graph_walk
        check_int("bs", bs, minimum=1, numpy=True)
        check_int("num_tokens", num_tokens, minimum=1, numpy=True)
        check_int("prefill_rows", prefill_rows, minimum=0, numpy=True)
        if num_tokens > self.max_tokens:
            raise NoBucketError(
                f"a row of {num_tokens} tokens exceeds the largest {walk!r} bucket ({self.max_tokens} tokens "
                f"per row); admission must refuse rows longer than max_tokens({walk!r}), or chunk them"
            )
        if bs > self.max_batch:
            raise BatchTooLargeError(
                f"a batch of {bs} rows exceeds the largest {walk!r} bucket ({self.max_batch} rows); split it "
                f"with split_batch({walk!r}, {bs}) and run one step per chunk",
                graph_walk=walk, bs=bs, largest=self.max_batch,
            )  # fmt: skip
        if prefill_rows > bs:
            raise ValueError(f"{prefill_rows=} must be <= {bs=}")
        t = self.token_counts[bisect.bisect_left(self.token_counts, num_tokens)]
        i = bisect.bisect_left(self.batch_sizes, bs)
        if prefill_rows:
            if self.prefill_rows is None:
                raise NoBucketError(
                    f"{walk!r} is not a combined walk, so a batch of it has no prefill rows "
                    f"(got {prefill_rows=}); use a combined walk's BucketSet"
                )
            i = bisect.bisect_left(self.prefill_rows, prefill_rows, lo=i)
            if i == len(self.batch_sizes):
                room = self.prefill_rows[-1]
                if room == 0:
                    raise NoBucketError(
                        f"{walk!r} makes room for no prefill rows (max_rows_in_combined caps them at 0); "
                        "run prefill rows on their own walk"
                    )
                raise BatchTooLargeError(
                    f"{prefill_rows} prefill rows exceed the room of the largest {walk!r} bucket ({room}); "
                    f"split it with split_batch({walk!r}, {bs}, prefill_rows={prefill_rows})",
                    graph_walk=walk, bs=bs, largest=self.max_batch,
                )  # fmt: skip
        return self.key(self.batch_sizes[i], t)

    def split_batch(self, bs: int, *, prefill_rows: int = 0) -> tuple[BatchChunk, ...]:
        """Split `bs` rows into chunks that each fit a bucket: full chunks of the largest bucket first.

        Full chunks run unpadded; only the last one pads (to its own tightest bucket). For a combined
        walk each chunk takes as many of the remaining prefill rows as its bucket has room for.

        Raises:
          NoBucketError: prefill rows on a walk that has no room for any.
        """
        check_int("bs", bs, minimum=0, numpy=True)
        check_int("prefill_rows", prefill_rows, minimum=0, numpy=True)
        if prefill_rows > bs:
            raise ValueError(f"{prefill_rows=} must be <= {bs=}")
        room = 0 if self.prefill_rows is None else self.prefill_rows[-1]
        if prefill_rows and not room:
            raise NoBucketError(
                f"{self.graph_walk!r} makes room for no prefill rows; {prefill_rows} cannot be split onto it"
            )
        chunks, decode, prefill = [], bs - prefill_rows, prefill_rows
        while decode + prefill:
            take_prefill = min(prefill, room, self.max_batch)
            take_decode = min(decode, self.max_batch - take_prefill)
            chunks.append(BatchChunk(take_decode + take_prefill, take_prefill))
            decode, prefill = decode - take_decode, prefill - take_prefill
        return tuple(chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """Every walk's `BucketSet`, by walk name: what the engine compiles at load and picks from at serve.

    Attributes:
      sets: one `BucketSet` per walk, each walk at most once.
    """

    sets: tuple[BucketSet, ...]

    def __post_init__(self):
        sets = tuple(self.sets)
        for s in sets:
            if not isinstance(s, BucketSet):
                raise TypeError(f"sets holds {s!r}; every entry must be a BucketSet")
        walks = [s.graph_walk for s in sets]
        if len(set(walks)) != len(walks):
            raise ValueError(f"walks {walks} name a walk twice; give each walk one BucketSet")
        object.__setattr__(self, "sets", sets)

    @classmethod
    def of(cls, batch_sizes: Sequence[int], tokens: Mapping[str, int | Sequence[int]]) -> Buckets:
        """Plain walks of one set of batch sizes: walk -> its token count, or its token counts.

        Raises:
          TypeError, ValueError: as `BucketSet` does, naming the walk's field.
        """
        if not isinstance(tokens, Mapping):
            raise TypeError(f"tokens={tokens!r} must be a mapping of walk to token counts")
        sizes = tuple(batch_sizes)
        counts = {walk: (t,) if isinstance(t, int) else tuple(t) for walk, t in tokens.items()}
        return cls(
            tuple(BucketSet(graph_walk=w, batch_sizes=sizes, token_counts=t) for w, t in counts.items())
        )

    @classmethod
    def from_settings(
        cls,
        settings: Any,
        *,
        max_batch: int,
        decode_walks: Sequence[str] = (),
        prefill_walks: Sequence[str] = (),
        combined: Sequence[CombinedSplit] = (),
        max_rows_in_combined: Mapping[str, int | None] | None = None,
    ) -> Buckets:
        """Buckets from a deployment's compile settings.

        Batch sizes are `settings.resolved_batch_sizes(max_batch)` capped at `max_batch`. Decode walks get
        one token per row; prefill and combined walks get `settings.resolved_token_counts()`.

        Args:
          settings: a `mstar_jax.deployment.CompileSettings` (or any object with those two methods).
          max_batch: the most rows a batch can have (`EngineSettings.max_batch`).
          decode_walks, prefill_walks: the plain walks, by kind.
          combined: the combined walks' splits.
          max_rows_in_combined: per prefill walk, the most rows it may have in a combined step.
        """
        batch_sizes = cap_batch_sizes(settings.resolved_batch_sizes(max_batch), max_batch)
        token_counts = tuple(settings.resolved_token_counts())
        plain = [(walk, (1,)) for walk in decode_walks] + [(walk, token_counts) for walk in prefill_walks]
        sets = [BucketSet(graph_walk=w, batch_sizes=batch_sizes, token_counts=t) for w, t in plain]
        caps = max_rows_in_combined
        for split in combined:
            sets.append(
                BucketSet.combined(
                    split, batch_sizes=batch_sizes, token_counts=token_counts, max_rows_in_combined=caps
                )
            )
        return cls(tuple(sets))

    def __getitem__(self, graph_walk: str) -> BucketSet:
        for s in self.sets:
            if s.graph_walk == graph_walk:
                return s
        raise NoBucketError(
            f"no buckets for graph walk {graph_walk!r}; compiled walks: {[s.graph_walk for s in self.sets]}"
        )

    def __contains__(self, graph_walk: object) -> bool:
        return any(s.graph_walk == graph_walk for s in self.sets)

    @property
    def walks(self) -> tuple[str, ...]:
        return tuple(s.graph_walk for s in self.sets)

    def keys(self) -> tuple[BucketKey, ...]:
        """Every bucket of every walk, walk by walk."""
        return tuple(key for s in self.sets for key in s)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    def bucket_for(self, graph_walk: str, bs: int, num_tokens: int, *, prefill_rows: int = 0) -> BucketKey:
        """The tightest bucket of `graph_walk` for the batch; see `BucketSet.bucket_for`."""
        return self[graph_walk].bucket_for(bs, num_tokens, prefill_rows=prefill_rows)

    def max_tokens(self, graph_walk: str) -> int:
        """The most step tokens a row of `graph_walk` may bring; admission refuses longer rows."""
        return self[graph_walk].max_tokens

    def max_batch(self, graph_walk: str) -> int:
        """The most rows one step of `graph_walk` may have; the scheduler splits larger batches."""
        return self[graph_walk].max_batch

    def split_batch(self, graph_walk: str, bs: int, *, prefill_rows: int = 0) -> tuple[BatchChunk, ...]:
        """Chunks of the batch that each fit a bucket; see `BucketSet.split_batch`."""
        return self[graph_walk].split_batch(bs, prefill_rows=prefill_rows)
