"""Live streams' host state as NumPy columns indexed by slot: what the engine's hot path reads and writes.

A stream class declares its hot fields as `Column`s (dataclass fields whose values live in a table while
the stream is attached). `StreamTable.attach` gives a stream a slot and moves those values into the
table's arrays; from then on `stream.prefilled` reads `table["prefilled"][slot]`, and a model's loops
read and update every live stream's state at once with array operations instead of one Python object at
a time. `detach` (when the stream ends) moves the values back onto the object, so the client's handle
keeps reading them, and frees the slot for the next stream. A stream never attached (a test's, a
model's without a table) keeps its values on the object throughout.

A slot is the stream's index in the table, not a cache slot: every live stream has one, admitted or
waiting. `order()` lists the live slots in arrival order (the order the engine's `streams` holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mstar_jax.checks import check_int

__all__ = ["Column", "StreamTable", "slots_of"]

_DETACHED = -1


class Column:
    """A stream field stored in its `StreamTable` while the stream is attached (a data descriptor, usable
    as a dataclass field's default: the dataclass reads `default` through it).

    Args:
      dtype: the column's NumPy type.
      default: the field's value before anything sets it.
      load, store: the field's value from the stored Python scalar (`ndarray.item`), and back (default:
        the value as it is, both ways: an int, float or bool column gives back an int, float or bool).
    """

    def __init__(
        self,
        dtype: Any,
        default: Any,
        *,
        load: Callable[[Any], Any] | None = None,
        store: Callable[[Any], Any] | None = None,
    ):
        self.dtype, self.default = np.dtype(dtype), default
        self.load, self.store = load, store
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, stream: Any, owner: type | None = None) -> Any:
        if stream is None:
            return self.default  # the class-level read a dataclass makes for the field's default
        slot = stream._slot
        if slot == _DETACHED:
            return stream.__dict__.get(self.name, self.default)
        value = stream._table.columns[self.name].item(slot)
        return value if self.load is None else self.load(value)

    def __set__(self, stream: Any, value: Any) -> None:
        slot = stream._slot
        if slot == _DETACHED:
            stream.__dict__[self.name] = value
        else:
            stream._table.columns[self.name][slot] = value if self.store is None else self.store(value)


def columns_of(stream_type: type) -> dict[str, Column]:
    """Every `Column` of `stream_type`, its base classes' included, by name."""
    found: dict[str, Column] = {}
    for klass in reversed(stream_type.__mro__):
        found.update({name: v for name, v in vars(klass).items() if isinstance(v, Column)})
    return found


def slots_of(streams: Iterable[Any]) -> np.ndarray:
    """Each stream's slot (-1 for a detached one), as an i64 array."""
    slots = [stream._slot for stream in streams]
    return np.fromiter(slots, np.int64, len(slots))


class StreamTable:
    """The attached streams of one stream type and their `Column`s (module doc).

    Args:
      stream_type: the stream class whose columns it holds.
      capacity: slots to start with (it doubles when full).

    Raises:
      ValueError: `capacity` is not an int >= 1.

    Attributes:
      columns: name -> the column's array (one entry a slot; a free slot's entry is stale). An array is
        replaced when the table grows: read it from here for each use.
      streams: the stream at each slot (None where free).
    """

    def __init__(self, stream_type: type, capacity: int = 64):
        check_int("StreamTable capacity", capacity, minimum=1)
        fields = columns_of(stream_type)
        # The columns of one dtype are the columns of one 2-D block, so attach and detach move a stream's
        # values with one row write and one `tolist` per block, not one NumPy call per field.
        by_dtype: dict[np.dtype, list[Column]] = {}
        for field in fields.values():
            by_dtype.setdefault(field.dtype, []).append(field)
        self._groups = list(by_dtype.values())
        self._blocks = [np.zeros((capacity, len(group)), group[0].dtype) for group in self._groups]
        self.columns: dict[str, np.ndarray] = {}
        self._views()
        self.streams: list[Any] = [None] * capacity
        self._arrival = np.zeros(capacity, np.int64)
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: the lowest slot first
        self._arrivals = 0
        self._order: np.ndarray | None = np.zeros(0, np.int64)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.streams) - len(self._free)

    def attach(self, stream: Any) -> int:
        """Give `stream` a slot and move its column values into the table; returns the slot."""
        if stream._slot != _DETACHED:
            raise ValueError(f"stream {stream.request_id!r} is already in a table, at slot {stream._slot}")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        values = stream.__dict__
        for block, group in zip(self._blocks, self._groups, strict=True):
            row = [values.pop(field.name, field.default) for field in group]
            block[slot] = [v if f.store is None else f.store(v) for v, f in zip(row, group, strict=True)]
        self.streams[slot] = stream
        self._arrival[slot] = self._arrivals
        self._arrivals += 1
        stream._table, stream._slot = self, slot
        self._order = None
        return slot

    def detach(self, stream: Any) -> None:
        """Move `stream`'s column values back onto it and free its slot (nothing if it is not attached)."""
        slot = stream._slot
        if slot == _DETACHED or stream._table is not self:
            return
        values = stream.__dict__
        for block, group in zip(self._blocks, self._groups, strict=True):
            for field, value in zip(group, block[slot].tolist(), strict=True):
                values[field.name] = value if field.load is None else field.load(value)
        stream._table, stream._slot = None, _DETACHED
        self.streams[slot] = None
        self._free.append(slot)
        self._order = None

    def order(self) -> np.ndarray:
        """The attached streams' slots, in arrival order (cached until one attaches or detaches)."""
        if self._order is None:
            streams = self.streams
            taken = np.flatnonzero(np.fromiter((s is not None for s in streams), bool, len(streams)))
            self._order = taken[np.argsort(self._arrival[taken], kind="stable")]
            self._order.setflags(write=False)
        return self._order

    def _views(self) -> None:
        for block, group in zip(self._blocks, self._groups, strict=True):
            self.columns.update({field.name: block[:, j] for j, field in enumerate(group)})

    def _grow(self) -> None:
        old = len(self.streams)
        self._blocks = [np.concatenate([block, np.zeros_like(block)]) for block in self._blocks]
        self._views()
        self._arrival = np.concatenate([self._arrival, np.zeros(old, np.int64)])
        self.streams.extend([None] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))
