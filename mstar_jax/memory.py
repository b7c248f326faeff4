"""What a deployment holds in one device's memory, and whether that fits the device.

`memory_budget(deployment, device)` adds up, from shapes alone (nothing is allocated), by the count its
model registers (`ModelEntry.memory`; the streaming TTS model's is `models/streaming_tts/memory.py`):

- the model's weights, stored in the model's dtype;
- every cache's slots, the padding slot included: `BoundedKVCache` allocates `[max_slots + 1, R, G, C, D]`
  per layer, for K and for V;
- every cache's source bank: `SourceBank` allocates `num_sources` entries of `max_source_len` in whole
  tiles, where `num_sources` is what `Engine.from_deployment` gives it (`num_sources`);
- the workspace of the largest bucket, an upper estimate of one step's activations, where the model
  estimates one.

`serving_budget(params, caches, device)` (`mstar_jax.budget`, re-exported here) is the same count for
any model served on bounded caches without a deployment (`mstar-jax generate`).

On a mesh (`mesh: {data, model}`, docs/design.md §10) each part is one device's share: its data shard's
slots and padding slot, and its share of the KV heads (one copy where heads are replicated) in the slots
and the source bank; the weights and the workspace are counted whole, as the model is not sharded yet.
The total is compared with one device's memory (`device_memory`): the allocator's `bytes_limit` where an
accelerator reports one, else the host's RAM (a CPU device allocates there), or the size given on the
command line (`mstar-jax check --device-memory 16GiB`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mstar_jax.budget import (
    BudgetPart,
    MemoryBudget,
    serving_budget,
    source_bytes,
    tree_bytes,
)
from mstar_jax.devices import (
    DeviceMemory,
    DeviceMemoryError,
    device_memory,
    format_bytes,
    host_memory,
    parse_size,
)
from mstar_jax.registry import model_entry
from mstar_jax.resources.kv.bounded.config import BoundedKVSpec, SinkWindow, store_capacity
from mstar_jax.resources.spec import NodeResourceSpec

if TYPE_CHECKING:  # for annotations only: `Deployment.costs` calls this module, so it must not import back
    from mstar_jax.deployment import Deployment

__all__ = [
    "BudgetPart",
    "DeviceMemory",
    "DeviceMemoryError",
    "MemoryBudget",
    "ResourceCosts",
    "device_memory",
    "format_bytes",
    "host_memory",
    "memory_budget",
    "num_sources",
    "params_budget",
    "parse_size",
    "resource_costs",
    "serving_budget",
    "source_bytes",
    "tree_bytes",
]

MIN_SOURCES = 8
"""Source-bank entries `Engine.from_deployment` allocates at least, whatever the workload's voices."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ResourceCosts:
    """What one bounded KV resource is and what it costs in device memory.

    Attributes:
      key: the resource key.
      nodes: the nodes that use it, sorted.
      layers, kv_heads, head_dim, rows_per_request, dtype: the cache's geometry.
      min_source_len, max_source_len: the source (voice prompt) lengths a request may read.
      retention_at_min, retention_at_max: retention at those two lengths.
      max_slots: requests held at once.
      sink_capacity, window_capacity, slot_tokens, max_retained: the config's derived sizes.
      slot_bytes: bytes of one slot (K and V, every layer and row).
      all_slots_bytes: bytes of all `max_slots` slots.
      source_bytes: bytes one registered source (a voice prompt of `max_source_len`) takes in the
        source bank, shared by every request that reads it.
    """

    key: str
    nodes: tuple[str, ...]
    layers: int
    kv_heads: int
    head_dim: int
    rows_per_request: int
    dtype: str
    min_source_len: int
    max_source_len: int
    retention_at_min: SinkWindow
    retention_at_max: SinkWindow
    max_slots: int
    sink_capacity: int
    window_capacity: int
    slot_tokens: int
    max_retained: int
    slot_bytes: int
    all_slots_bytes: int
    source_bytes: int


def resource_costs(spec: NodeResourceSpec) -> ResourceCosts:
    """The geometry and device-memory cost of a bounded KV spec.

    Raises:
      TypeError: for a spec that is not a `BoundedKVSpec` (the only resource with a slot geometry).
    """
    if not isinstance(spec, BoundedKVSpec):
        raise TypeError(
            f"resource_costs needs a BoundedKVSpec; {spec.resource_key!r} is a {type(spec).__name__}"
        )
    config = spec.config
    per_entry = config.rows_per_request * config.num_heads * 2 * config.head_dim * config.dtype.itemsize
    return ResourceCosts(
        key=spec.resource_key,
        nodes=tuple(sorted(spec.nodes)),
        layers=config.num_layers,
        kv_heads=config.num_heads,
        head_dim=config.head_dim,
        rows_per_request=config.rows_per_request,
        dtype=config.dtype.name,
        min_source_len=config.min_source_len,
        max_source_len=config.max_source_len,
        retention_at_min=config.retention_for(config.min_source_len),
        retention_at_max=config.retention_for(config.max_source_len),
        max_slots=config.max_slots,
        sink_capacity=config.sink_capacity,
        window_capacity=config.window_capacity,
        slot_tokens=config.slot_tokens,
        max_retained=config.max_retained,
        slot_bytes=config.slot_bytes,
        all_slots_bytes=config.slot_bytes * config.max_slots,
        source_bytes=config.num_layers * store_capacity(config.max_source_len, config.head_dim) * per_entry,
    )


def memory_budget(deployment: Deployment, device: DeviceMemory) -> MemoryBudget:
    """What `deployment` allocates on one device (see the module docstring), against `device`: its
    model's count (`ModelEntry.memory`)."""
    return model_entry(deployment.model).function("memory")(deployment, device)


def params_budget(deployment: Deployment, params: Any, device: DeviceMemory) -> MemoryBudget:
    """`serving_budget` of a deployment's model described by its abstract parameters `params` and its
    bounded caches' specs (a model without a workspace estimate of its own)."""
    caches = {spec.resource_key: spec.config for spec in deployment.specs if isinstance(spec, BoundedKVSpec)}
    budget = serving_budget(
        params,
        caches,
        device,
        source=deployment.source,
        data=deployment.mesh.data,
        model=deployment.mesh.model,
    )
    return dataclasses.replace(budget, max_batch=deployment.engine.max_batch)


def num_sources(deployment: Deployment) -> int:
    """Source-bank entries per cache, as `Engine.from_deployment` allocates them by default."""
    return max(MIN_SOURCES, deployment.workload.voices)
