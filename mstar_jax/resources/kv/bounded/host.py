"""Host copies of a bounded KV cache: one request's slot (offload and reload), or the whole cache and
its bookkeeping (a snapshot, restored after a device fault).

`HostCopies` is the part of `BoundedKVManager` that moves state between the device and host memory; it
reads and writes the manager's records, free list and reader counts.

In a multi-process deployment each process copies, and restores, only what its own devices hold
(`to_host`, `to_devices`): its data shards' slots and its own requests' records. Its snapshot holds
zeros where another process's shards are, which no step of its own ever reads. A slot is offloaded and
reloaded there through the process's own shards of each layer (`_read_slot`, `_write_slot`), with no
program over the global cache, which every process would have to enter.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mstar_jax.resources.kv.bounded.cache import BoundedKVCache
from mstar_jax.resources.kv.bounded.config import SinkWindow, StreamPosition

__all__ = ["BoundedKVSnapshot", "HostCopies", "RequestRecord", "to_devices", "to_host"]


def to_host(array: Any) -> np.ndarray:
    """`array` in host memory at its global shape, holding what this process's devices hold (zeros
    where only another process's devices do)."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return jax.device_get(array)
    out = np.zeros(array.shape, array.dtype)
    for shard in array.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def to_devices(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """`host` placed as `sharding` says; a sharding over other processes' devices too takes only this
    process's parts of `host` (no program runs, so no other process needs to join)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@dataclasses.dataclass
class RequestRecord:
    """One request's host record. `slot` is None until its first admitted step (and while offloaded).

    `admitted` is the (position, span) of its admitted step not yet committed or aborted: the only
    step `plan` and `commit` accept for it.
    """

    slot: int | None = None
    written: int = 0
    source: int | None = None
    source_len: int | None = None
    policy: SinkWindow | None = None
    host_copy: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # (k, v) per layer, when offloaded
    admitted: tuple[StreamPosition, int] | None = None


@partial(jax.jit, donate_argnums=0)
def _store_slot(cache: BoundedKVCache, slot, k, v) -> BoundedKVCache:
    return BoundedKVCache(
        k=tuple(layer.at[slot].set(new) for layer, new in zip(cache.k, k, strict=True)),
        v=tuple(layer.at[slot].set(new) for layer, new in zip(cache.v, v, strict=True)),
    )


_copy_layer = jax.jit(jnp.copy)


@jax.jit
def _load_slot(cache: BoundedKVCache, slot):
    return [layer[slot] for layer in cache.k], [layer[slot] for layer in cache.v]


# One shard's row, read or written; the row traced, so no slot compiles a program of its own.
_shard_row = jax.jit(lambda shard, row: shard[row])
_set_shard_row = jax.jit(lambda shard, row, new: shard.at[row].set(new))


def _holding(layer: jax.Array, slot: int):
    """This process's shards of `layer` that hold row `slot`, each with the row's index in it."""
    for shard in layer.addressable_shards:
        start, stop, _ = shard.index[0].indices(layer.shape[0])
        if start <= slot < stop:
            yield shard, slot - start


def _read_slot(layer: jax.Array, slot: int) -> np.ndarray:
    """Row `slot` of a layer whose slot lives on this process's devices, from its own shards."""
    out = np.zeros(layer.shape[1:], layer.dtype)
    for shard, row in _holding(layer, slot):
        out[shard.index[1:]] = np.asarray(_shard_row(shard.data, np.int32(row)))
    return out


def _write_slot(layer: jax.Array, slot: int, new: np.ndarray) -> jax.Array:
    """`layer` with row `slot` (on this process's devices) set to `new`, shard by shard."""
    rows = {shard.device: row for shard, row in _holding(layer, slot)}
    parts = [
        _set_shard_row(shard.data, np.int32(rows[shard.device]), new[shard.index[1:]])
        if shard.device in rows else shard.data
        for shard in layer.addressable_shards
    ]  # fmt: skip
    return jax.make_array_from_single_device_arrays(layer.shape, layer.sharding, parts)


@dataclasses.dataclass(frozen=True)
class BoundedKVSnapshot:
    """The whole cache in host memory and every request's record, taken between steps.

    Attributes:
      cache: the device cache's arrays, copied to the host.
      requests: each request's record (slot, written, source, policy, host copy) when it was taken.
    """

    cache: BoundedKVCache
    requests: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.cache))


