"""What a model declares about a bounded KV cache.

A request's cache is a logical stream: an optional read-only source prefix (a voice prompt's keys,
say, shared by every request that uses it) followed by the tokens the request writes. Retention keeps
the stream's first `sink` entries and its last `window` (StreamingLLM's attention sinks plus a sliding
window), so a request's footprint is fixed and known when it starts: each slot holds only the written
part of the sink and a ring for the window, and source entries are read where they live.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np

from mstar_jax.checks import INT32_MAX, brief, check_bool, check_int
from mstar_jax.resources.spec import NodeResourceSpec, register_static_pytree
from mstar_jax.resources.step import ResourceStep, register_step_pytree

if TYPE_CHECKING:
    from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

__all__ = [
    "MAX_TABULATED_SOURCE_LENGTHS",
    "STORAGE_DTYPES",
    "BoundedKVConfig",
    "BoundedKVSpec",
    "BoundedKVStep",
    "PositionColumns",
    "SinkWindow",
    "StreamPosition",
    "store_capacity",
]

MAX_TABULATED_SOURCE_LENGTHS = 2**16
"""Most source lengths a callable retention is evaluated at: a config builds in well under a second
(a deployment builds each config a few times), and 65,536 frames is 87 minutes of voice at 12.5 Hz.
A constant `SinkWindow` needs no table and has no bound."""

STORAGE_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
"""The dtypes a cache stores keys and values in. Not float64: JAX makes its arrays float32 unless
`jax_enable_x64` is on, while `slot_bytes` would count 8-byte entries; and no Pallas kernel takes it."""

# Store lengths are allocated in whole TPU tiles: sublanes, or lanes (see `store_capacity`).
STORE_TILE = 8
LANE_TILE = 128


class SinkWindow(NamedTuple):
    """Keep the stream's first `sink` and last `window` entries.

    With `window_includes_step` the window counts the step's own tokens, so a step that writes `span`
    attends only the last `window - span` retained ones. `BoundedKVConfig` checks it: `sink` and
    `window` are ints >= 0 with `sink + window <= INT32_MAX` (positions are int32).
    """

    sink: int
    window: int
    window_includes_step: bool = False


class StreamPosition(NamedTuple):
    """Where a request's stream stands when a step starts.

    `source` picks the registered source prefix the request reads, `source_len` how much of it, and
    `written` how many entries the request wrote before this step.
    """

    source_len: int
    written: int
    source: int = 0


class PositionColumns(Mapping):
    """Stream positions as int64 columns, one entry per request in row order: a `Mapping` of request id
    to `StreamPosition` that a step can carry instead of a dict (`BoundedKVStep.positions`), so the
    cache reads a step's positions as arrays without a Python object per row.

    Args:
      request_ids: the requests, in the order of the columns (each once).
      table: int[B, 3], each row a request's `(source_len, written, source)`.

    Raises:
      TypeError: a table of other than integers.
      ValueError: a request id twice, or a table that is not `[len(request_ids), 3]`.
    """

    __slots__ = ("_index", "request_ids", "source", "source_len", "written")

    def __init__(self, request_ids, table):
        self.request_ids = tuple(request_ids)
        array = np.asarray(table)
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"table must hold ints (source_len, written, source), got dtype {array.dtype}")
        if array.shape != (len(self.request_ids), 3) and (array.size or self.request_ids):
            raise ValueError(f"table.shape={array.shape}; it must be [{len(self.request_ids)}, 3]")
        array = array.astype(np.int64).reshape(len(self.request_ids), 3)
        if len(set(self.request_ids)) < len(self.request_ids):
            raise ValueError(f"request_ids={list(self.request_ids)} names a request twice")
        self._index = None  # made when a position is first looked up by id: the cache reads the columns
        self.source_len, self.written, self.source = array[:, 0], array[:, 1], array[:, 2]

    def _rows(self) -> dict[str, int]:
        if self._index is None:
            self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        return self._index

    def __getitem__(self, request_id: str) -> StreamPosition:
        i = self._rows()[request_id]
        return StreamPosition(int(self.source_len[i]), int(self.written[i]), int(self.source[i]))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows()

    def __iter__(self):
        return iter(self.request_ids)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __repr__(self) -> str:
        return f"PositionColumns({dict(self)!r})"


@dataclasses.dataclass(frozen=True, eq=False)
class BoundedKVConfig:
    """Geometry and retention of a bounded KV cache, validated at construction.

    Attributes:
      num_layers: layers whose K/V the cache holds.
      num_heads: KV heads stored per row (query heads attending them may be a multiple: GQA).
      head_dim: size of each key and value vector.
      rows_per_request: K/V rows a request owns per layer (2 for classifier-free guidance); row `c`
        reads source row `c` and slot row `c`.
      max_source_len: the longest source prefix a request may read.
      retention: `source_len -> SinkWindow`, or one `SinkWindow` for every source length. It must not
        shrink as the source grows. A callable is tabulated over `[min_source_len, max_source_len]`
        here, which may span at most `MAX_TABULATED_SOURCE_LENGTHS` lengths; a `SinkWindow` is not.
      max_slots: requests the cache holds at once.
      min_source_len: the shortest source a request may read; the written part of the sink is
        largest for the shortest source, so this sizes the slots.
      dtype: storage dtype of keys and values, one of `STORAGE_DTYPES` (float32, bfloat16, float16;
        None means float32).
      reverse_step_order: a step's written tokens join the stream last-first (order-free attention
        only, e.g. a flow decoder that keeps the front of each chunk).
      query_window: None (every query attends every retained and step key) or `q >= 1`: causal band of
        `q` positions per query, sinks always visible.

    Equality and hashing use the tabulated retention, so two configs whose retention callables agree
    over the source range are equal (and share compiled programs).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    rows_per_request: int
    max_source_len: int
    retention: Callable[[int], SinkWindow] | SinkWindow
    max_slots: int = 32
    min_source_len: int = 0
    dtype: Any = jnp.float32
    reverse_step_order: bool = False
    query_window: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "head_dim", "rows_per_request", "max_slots"):
            check_int(name, getattr(self, name), minimum=1, numpy=True)
        # Positions are int32 in every program: a longer source would overflow them, not be refused.
        check_int("max_source_len", self.max_source_len, minimum=0, maximum=INT32_MAX, numpy=True)
        check_int("min_source_len", self.min_source_len, minimum=0, numpy=True)
        if self.min_source_len > self.max_source_len:
            raise ValueError(
                f"min_source_len={self.min_source_len} must be <= max_source_len={self.max_source_len}"
            )
        if self.query_window is not None:
            check_int("query_window", self.query_window, minimum=1, maximum=INT32_MAX, numpy=True)
            if self.reverse_step_order:
                raise ValueError(
                    f"reverse_step_order=True with query_window={self.query_window}: a causal window needs "
                    "the stream in step order; use one or the other"
                )
        check_bool("reverse_step_order", self.reverse_step_order)
        object.__setattr__(self, "dtype", _storage_dtype(self.dtype))
        object.__setattr__(self, "_runs", self._tabulate_retention())
        object.__setattr__(self, "_run_starts", tuple(start for start, _ in self._runs))
        # The config is a static jit argument: hash and compare once-computed keys, not the table per call.
        object.__setattr__(self, "_frozen_key", self._key())
        object.__setattr__(self, "_hash", hash(self._frozen_key))

    def _tabulate_retention(self) -> tuple[tuple[int, SinkWindow], ...]:
        """The retention over `[min_source_len, max_source_len]` as runs `(first source_len, policy)`.

        Runs, not one entry per length: a constant `SinkWindow` is one run and costs nothing whatever
        the range. Consecutive lengths with the same policy share a run, so two retentions that agree
        over the range give the same runs (equality and hashing compare them).

        Raises:
          ValueError: for a retention that is neither a `SinkWindow` nor a callable, a policy that is
            not a valid `SinkWindow`, one that shrinks as the source grows, or a callable over more
            than `MAX_TABULATED_SOURCE_LENGTHS` lengths.
        """
        if isinstance(self.retention, tuple):
            return ((self.min_source_len, _as_sink_window(self.retention, self.min_source_len)),)
        if not callable(self.retention):
            raise ValueError(
                f"retention={self.retention!r} must be a SinkWindow or a callable source_len -> SinkWindow"
            )
        count = self.max_source_len - self.min_source_len + 1
        if count > MAX_TABULATED_SOURCE_LENGTHS:
            # Checked before the first call: a callable is evaluated at every length, which for a range of
            # 10**8 takes minutes and gigabytes.
            raise ValueError(
                f"max_source_len={self.max_source_len} and min_source_len={self.min_source_len} span "
                f"{count:,} source lengths, but a callable retention is tabulated at each and at most "
                f"MAX_TABULATED_SOURCE_LENGTHS={MAX_TABULATED_SOURCE_LENGTHS:,} are allowed; narrow the "
                "source range, or give one SinkWindow for every length (it needs no table)"
            )
        runs: list[tuple[int, SinkWindow]] = []
        previous = None
        for source_len in range(self.min_source_len, self.max_source_len + 1):
            try:
                policy = self.retention(source_len)
            except Exception as err:
                raise ValueError(
                    f"retention({source_len}) raised {err!r}; it must return a SinkWindow for every source "
                    f"length in [min_source_len={self.min_source_len}, max_source_len={self.max_source_len}]"
                ) from err
            policy = _as_sink_window(policy, source_len)
            if previous is not None and (policy.sink < previous.sink or policy.window < previous.window):
                raise ValueError(
                    f"retention shrinks as the source grows: retention({source_len - 1})={tuple(previous)} "
                    "but "
                    f"retention({source_len})={tuple(policy)}; sink and window must not decrease"
                )
            if policy != previous:
                runs.append((source_len, policy))
            previous = policy
        return tuple(runs)

    def _key(self) -> tuple:
        return (
            self.num_layers, self.num_heads, self.head_dim, self.rows_per_request, self.max_source_len,
            self._runs, self.max_slots, self.min_source_len, self.dtype, self.reverse_step_order,
            self.query_window,
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, BoundedKVConfig) or self._hash != other._hash:
            return False
        return self._frozen_key == other._frozen_key

    def __hash__(self) -> int:
        return self._hash

    def retention_for(self, source_len: int) -> SinkWindow:
        """The retention policy of a request whose source is `source_len` long.

        Raises:
          ValueError: if `source_len` is outside `[min_source_len, max_source_len]`.
        """
        check_int("source_len", source_len, numpy=True)
        if not self.min_source_len <= source_len <= self.max_source_len:
            raise ValueError(
                f"source_len={source_len} is outside [min_source_len={self.min_source_len}, "
                f"max_source_len={self.max_source_len}]"
            )
        return self._runs[bisect.bisect_right(self._run_starts, source_len) - 1][1]

    @functools.cached_property
    def sink_capacity(self) -> int:
        """Written tokens a slot's sink region holds (the sink past the source).

        Over one run the sink is fixed and the source grows, so the run's first length writes the most.
        """
        return max(max(0, policy.sink - start) for start, policy in self._runs)

    @functools.cached_property
    def window_capacity(self) -> int:
        """Entries a slot's ring holds: the largest window over the source range."""
        return max(policy.window for _, policy in self._runs)

    @property
    def slot_tokens(self) -> int:
        """Entries one slot holds per layer and row: the written sink, then the ring."""
        return self.sink_capacity + self.window_capacity

    @functools.cached_property
    def max_retained(self) -> int:
        """The most entries a request retains, over every allowed source length."""
        return max(policy.sink + policy.window for _, policy in self._runs)

    @property
    def slot_capacity(self) -> int:
        """Entries one slot allocates per layer and row: `slot_tokens` in whole tiles (`store_capacity`)."""
        return store_capacity(self.slot_tokens, self.head_dim)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot: K and V for every layer and row, padding entries included."""
        per_entry = self.rows_per_request * self.num_heads * 2 * self.head_dim * self.dtype.itemsize
        return self.num_layers * self.slot_capacity * per_entry


def store_capacity(length: int, head_dim: int) -> int:
    """Entries a store (a slot, a source) allocates for `length` entries of `head_dim`-wide keys.

    TPU lays out an array with the dim that pads least to whole 128-lane tiles in lanes. The attention and
    store kernels can read a `[.., C, D]` store in place with `D` in lanes (which also needs `C % 8 == 0`:
    otherwise the KV-head and token axes are swapped) or with `C` in lanes; any other layout makes XLA copy
    the whole layer before every call (measured with libtpu on v4, v5e, v5p and v6e). So a store takes
    whole tiles of `STORE_TILE` entries, and, where `D % 128 != 0` and it spans more than one lane tile,
    whole tiles of 128 (at most 1/8 more for 1,024 entries and up), so that no slot count can pad less
    than the tokens do and take the lanes. Entries past `length` are never planned, so never read or
    written.
    """
    tile = LANE_TILE if head_dim % LANE_TILE and length > LANE_TILE else STORE_TILE
    return max(-(-length // tile) * tile, STORE_TILE)


register_static_pytree(BoundedKVConfig)


def _storage_dtype(dtype: Any) -> np.dtype:
    if dtype is None:
        return np.dtype(np.float32)
    allowed = ", ".join(d.name for d in STORAGE_DTYPES)
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={brief(dtype)} is not a dtype; use one of {allowed}") from None
    if resolved not in STORAGE_DTYPES:
        raise ValueError(
            f"dtype={brief(dtype)} must be a floating dtype the cache stores ({allowed}), not {resolved.name}"
        )
    return resolved


def _as_sink_window(policy: Any, source_len: int) -> SinkWindow:
    if not isinstance(policy, tuple) or len(policy) not in (2, 3):
        raise ValueError(
            f"retention({source_len})={policy!r} must be a SinkWindow(sink, window[, window_includes_step])"
        )
    policy = SinkWindow(*policy)
    # The plan table holds positions and retained counts as int32: past it a program would overflow.
    check_int(f"retention({source_len}).sink", policy.sink, minimum=0, maximum=INT32_MAX, numpy=True)
    check_int(f"retention({source_len}).window", policy.window, minimum=0, maximum=INT32_MAX, numpy=True)
    check_bool(f"retention({source_len}).window_includes_step", policy.window_includes_step)
    sink, window = int(policy.sink), int(policy.window)
    if sink + window > INT32_MAX:
        raise ValueError(
            f"retention({source_len}) keeps sink={sink} + window={window} = {sink + window} entries; the "
            f"sum must be <= {INT32_MAX} (positions are int32)"
        )
    return SinkWindow(sink, window, policy.window_includes_step)


@dataclasses.dataclass(frozen=True)
class BoundedKVSpec(NodeResourceSpec):
    """A bounded KV cache declared for the nodes that use it."""

    config: BoundedKVConfig

    YAML_KEYS: ClassVar[tuple[str, ...]] = ("max_slots",)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.config, BoundedKVConfig):
            raise TypeError(f"config={self.config!r} must be a BoundedKVConfig")

    @property
    def resource_class(self) -> type[BoundedKVManager]:
        # Imported here, on demand: declaring a spec must not load the manager and its kernels (the seed's
        # contract; the one import cycle tests/test_import_graph.py allows).
        from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

        return BoundedKVManager

    def apply_yaml_overrides(self, max_slots: int | None = None, **unknown: Any) -> BoundedKVSpec:
        """Return this spec with its YAML block applied: only `max_slots` is tunable.

        Raises:
          TypeError: for any other key.
          ValueError: for an invalid `max_slots`.
        """
        self._reject_unknown_yaml_keys(unknown)
        if max_slots is None:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, max_slots=max_slots))


@dataclasses.dataclass(frozen=True)
class BoundedKVStep(ResourceStep):
    """Each segment's span is what its request writes this step (0 reads only).

    The positions come from the model, not the resource, so a plan never waits on the previous
    step's commit and planning the same step twice is harmless. As a pytree, spans, positions and
    token counts are leaves (data), request ids and labels are static.

    `step_tokens` (beyond the seed) gives the tokens a request brings this step, queries and keys, of
    which the first `span` are written and the rest are lookahead; a request absent from it brings
    `max(span, 1)`. Tokens past a request's count (padding up to the bucket) are never attended.

    `steps` > 1 declares a block of that many one-token decode steps run by one program: a segment's
    span is how many of them its request takes (the first `span`, one token each, from its position
    on), and the plan holds one table per step (`BoundedKVPlan.steps`), each what a one-token step at
    that position would plan, so a block attends exactly what its steps would one at a time.
    """

    positions: Mapping[str, StreamPosition] = dataclasses.field(default_factory=dict)
    step_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_int("steps", self.steps, minimum=1)
        object.__setattr__(self, "step_tokens", _as_dict("step_tokens", self.step_tokens))
        if type(self.positions) is PositionColumns:  # int64 columns already: nothing to convert
            return
        positions = _as_dict("positions", self.positions)
        for rid, pos in positions.items():
            if type(pos) is StreamPosition:  # what the engine declares: nothing to convert
                continue
            if not isinstance(pos, tuple | list) or len(pos) not in (2, 3):  # the values are checked at admit
                raise TypeError(
                    f"positions[{rid!r}]={pos!r} must be a StreamPosition(source_len, written[, source])"
                )
            positions[rid] = StreamPosition(*pos)
        object.__setattr__(self, "positions", positions)


def _as_dict(name: str, value: Any) -> dict:
    try:
        return dict(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} must be a mapping of request id to value") from None


register_step_pytree(BoundedKVStep, data_mappings=("positions", "step_tokens"))
