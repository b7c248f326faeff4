"""Padding a batch to its bucket and slicing the padding off: numpy on the host, axis by axis.

A step's arguments are pytrees; a prefix tree of `PadAxes` says, per argument, which axis holds rows
and which holds step tokens (None: the argument is not padded, e.g. the cache). `measure` reads the
batch's real sizes off those axes, `pad` grows every axis to the bucket's sizes (`bucket_sizes`) with
a fill value, and `unpad` cuts outputs back to the real sizes. All of it runs in numpy: an eager jnp
pad or slice would compile one program per shape, which is what capture exists to avoid.

Padding rows must be well-formed, not merely zero: a plan-table row of padding reads and writes
nothing (`layout.padding_rows`), so pass one as the table's `fill`; padding tokens are masked by each
row's `STEP_TOKENS`, so any fill works for them (tests fill them with NaN to prove it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from mstar_jax.checks import check_choice, check_int
from mstar_jax.compile.buckets import CombinedRows
from mstar_jax.resources.step import BucketKey

__all__ = ["PadAxes", "bucket_sizes", "measure", "pad", "unpad"]

GROUPS = ("rows", "decode", "prefill")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PadAxes:
    """How one argument (or output) of a step pads to a bucket: its row axis and its token axis.

    Attributes:
      rows: the axis holding rows, or None (the leaf is not per-row).
      tokens: the axis holding step tokens, or None.
      group: which row count the row axis follows: "rows" (the bucket's `bs`), or for a combined
        bucket "decode" or "prefill" (its `CombinedRows`).
      rows_per_request: entries of the row axis per batch row (N = B * R for the cache's rows).
      fill: the value of padding entries: a scalar, or an array that broadcasts to the padding block
        (e.g. one plan-table padding row).
    """

    rows: int | None = 0
    tokens: int | None = None
    group: str = "rows"
    rows_per_request: int = 1
    fill: Any = 0

    def __post_init__(self):
        check_choice("group", self.group, GROUPS)
        check_int("rows_per_request", self.rows_per_request, minimum=1)
        if self.rows is not None and self.rows == self.tokens:
            raise ValueError(f"rows={self.rows} and tokens={self.tokens} must be different axes")


def bucket_sizes(bucket: BucketKey) -> dict[str, int]:
    """What a bucket pads to: `{"rows": bs, "tokens": num_tokens}`, plus "decode" and "prefill" rows
    for a combined bucket."""
    sizes = {"rows": bucket.bs, "tokens": bucket.num_tokens}
    if isinstance(bucket.cg_key_info, CombinedRows):
        sizes["decode"], sizes["prefill"] = bucket.cg_key_info
    return sizes


def _is_axes(x: Any) -> bool:
    return x is None or isinstance(x, PadAxes)


def _map(fn: Callable[[str, Any, PadAxes], Any], axes: Any, tree: Any) -> Any:
    """Apply `fn(where, leaf, axes)` to every leaf under a `PadAxes` of the prefix `axes`; keep the rest."""

    def per_subtree(prefix, ax, sub):
        if ax is None:
            return sub
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: fn(jax.tree_util.keystr((*prefix, *path)) or "leaf", leaf, ax), sub
        )

    return jax.tree_util.tree_map_with_path(per_subtree, axes, tree, is_leaf=_is_axes)


def measure(tree: Any, axes: Any) -> dict[str, int]:
    """The real sizes of a batch: rows per group and the most tokens, read off its padded axes.

    Args:
      tree: the batch's arrays.
      axes: a prefix of `tree` of `PadAxes` (None: not padded).

    Raises:
      ValueError: when leaves of one group disagree on the row count, or a row axis is not a multiple
        of `rows_per_request`.
    """
    sizes: dict[str, int] = {}
    seen: dict[str, str] = {}

    def read(where: str, leaf: Any, ax: PadAxes) -> None:
        shape = np.shape(leaf)
        if ax.rows is not None:
            n, r = shape[ax.rows], ax.rows_per_request
            if n % r:
                raise ValueError(f"{where}: row axis {ax.rows} of size {n} is not a multiple of {r=}")
            if sizes.setdefault(ax.group, n // r) != n // r:
                raise ValueError(
                    f"{where} has {n // r} rows but {seen[ax.group]} has {sizes[ax.group]} (group "
                    f"{ax.group!r}); every argument of a group must hold the same rows"
                )
            seen.setdefault(ax.group, where)
        if ax.tokens is not None:
            sizes["tokens"] = max(sizes.get("tokens", 0), shape[ax.tokens])

    _map(read, axes, tree)
    return sizes


def _target(sizes: Mapping[str, int], name: str, where: str) -> int:
    if name not in sizes:
        raise ValueError(
            f"{where} pads its {name!r} axis but the sizes {dict(sizes)} give none (decode and prefill rows "
            "exist only for a combined walk's bucket; tokens only when an input has a tokens axis)"
        )
    return sizes[name]


def _resize(x: np.ndarray, axis: int, size: int, fill: Any, where: str) -> np.ndarray:
    have = x.shape[axis]
    if have > size:
        raise ValueError(
            f"{where}: axis {axis} holds {have} entries but the bucket holds {size}; pick a bucket the "
            "batch fits (Buckets.bucket_for)"
        )
    if have == size:
        return x
    block = list(x.shape)
    block[axis] = size - have
    try:
        value = np.asarray(fill, dtype=x.dtype)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: fill={fill!r} cannot be stored as {x.dtype}: {err}") from None
    return np.concatenate([x, np.broadcast_to(value, block)], axis=axis)


def pad(tree: Any, axes: Any, sizes: Mapping[str, int]) -> Any:
    """Pad every leaf under a `PadAxes` up to `sizes` on the host (numpy); leaves under None pass as is.

    Args:
      tree: the step's arguments (host arrays; device arrays are copied to the host).
      axes: a prefix of `tree` of `PadAxes` or None.
      sizes: targets, e.g. `bucket_sizes(bucket)`.

    Raises:
      ValueError: for a leaf larger than its target, or a fill its dtype cannot hold.
    """

    def pad_leaf(where: str, leaf: Any, ax: PadAxes) -> np.ndarray:
        x = np.asarray(leaf)
        if ax.rows is not None:
            x = _resize(x, ax.rows, _target(sizes, ax.group, where) * ax.rows_per_request, ax.fill, where)
        if ax.tokens is not None:
            x = _resize(x, ax.tokens, _target(sizes, "tokens", where), ax.fill, where)
        return x

    return _map(pad_leaf, axes, tree)


def unpad(tree: Any, axes: Any, sizes: Mapping[str, int]) -> Any:
    """Slice every leaf under a `PadAxes` down to the real `sizes` (from `measure`), as numpy arrays.

    The slice runs on the host: slicing a device array would compile a program per shape. Leaves under
    None (the new cache) stay on the device untouched.
    """

    def cut(where: str, leaf: Any, ax: PadAxes) -> np.ndarray:
        x = np.asarray(leaf)
        index = [slice(None)] * x.ndim
        if ax.rows is not None:
            index[ax.rows] = slice(0, _target(sizes, ax.group, where) * ax.rows_per_request)
        if ax.tokens is not None:
            index[ax.tokens] = slice(0, _target(sizes, "tokens", where))
        return x[tuple(index)]

    return _map(cut, axes, tree)
