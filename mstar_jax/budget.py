"""A budget of device memory: its parts against what the device has, and the budget of any model served
on bounded caches.

`serving_budget(params, caches, device)` adds up, from shapes alone (nothing is allocated), the weights
(the bytes of the model's own parameters: a pytree, abstract or not, e.g. from `nnx.eval_shape`), and per
cache its slots (the padding slot included) and its source bank, from its config. A deployment's budget
(`mstar_jax.memory.memory_budget`) adds the workspace and a mesh's shares.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from mstar_jax.checks import check_int
from mstar_jax.devices import DeviceMemory, DeviceMemoryError, format_bytes
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, store_capacity

__all__ = [
    "BudgetPart",
    "MemoryBudget",
    "cache_parts",
    "fitted",
    "heads_per_device",
    "serving_budget",
    "source_bytes",
    "tree_bytes",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BudgetPart:
    """One line of the budget.

    Attributes:
      label: what it is, e.g. `talker_kv slots (64 + 1 padding)`.
      nbytes: device bytes it takes.
      remedy: which settings shrink it.
    """

    label: str
    nbytes: int
    remedy: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBudget:
    """What a deployment allocates on its device, part by part, against the device's memory.

    Attributes:
      source: the deployment's source (its path), for messages.
      parts: weights, each cache's slots and source bank, and the workspace.
      device: the device's memory.
      max_fitting_slots: the largest `max_slots` (for every cache, with `engine.max_batch` at most that)
        that fits, when the deployment does not fit as given; None when it fits, or when even one slot
        per cache does not.
      blocker: where even one slot per cache does not fit, the largest part with one slot per cache.
      max_batch: the deployment's `engine.max_batch`.
      slot_keys: the caches whose `max_slots` the fix lowers (those above `max_fitting_slots`).
    """

    source: str
    parts: tuple[BudgetPart, ...]
    device: DeviceMemory
    max_fitting_slots: int | None
    blocker: BudgetPart | None
    max_batch: int
    slot_keys: tuple[str, ...]

    @property
    def total(self) -> int:
        """Bytes of every part together."""
        return sum(part.nbytes for part in self.parts)

    @property
    def fits(self) -> bool:
        """Whether the total is within the device's memory."""
        return self.total <= self.device.nbytes

    def require_fit(self) -> None:
        """Return if the deployment fits its device.

        Raises:
          DeviceMemoryError: giving every part, the total, the device's memory and the fix: the
            `max_slots` that fits, or, where no slot count fits, the largest part and what shrinks it.
        """
        if self.fits:
            return
        parts = " + ".join(f"{part.label} {format_bytes(part.nbytes)}" for part in self.parts)
        message = (
            f"{self.source}: the deployment needs {parts} = {format_bytes(self.total)}, more than the device "
            f"memory {format_bytes(self.device.nbytes)} ({self.device.source}); "
        )
        if self.max_fitting_slots is not None:
            keys = " and ".join(f"resources.{key}.max_slots" for key in self.slot_keys)
            message += f"lower {keys} to {self.max_fitting_slots}"
            if self.max_fitting_slots < self.max_batch:
                message += f" and engine.max_batch to {self.max_fitting_slots}"
        else:
            message += (
                f"it does not fit even with one slot per cache, where the largest part is "
                f"{self.blocker.label} ({format_bytes(self.blocker.nbytes)}): {self.blocker.remedy}"
            )
        raise DeviceMemoryError(message)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array in `tree`, from its leaves' shapes and dtypes alone (nothing is read or
    allocated): arrays, or their `jax.ShapeDtypeStruct`s from `jax.eval_shape` or `nnx.eval_shape`.

    Raises:
      TypeError: naming the first leaf that has no shape and dtype.
    """
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"leaf {jax.tree_util.keystr(path) or '(the root)'}={leaf!r} of the tree has no shape and "
                "dtype; pass arrays or jax.ShapeDtypeStruct leaves (e.g. from nnx.eval_shape)"
            )
        total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return total


def serving_budget(
    params: Any,
    caches: Mapping[str, BoundedKVConfig],
    device: DeviceMemory,
    *,
    num_sources: int = 1,
    source: str = "the model",
    data: int = 1,
    model: int = 1,
) -> MemoryBudget:
    """What serving a model on bounded caches allocates on one device, against `device`.

    The parts: the weights (`tree_bytes(params)`, replicated on every device of a mesh), then per cache
    its slots and the padding slot (`cache_parts`) and its source bank of `num_sources` entries. Where it
    does not fit, `max_fitting_slots` is the largest `max_slots` (for every cache) that does, and
    `blocker` the largest part where not even one slot fits. Activations are not counted. `require_fit`
    words its fix as a deployment's (`resources.<key>.max_slots`); a command names its own option from
    `max_fitting_slots` (`mstar-jax generate` names `--max-slots`).

    Args:
      params: the model's parameters, any pytree of arrays or `jax.ShapeDtypeStruct`s.
      caches: each cache's key and config.
      device: the memory to fit (`device_memory()`, or a size the user gave).
      num_sources: source-bank entries each cache allocates.
      source: what is served (a file, a model), for messages.
      data, model: the mesh's data and model shards (one device: 1 and 1).

    Raises:
      TypeError: for a cache config that is not a `BoundedKVConfig`, or a params leaf without a shape.
      ValueError: for no caches, or `num_sources` below 1.
    """
    if not caches:
        raise ValueError("caches={} must name at least one cache (key -> BoundedKVConfig)")
    for key, config in caches.items():
        if not isinstance(config, BoundedKVConfig):
            raise TypeError(f"caches[{key!r}]={config!r} must be a BoundedKVConfig")
    check_int("num_sources", num_sources, minimum=1)
    nbytes = tree_bytes(params)  # first: it names a leaf without a shape
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    weights = BudgetPart(
        label=f"model weights ({count:,} parameters)",
        nbytes=nbytes,
        remedy="a smaller model or dtype, or a device with more memory",
    )

    def parts_at(max_slots: int | None) -> list[BudgetPart]:
        return [weights, *cache_parts(caches, max_slots, num_sources=num_sources, data=data, model=model)]

    return fitted(parts_at, caches, device, source=source, max_batch=1)  # no engine batch to lower


def cache_parts(
    caches: Mapping[str, BoundedKVConfig],
    max_slots: int | None,
    *,
    num_sources: int,
    data: int = 1,
    model: int = 1,
    slot_remedy: str = "retain fewer tokens",
    source_remedy: str = "",
) -> list[BudgetPart]:
    """One device's slots of every cache (its data shard's, and its padding slot; its share of the KV
    heads), then every cache's source bank, with `max_slots` lowered to `max_slots` (None: as given).

    Args:
      slot_remedy, source_remedy: what a user changes to shrink a slot, a source (after the sizes);
        `{key}` names the cache.
    """
    parts = []
    for key, kv in caches.items():
        slots = kv.max_slots if max_slots is None else min(kv.max_slots, max_slots)
        local = -(-slots // data)  # this device's data shard: its slots and its padding slot
        heads = heads_per_device(kv, model)
        label = f"{key} slots ({slots:,} + 1 padding)"
        if data * model > 1:
            label = (
                f"{key} slots per device ({local:,} + 1 padding of {data} pools, {heads} of "
                f"{kv.num_heads} KV heads)"
            )
        remedy = (
            f"one slot is {format_bytes(kv.slot_bytes)} ({kv.slot_tokens:,} tokens): "
            + slot_remedy.format(key=key)
        )
        parts.append(
            BudgetPart(label=label, nbytes=(local + 1) * kv.slot_bytes * heads // kv.num_heads, remedy=remedy)
        )
    for key, kv in caches.items():
        heads = heads_per_device(kv, model)
        per_device = f", {heads} of {kv.num_heads} KV heads per device" if model > 1 else ""
        remedy = f"each source holds max_source_len={kv.max_source_len:,} entries"
        parts.append(
            BudgetPart(
                label=f"{key} source bank ({num_sources} sources{per_device})",
                nbytes=num_sources * source_bytes(kv) * heads // kv.num_heads,
                remedy=remedy + (f": {source_remedy}" if source_remedy else ""),
            )
        )
    return parts


def fitted(
    parts_at: Callable[[int | None], list[BudgetPart]],
    caches: Mapping[str, BoundedKVConfig],
    device: DeviceMemory,
    *,
    source: str,
    max_batch: int,
) -> MemoryBudget:
    """The budget of `parts_at(None)` against `device`; where it does not fit, the most `max_slots` that
    do (the total grows with them: bisected over `parts_at(n)`) or, if not even one, the largest part."""
    parts = parts_at(None)
    fitting = blocker = None
    if sum(part.nbytes for part in parts) > device.nbytes:
        low, high = 0, max(kv.max_slots for kv in caches.values())
        while low < high:
            mid = (low + high + 1) // 2
            if sum(part.nbytes for part in parts_at(mid)) <= device.nbytes:
                low = mid
            else:
                high = mid - 1
        fitting = low or None
        if fitting is None:
            blocker = max(parts_at(1), key=lambda part: part.nbytes)
    return MemoryBudget(
        source=source,
        parts=tuple(parts),
        device=device,
        max_fitting_slots=fitting,
        blocker=blocker,
        max_batch=max_batch,
        slot_keys=tuple(key for key, kv in caches.items() if fitting is not None and kv.max_slots > fitting),
    )


def heads_per_device(config: BoundedKVConfig, model: int) -> int:
    """KV heads one device stores: its share of the heads, or one copy where heads are replicated."""
    return max(config.num_heads, model) // model


def source_bytes(config: BoundedKVConfig) -> int:
    """Device bytes of one source-bank entry: K and V, every layer and row, `max_source_len` in tiles."""
    per_entry = config.rows_per_request * config.num_heads * 2 * config.head_dim * config.dtype.itemsize
    return config.num_layers * store_capacity(config.max_source_len, config.head_dim) * per_entry
