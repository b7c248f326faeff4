"""A step padded to a bucket: padding rows after each group's real rows, and token arrays at its width.

A compiled program runs a bucket's shapes (`BucketKey.bs` rows of `num_tokens` tokens); a smaller batch
runs in it with padding rows, segments of span 0 whose ids start with `PAD`, which the manager plans as
empty layouts (they read and write nothing), and with its token arrays padded, which each row's
declared step tokens mask. A combined bucket has groups of rows (decode, then prefill), each padded to
its own size:

    groups ((2, 4), (1, 2)):   row 0 a, 1 b, 2 PAD0, 3 PAD1 | 4 c, 5 PAD2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.step import PAD, BucketKey, Segment, StepContext

__all__ = ["PaddedStep", "pad_step"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PaddedStep:
    """A step padded to its bucket: what to admit, plan and commit, and where each request's row is.

    Attributes:
      step: the step with its padding rows.
      ctx: its context, leased to the bucket (`StepContext.for_step`).
      bucket: the bucket.
      rows: each real request's row in the padded step (of the plan table and the program's arrays).
    """

    step: BoundedKVStep
    ctx: StepContext
    bucket: BucketKey
    rows: Mapping[str, int]

    @property
    def num_rows(self) -> int:
        """The padded step's rows (the bucket's, all groups together)."""
        return len(self.step.segments)

    def pad(self, values: npt.ArrayLike | Sequence[npt.ArrayLike], *, fill=0, dtype=None) -> np.ndarray:
        """The real rows' values at their rows of a `[num_rows * R, num_tokens, ...]` host array.

        Args:
          values: an array `[B * R, T, ...]`, the real rows in the step's order (R rows per request, `T` at
            most the bucket's tokens), or a list of B arrays `[t_b, ...]`, one per request (R = 1), e.g.
            each request's token ids.
          fill: the value of padding entries (padding tokens are masked by the rows' step tokens, so any
            value works for them).
          dtype: the result's dtype (default: that of `values`).

        Returns:
          `[num_rows * R, bucket.num_tokens, ...]` in host NumPy (an eager pad on the device would compile
          one program per shape).

        Raises:
          ValueError: rows that are not `R` per request, or more tokens than the bucket's.
        """
        order, width = np.fromiter(self.rows.values(), np.int64, len(self.rows)), self.bucket.num_tokens
        if isinstance(values, list | tuple):
            arrays = [np.asarray(x) for x in values]
            if len(arrays) != len(order):
                raise ValueError(f"values holds {len(arrays)} arrays; the step has {len(order)} requests")
            dtype = dtype or (np.result_type(*arrays) if arrays else np.asarray(fill).dtype)
            out = np.full((self.num_rows, width, *(arrays[0].shape[1:] if arrays else ())), fill, dtype)
            for row, x in zip(order, arrays, strict=True):
                if x.ndim < 1 or x.shape[0] > width:
                    raise ValueError(
                        f"values has a row of shape {x.shape}; bucket {self.bucket} holds {width}"
                    )
                out[row, : x.shape[0]] = x
            return out
        array = np.asarray(values)
        r = array.shape[0] // max(len(order), 1) if array.ndim >= 2 else 0
        if r < 1 or r * len(order) != array.shape[0] or array.shape[1] > width:
            raise ValueError(
                f"values.shape={array.shape} must be [B * R, T, ...] with B={len(order)} requests and "
                f"T <= {width}, the tokens of bucket {self.bucket}"
            )
        out = np.full((self.num_rows * r, width, *array.shape[2:]), fill, dtype or array.dtype)
        out[(order[:, None] * r + np.arange(r)).reshape(-1), : array.shape[1]] = array
        return out

    def unpad(self, per_row: npt.ArrayLike, rows_per_request: int = 1) -> np.ndarray:
        """The real rows of a per-row output `[num_rows * R, ...]`, in the step's order: `[B * R, ...]`."""
        order = np.fromiter(self.rows.values(), np.int64, len(self.rows))
        return np.asarray(per_row)[
            (order[:, None] * rows_per_request + np.arange(rows_per_request)).reshape(-1)
        ]


def pad_step(
    step: BoundedKVStep,
    bucket: BucketKey,
    *,
    groups: Sequence[tuple[int, int]] | None = None,
    pad: bool = True,
) -> PaddedStep:
    """`step` padded to `bucket` with padding rows, leased to it.

    Args:
      step: the real rows only, in the order the caller's arrays hold them.
      bucket: the bucket to run (e.g. `Buckets.bucket_for(walk, rows, tokens)`).
      groups: the bucket's row groups in order, each `(the step's rows in it, the bucket's rows for it)`,
        e.g. a combined bucket's decode rows then its prefill rows; default one group of `bucket.bs`.
      pad: False declares no padding rows and leaves the row counts unchecked (a manager of several data
        shards pads each shard to the bucket's rows itself, and its `plan_rows` says where each request's
        row goes).

    Returns:
      The `PaddedStep`; admit, plan and commit its `step` with its `ctx`.

    Raises:
      ValueError: a row id starting with `PAD`, groups that do not cover the step's rows, or a group with
        more rows than the bucket has for it (pick a bucket with `bs >= rows`).
    """
    segments = step.segments or ()
    rids = [seg.request_id for seg in segments]
    padding = [rid for rid in rids if rid.startswith(PAD)]
    if padding:
        raise ValueError(f"step rows {padding} are padding ids (prefix PAD); pass the real rows only")
    groups = ((len(segments), bucket.bs),) if groups is None else tuple(groups)
    if sum(real for real, _ in groups) != len(segments):
        raise ValueError(
            f"groups={list(groups)} cover {sum(r for r, _ in groups)} rows; the step has {len(segments)}"
        )
    for i, (real, size) in enumerate(groups):
        if pad and real > size:
            raise ValueError(
                f"group {i} has {real} rows but bucket {bucket} holds {size}; pick a bucket with bs >= {real}"
            )
    if not pad or all(real == size for real, size in groups):  # every row where it is, none added
        padded, rows = segments, {rid: i for i, rid in enumerate(rids)}
    else:
        padded, rows = _padded(segments, groups)
    # The step was checked when it was made; only its segments change, and padding rows are Segments.
    # (`copy.copy` of a dataclass goes through `__reduce_ex__`: several times the cost of this.)
    fields = step.__dict__
    step = object.__new__(type(step))
    step.__dict__.update(fields, segments=tuple(padded))
    # `StepContext.for_step(step, bucket)`, knowing already which rows are real: all of `rids`. A manager
    # of several data shards lays each shard out by the row groups.
    pads = (
        [seg.request_id for seg in padded if seg.request_id.startswith(PAD)]
        if len(padded) > len(rids)
        else None
    )
    ctx = StepContext.leased(rids, bucket, padded=None if pads is None else [*rids, *pads], row_groups=groups)
    return PaddedStep(step=step, ctx=ctx, bucket=bucket, rows=rows)


def _padded(segments: Sequence[Segment], groups: Sequence[tuple[int, int]]) -> tuple[list, dict[str, int]]:
    """Each group's segments, then its padding rows up to its size; and each request's row."""
    label = segments[0].label if segments else "main"
    padded: list[Segment] = []
    rows: dict[str, int] = {}
    start, pads = 0, 0
    for real, size in groups:
        for seg in segments[start : start + real]:
            rows[seg.request_id] = len(padded)
            padded.append(seg)
        start += real
        for _ in range(size - real):
            padded.append(Segment(f"{PAD}{pads}", label, 0))
            pads += 1
    return padded, rows
