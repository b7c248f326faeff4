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
from jax import lax

from kernels_pallas.sink_window_attention import table as tbl
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
    def slot_shape(config: BoundedKVConfig) -> tuple[int, ...]:
        tokens = config.slot_capacity
        return (config.max_slots + 1, config.rows_per_request, config.num_heads, tokens, config.head_dim)

    @classmethod
    def abstract(cls, config: BoundedKVConfig) -> BoundedKVCache:
        """The cache as `jax.ShapeDtypeStruct`s, for ahead-of-time compilation (allocates nothing)."""
        layers = _per_layer(cls.slot_shape(config), config.dtype, config.num_layers)
        return cls(k=layers, v=layers)

    @classmethod
    def create(cls, config: BoundedKVConfig) -> BoundedKVCache:
        """Allocate the cache (zeros; contents are never read before they are written)."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cls.abstract(config))

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
        length = store_capacity(config.max_source_len)
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
    """What device code needs for one step: the int32 plan table `[B, ROW_INTS]` (see `table.py`)."""

    table: jax.Array | np.ndarray

    @property
    def num_requests(self) -> int:
        return self.table.shape[0]


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
) -> tuple[jax.Array, jax.Array, Any]:
    """Store each request's written step tokens into its slot, in place when the cache is donated.

    Equivalent to, for every request `b`, write range `(step_offset, slot_start, len)` and `t < len`:
    `cache[slot_b, :, :, slot_start + t] = step[b, :, step_offset ± t]`.

    Each write range becomes one read-modify-write of a `min(T, C)`-token block with
    `lax.dynamic_update_slice` inside a `fori_loop`. The block start is clamped into the slot and the
    range placed inside it explicitly, because `dynamic_update_slice` would otherwise clamp silently and
    overwrite the wrong entries; ranges never cross the ring's wrap (the plan splits them there). A
    `vmap`-ed per-row update would lower to a scatter plus a full copy of the cache; this costs
    O(B * min(T, C)) entries per layer. (XLA:CPU is the exception for bfloat16 caches: it converts
    the layer to update it, copying it whole per range; keep CPU caches in float32.)

    Args:
      cache_k, cache_v: [S + 1, R, G, C, D] one layer's slots.
      k, v: [N, T, G, D] the step's keys and values, N = B * R.
      table: i32[B, ROW_INTS] the plan table.
      reverse: the config's `reverse_step_order` (a range copies step tokens counting down).
      after: values computed from reads of this cache (the attention output), returned unchanged. They
        ride in the loop's carry so every read is sequenced before the in-place store; otherwise XLA
        may order the store first and copy the whole layer to keep the reads' view (measured on CPU).

    Returns:
      The updated (cache_k, cache_v) and `after`.
    """
    table = jnp.asarray(table)  # the loop indexes it with a traced row
    num_requests = table.shape[0]
    _, rows, groups, capacity, dim = cache_k.shape
    steps = k.shape[1]
    block = min(steps, capacity)
    # [B, R, G, T, D]: a request's rows and heads move together into its slot.
    k_req = k.reshape(num_requests, rows, steps, groups, dim).transpose(0, 1, 3, 2, 4).astype(cache_k.dtype)
    v_req = v.reshape(num_requests, rows, steps, groups, dim).transpose(0, 1, 3, 2, 4).astype(cache_v.dtype)
    offsets = jnp.arange(block, dtype=jnp.int32)

    def store_range(i, carry):
        ck, cv, after = carry
        b, w = i // tbl.NUM_WRITES, i % tbl.NUM_WRITES
        row = table[b]
        base = tbl.WRITES + 3 * w
        step_offset, slot_start, length = row[base], row[base + 1], row[base + 2]
        start = jnp.clip(slot_start, 0, capacity - block)
        t = offsets - (slot_start - start)  # index of each block entry within the range
        token = step_offset - t if reverse else step_offset + t
        token = jnp.clip(token, 0, steps - 1)
        inside = ((t >= 0) & (t < length))[None, None, :, None]
        corner = (row[tbl.SLOT], 0, 0, start, 0)
        size = (1, rows, groups, block, dim)
        new_k = jnp.take(lax.dynamic_index_in_dim(k_req, b, keepdims=False), token, axis=2)
        new_v = jnp.take(lax.dynamic_index_in_dim(v_req, b, keepdims=False), token, axis=2)
        old_k = lax.dynamic_slice(ck, corner, size)[0]
        old_v = lax.dynamic_slice(cv, corner, size)[0]
        ck = lax.dynamic_update_slice(ck, jnp.where(inside, new_k, old_k)[None], corner)
        cv = lax.dynamic_update_slice(cv, jnp.where(inside, new_v, old_v)[None], corner)
        # Opaque to XLA, so `after` is not a loop invariant it could hoist out of the carry.
        return ck, cv, lax.optimization_barrier(after)

    return lax.fori_loop(0, num_requests * tbl.NUM_WRITES, store_range, (cache_k, cache_v, after))