class HostCopies:
    """Offload, reload, snapshot and recovery of a bounded cache's slots.

    Args:
      config: the cache's storage config (the cache recovery rebuilds).
      requests: the manager's request records (read and updated in place).
      slots: the manager's slot pools.
      readers: the manager's live readers per source (recounted in place by `recover`).
      get_cache, set_cache: the manager's device cache (`BoundedKVManager.cache`).
    """

    def __init__(
        self,
        *,
        config: Any,
        requests: dict[str, RequestRecord],
        slots: Any,
        readers: Counter[int],
        get_cache: Callable[[], BoundedKVCache],
        set_cache: Callable[[BoundedKVCache], None],
    ):
        self._config, self._requests, self._slots, self._readers = config, requests, slots, readers
        self._get_cache, self._set_cache = get_cache, set_cache

    def is_offloaded(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request.host_copy is not None

    def offload(self, request_id: str) -> int:
        """Copy the request's slot to host memory and free the slot; return the device bytes reclaimed."""
        request = self._requests.get(request_id)
        if request is None or request.slot is None:
            return 0
        cache = self._get_cache()
        if all(layer.is_fully_addressable for layer in cache.k):
            k, v = jax.device_get(_load_slot(cache, jnp.int32(request.slot)))
        else:  # another process's devices hold shards too (module doc)
            k, v = ([_read_slot(layer, request.slot) for layer in layers] for layers in (cache.k, cache.v))
        request.host_copy = (k, v)
        self._slots.give(request.slot)
        request.slot = None
        return self._get_cache().nbytes // self._slots.axis_length

    def reload(self, request_id: str) -> bool:
        """Bring an offloaded request back into a free slot, bit-exactly; False while none is free."""
        request = self._requests.get(request_id)
        if request is None or request.host_copy is None:
            return True
        if not len(self._slots):
            return False
        slot = self._slots.take()
        k, v = request.host_copy
        try:
            cache = self._get_cache()
            if all(layer.is_fully_addressable for layer in cache.k):
                self._set_cache(_store_slot(cache, jnp.int32(slot), k, v))
            else:
                self._set_cache(BoundedKVCache(
                    k=tuple(_write_slot(layer, slot, new) for layer, new in zip(cache.k, k, strict=True)),
                    v=tuple(_write_slot(layer, slot, new) for layer, new in zip(cache.v, v, strict=True)),
                ))  # fmt: skip
        except BaseException:  # no cache to store into (handed out, or lost): the request stays offloaded
            self._slots.give(slot)
            raise
        request.slot, request.host_copy = slot, None
        return True

    def cache_lost(self) -> bool:
        """True when a buffer of the device cache is gone (donated to a step that then failed)."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self._get_cache()))

    def snapshot(self) -> BoundedKVSnapshot:
        """Copy the cache and every request's record to host memory (between steps)."""
        records = {rid: dataclasses.replace(r, admitted=None) for rid, r in self._requests.items()}
        # Read through a device copy, a layer at a time: reading the cache's own buffers would pin them to
        # the host array (on CPU), and a pinned buffer is not donated, so every later step would copy it.
        cache = jax.tree.map(lambda layer: to_host(_copy_layer(layer)), self._get_cache())
        return BoundedKVSnapshot(cache, records)

    def recover(self, snapshot: BoundedKVSnapshot | None = None, restore: Collection[str] = ()) -> list[str]:
        """Rebuild the device cache after a fault lost it; return the requests whose state was lost.

        Every request that held a slot lost its entries. Those named in `restore` that `snapshot` holds
        get their snapshot record back, their slot's entries included (the caller replays their steps
        since); the others are forgotten (the caller fails them, or ingests them again to start over).
        Offloaded requests keep their host copies. Without a snapshot the cache starts empty. A restored
        request goes back to its slot, so to its data shard.
        """
        lost = [rid for rid, r in self._requests.items() if r.slot is not None]
        # Where the lost cache lived (a mesh).
        shardings = jax.tree.map(lambda x: x.sharding, self._get_cache())
        if snapshot is None:
            fresh = BoundedKVCache.abstract(self._config, self._slots.shards)
            self._set_cache(
                jax.tree.map(lambda s, where: to_devices(np.zeros(s.shape, s.dtype), where), fresh, shardings)
            )
        else:
            self._set_cache(jax.tree.map(to_devices, snapshot.cache, shardings))
        for rid in lost:
            saved = snapshot.requests.get(rid) if snapshot is not None and rid in restore else None
            if saved is None:
                del self._requests[rid]
            else:
                self._requests[rid] = dataclasses.replace(saved)
        # Only restored records hold slots now, and they all come from one snapshot: no slot is held twice.
        held = {r.slot for r in self._requests.values() if r.slot is not None}
        self._slots.reset(held)
        self._readers.clear()  # the manager's own counter, recounted
        self._readers.update(r.source for r in self._requests.values() if r.source_len)
        return lost
