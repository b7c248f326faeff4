"""Functional device state of the bounded KV cache: the slots, the source bank, and the step's write.

Shape legend (that of `kernels_pallas.sink_window_attention.table`): S slots (+1 padding slot),
R rows per request, G KV heads, C slot tokens, D head dim, V sources, L max source length, B requests,
T step tokens, N = B * R. Layers are a tuple, one array per layer.

Each layer's keys (and values) are one array `[S + 1, R, G, C, D]`: slots lead so a mesh can shard
them on a data axis, KV heads on a model axis, and a kernel gets a layer as its operand with no slice
copy. The last slot is the padding slot: padding rows point there, so their (empty) writes can never
touch a real slot. A slot holds the written part of the sink, then the ring. With `sink_capacity = 2`,
`window = 6`, a source of 0 and a sink of 2, after 11 written tokens `w0..w10` the slot reads

    offset:   0    1  |  2    3    4    5    6    7
    entry:    w0   w1 |  w8   w9   w10  w5   w6   w7      ring offset = (i - sink) mod window
                  sink   ^ newest ends here; the oldest kept (w5) follows

Nothing is zeroed on reuse: an entry is read only where the plan says it was written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.store import store_step_after
from mstar_jax.checks import check_int
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, store_capacity

__all__ = ["BoundedKVCache", "BoundedKVPlan", "SourceBank", "write_step"]


def _per_layer(shape: tuple[int, ...], dtype, num_layers: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(shape, dtype) for _ in range(num_layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoundedKVCache:
    """Every layer's slots: `k[l]`, `v[l]` of shape `[S + 1, R, G, C, D]` (slot S is for padding)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @staticmethod
    def slot_shape(config: BoundedKVConfig, data_shards: int = 1) -> tuple[int, ...]:
        """One layer's shape: each data shard's `max_slots / data_shards` slots and its padding slot."""
        slots = config.max_slots + data_shards  # see `SlotPools` for the layout
        return (slots, config.rows_per_request, config.num_heads, config.slot_capacity, config.head_dim)

    @classmethod
    def abstract(cls, config: BoundedKVConfig, data_shards: int = 1) -> BoundedKVCache:
        """The cache as `jax.ShapeDtypeStruct` specs, for ahead-of-time compilation (allocates nothing)."""
        layers = _per_layer(cls.slot_shape(config, data_shards), config.dtype, config.num_layers)
        return cls(k=layers, v=layers)

    @classmethod
    def create(cls, config: BoundedKVConfig, data_shards: int = 1) -> BoundedKVCache:
        """Allocate the cache (zeros; contents are never read before they are written)."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cls.abstract(config, data_shards))

    @property
    def padding_slot(self) -> int:
        return self.k[0].shape[0] - 1

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SourceBank:
    """Every layer's registered sources: `k[l]`, `v[l]` of shape `[V, R, G, L, D]`, read in place."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @staticmethod
    def source_shape(config: BoundedKVConfig, num_sources: int) -> tuple[int, ...]:
        length = store_capacity(config.max_source_len, config.head_dim)
        return (num_sources, config.rows_per_request, config.num_heads, length, config.head_dim)

    @classmethod
    def abstract(cls, config: BoundedKVConfig, num_sources: int) -> SourceBank:
        layers = _per_layer(cls.source_shape(config, num_sources), config.dtype, config.num_layers)
        return cls(k=layers, v=layers)

    @classmethod
    def create(cls, config: BoundedKVConfig, num_sources: int) -> SourceBank:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cls.abstract(config, num_sources))

    @property
    def num_sources(self) -> int:
        return self.k[0].shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoundedKVPlan:
    """What device code needs for one step: the int32 plan table `[B, ROW_INTS]` (see `table.py`).

    Attributes:
      table: i32[B, ROW_INTS] the rows' reads and writes; for a block of one-token steps
        (`BoundedKVStep.steps`), i32[steps, B, ROW_INTS], one table per step in order.
      num_tokens: static: T, the step tokens per row the step's arrays must carry (`attend` refuses
        others): a bucketed step's bucket width (1 for each step of a block), else the most tokens a row
        declares; None where nothing is known (a plan built by hand from a table, a step with no real
        rows). Part of the plan's tree structure: a program compiled ahead of time for a bucket takes
        that bucket's plans.
      steps: static: the block's steps (None: one step, a 2-D table).
    """

    table: jax.Array | np.ndarray
    num_tokens: int | None = dataclasses.field(default=None, metadata={"static": True})
    steps: int | None = dataclasses.field(default=None, metadata={"static": True})

    def __post_init__(self):
        n = check_int("num_tokens", self.num_tokens, minimum=1, allow_none=True, numpy=True)
        object.__setattr__(self, "num_tokens", n)  # a static field: hashed, compared, printed
        steps = check_int("steps", self.steps, minimum=1, allow_none=True, numpy=True)
        object.__setattr__(self, "steps", steps)
        shape = getattr(self.table, "shape", None)
        if not isinstance(shape, tuple):
            return  # not an array (a pytree operation's placeholder leaf, a sharding): nothing to check
        want = 2 if steps is None else 3
        if len(shape) != want:
            raise ValueError(
                f"table has shape {shape}; a plan of steps={steps} has a {want}-D table "
                + ("[B, ROW_INTS]" if steps is None else f"[{steps}, B, ROW_INTS]")
            )

    @classmethod
    def abstract(
        cls,
        num_requests: int,
        num_tokens: int | None = None,
        sharding: Any = None,
        *,
        steps: int | None = None,
    ) -> BoundedKVPlan:
        """The plan of a step of `num_requests` rows as an abstract argument for ahead-of-time capture:
        its table a `ShapeDtypeStruct` i32[num_requests, ROW_INTS] (placed by `sharding` if given), e.g.
        for a bucket `BoundedKVPlan.abstract(bucket.bs, bucket.num_tokens)`; with `steps`, a block's
        i32[steps, num_requests, ROW_INTS] (a `sharding` then places its rows, axis 1)."""
        shape = (num_requests, tbl.ROW_INTS) if steps is None else (steps, num_requests, tbl.ROW_INTS)
        table = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        return cls(table, num_tokens=num_tokens, steps=steps)

    def step(self, table: jax.Array) -> BoundedKVPlan:
        """The plan of one of a block's steps, given its table (a slice of this plan's, e.g. in a scan)."""
        return BoundedKVPlan(table, num_tokens=self.num_tokens)

    @property
    def num_requests(self) -> int:
        return self.table.shape[-2]

    def stream_lengths(self) -> jax.Array:
        """i32[B]: `n`, each row's stream length before the step (0 for padding rows)."""
        return jnp.asarray(self.table)[:, tbl.STREAM_LEN]

    def positions(self, num_tokens: int) -> jax.Array:
        """i32[B, T]: the stream position of each row's step token `i`, `n + i` (RoPE's positions).

        Args:
          num_tokens: T, the step arrays' token axis.
        """
        check_int("num_tokens", num_tokens, minimum=0, numpy=True)
        return self.stream_lengths()[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def step_tokens(self) -> jax.Array:
        """i32[B]: each row's real step tokens (0 for padding rows); the rest of the token axis is padding."""
        return jnp.asarray(self.table)[:, tbl.STEP_TOKENS]


@jax.named_scope("bounded_kv_write")
def write_step(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    reverse: bool,
    after: Any = None,
    implementation: str = "auto",
    interpret: Any = False,
) -> tuple[jax.Array, jax.Array, Any]:
    """Store each request's written step tokens into its slot, in place when the cache is donated.

    Equivalent to, for every request `b`, write range `(step_offset, slot_start, len)` and `t < len`:
    `cache[slot_b, :, :, slot_start + t] = step[b, :, step_offset ± t]`. A thin call of
    `kernels_pallas.sink_window_attention.store.store_step_after`: the XLA loop (`store_step_xla`), or the
    Pallas store kernel of the platform the program is lowered for.

    Args:
      cache_k, cache_v: [S + 1, R, G, C, D] one layer's slots.
      k, v: [N, T, G, D] the step's keys and values, N = B * R.
      table: i32[B, ROW_INTS] the plan table.
      reverse: the config's `reverse_step_order` (a range copies step tokens counting down).
      after: values computed from reads of this cache (the attention output), returned unchanged. The XLA
        loop carries them so every read is sequenced before the in-place store (else XLA may order the
        store first and copy the whole layer to keep the reads' view, measured on CPU); the Pallas kernels
        alias the cache, which orders them after its reads.
      implementation: "auto", "xla", "pallas_tpu" or "pallas_gpu" (see `store_step`).
      interpret: passed to the Pallas kernels (True, or `pltpu.InterpretParams` for the TPU kernel).

    Returns:
      The updated (cache_k, cache_v) and `after`.
    """
    return store_step_after(
        cache_k, cache_v, k, v, table, after,
        reverse=reverse, implementation=implementation, interpret=interpret,
    )  # fmt: skip
