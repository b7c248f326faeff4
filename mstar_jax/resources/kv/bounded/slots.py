"""Free slots of a bounded KV cache, in one pool per data shard (docs/design.md §10).

A cache split over `shards` data shards holds, on its slot axis, `shards` blocks of `per_shard` slots
each followed by that shard's padding slot: global slot `g` is local slot `g % (per_shard + 1)` of shard
`g // (per_shard + 1)`, and local slot `per_shard` is the shard's padding slot, never handed out. With one
shard this is the single-device layout: slots `0 .. max_slots - 1`, then the padding slot `max_slots`.
Each pool hands out its lowest free slot first and reuses the last one given back (a stack); new
requests go to the shard with the most free slots, ties taken in turn. In a multi-process deployment a
process hands out only the slots of its own shards (`local_shards`; the others' pools stay empty): it
can write no other slots.
"""

from __future__ import annotations

from collections.abc import Collection

from mstar_jax.checks import is_int

__all__ = ["SlotPools"]


class SlotPools:
    """`slots` slots split evenly into `shards` pools, of which those of the `local` shards hand slots out
    (None: all of them).

    Raises:
      ValueError: when `slots` is not a positive multiple of `shards`, or `local` is not a non-empty
        set of shard indices.
    """

    def __init__(self, slots: int, shards: int = 1, local: Collection[int] | None = None):
        if not is_int(shards) or shards < 1 or slots % shards:
            raise ValueError(
                f"max_slots={slots} must split evenly over data_shards={shards!r} (an int >= 1 dividing it)"
            )
        self.shards, self.per_shard = shards, slots // shards
        self.local_shards = tuple(range(shards)) if local is None else tuple(sorted(set(local)))
        if not self.local_shards or not all(is_int(s) and 0 <= s < shards for s in self.local_shards):
            raise ValueError(
                f"local_data_shards={local!r} must be a non-empty collection of shard indices in "
                f"[0, {shards}) (None: every shard)"
            )
        self.reset()

    @property
    def axis_length(self) -> int:
        """Entries on the cache's slot axis: every shard's slots and its padding slot."""
        return self.shards * (self.per_shard + 1)

    def shard_of(self, slot: int) -> int:
        return slot // (self.per_shard + 1)

    def local(self, slot: int) -> int:
        """`slot`'s index within its shard (what the shard's kernels see)."""
        return slot % (self.per_shard + 1)

    def __len__(self) -> int:
        return sum(len(pool) for pool in self._pools)

    def free_in(self, shard: int) -> int:
        return len(self._pools[shard])

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """Each pool's free slots in hand-out order reversed (for comparing bookkeeping)."""
        return tuple(tuple(pool) for pool in self._pools)

    def least_loaded(self) -> int:
        """The shard with the most free slots; among equals, the next after the last one chosen (so a
        light load spreads over the shards instead of piling onto the first)."""
        return _least_loaded([len(pool) for pool in self._pools], self._next)

    def preview(self, count: int) -> list[int]:
        """The shards the next `count` `take()`s would hand slots out from (as far as slots last)."""
        free, after, shards = [len(pool) for pool in self._pools], self._next, []
        for _ in range(min(count, sum(free))):
            shard = _least_loaded(free, after)
            free[shard] -= 1
            after = (shard + 1) % self.shards
            shards.append(shard)
        return shards

    def take(self, shard: int | None = None) -> int:
        """Hand out a free slot of `shard` (None: of the least loaded shard); returns its global index."""
        shard = self.least_loaded() if shard is None else shard
        pool = self._pools[shard]
        if not pool:
            raise ValueError(f"data shard {shard} has no free slot")
        self._next = (shard + 1) % self.shards
        return pool.pop()

    def give(self, slot: int) -> None:
        self._pools[self.shard_of(slot)].append(slot)

    def reset(self, held: Collection[int] = ()) -> None:
        """Every slot of the local shards free, except those in `held`."""
        width = self.per_shard + 1
        self._next = self.local_shards[0]
        self._pools = [
            [g for g in reversed(range(s * width, s * width + self.per_shard)) if g not in held]
            if s in self.local_shards
            else []
            for s in range(self.shards)
        ]


def _least_loaded(free: list[int], after: int) -> int:
    """The index of the largest of `free`, ties going to the first at or after `after` (cyclically)."""
    shards = len(free)
    return max(range(shards), key=lambda shard: (free[shard], -((shard - after) % shards)))
