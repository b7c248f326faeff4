"""What a deployment holds in one device's memory, and whether that fits the device.

`memory_budget(deployment, device)` adds up, from shapes alone (nothing is allocated):

- the model's weights (`weight_bytes`), stored in the model's dtype;
- every cache's slots, the padding slot included: `BoundedKVCache` allocates `[max_slots + 1, R, G, C, D]`
  per layer, for K and for V;
- every cache's source bank: `SourceBank` allocates `num_sources` entries of `max_source_len` in whole
  tiles, where `num_sources` is what `Engine.from_deployment` gives it (`num_sources`);
- the workspace of the largest bucket (`workspace_bytes`), an upper estimate of one step's activations.

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
import functools
import math
from typing import TYPE_CHECKING

import jax

from mstar_jax.budget import (
    BudgetPart,
    MemoryBudget,
    cache_parts,
    fitted,
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
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, SinkWindow, store_capacity
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
    "parse_size",
    "resource_costs",
    "serving_budget",
    "source_bytes",
    "tree_bytes",
    "weight_bytes",
    "weight_count",
    "workspace_bytes",
]

MIN_SOURCES = 8
"""Source-bank entries `Engine.from_deployment` allocates at least, whatever the workload's voices."""
SAMPLES_PER_FRAME = 1920
"""Audio samples per codec frame (24 kHz at 12.5 Hz): the vocoder's width, `model.SAMPLES_PER_FRAME`."""


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
    """What `deployment` allocates on one device (see the module docstring), against `device`.

    A model config that describes its parameters (`abstract_params()`, e.g. Gemma 3's) is counted by
    `serving_budget` from them and its caches' specs.

    Raises:
      TypeError: for a model whose weights cannot be counted (neither `streaming_tts` nor one with
        `abstract_params()`).
    """
    if hasattr(deployment.model_config, "abstract_params"):
        caches = {
            spec.resource_key: spec.config for spec in deployment.specs if isinstance(spec, BoundedKVSpec)
        }
        budget = serving_budget(
            deployment.model_config.abstract_params(), caches, device, source=deployment.source,
            data=deployment.mesh.data, model=deployment.mesh.model,
        )  # fmt: skip
        return dataclasses.replace(budget, max_batch=deployment.engine.max_batch)
    config = _streaming_tts(deployment)
    caches = [spec for spec in deployment.specs if isinstance(spec, BoundedKVSpec)]
    configs = {spec.resource_key: spec.config for spec in caches}
    sources = num_sources(deployment)
    dtype = config.storage_dtype
    data, model = deployment.mesh.data, deployment.mesh.model

    def parts_at(max_slots: int | None) -> list[BudgetPart]:
        """The parts with every cache's `max_slots` lowered to `max_slots` (None: as given)."""
        batch = deployment.engine.max_batch
        if max_slots is not None:
            batch = min(batch, max_slots)
        weights = BudgetPart(
            label=f"model weights ({weight_count(config):,} x {dtype.name})",
            nbytes=weight_bytes(config),
            remedy="a smaller model (model.config) or a device with more memory",
        )
        tokens, flow_tokens = max(deployment.token_counts), _flow_tokens(deployment)
        workspace = BudgetPart(
            label=f"workspace (largest bucket: {batch} x {tokens} tokens)",
            nbytes=workspace_bytes(
                config, _kv(caches, TALKER_KV), _kv(caches, FLOW_KV), batch, tokens, flow_tokens
            ),
            remedy="fewer tokens per bucket (compile.token_counts) or a smaller engine.max_batch",
        )
        kv = cache_parts(
            configs, max_slots, num_sources=sources, data=data, model=model,
            slot_remedy="shorten the retention of {key} in model.config",
            source_remedy="lower model.config.max_voice_frames",
        )  # fmt: skip
        return [weights, *kv, workspace]

    return fitted(parts_at, configs, device, source=deployment.source, max_batch=deployment.engine.max_batch)


def num_sources(deployment: Deployment) -> int:
    """Source-bank entries per cache, as `Engine.from_deployment` allocates them by default."""
    return max(MIN_SOURCES, deployment.workload.voices)


@functools.cache  # a config is frozen; counting traces the model's modules
def weight_count(config: StreamingTTSConfig) -> int:
    """Parameters of the talker and the flow decoder, counted from the model's own parameters
    (`nnx.eval_shape`: no weight is drawn).

    The modules are traced with one and two layers of each stack, not all of them: every layer of a
    stack has the same parameters, so the count is linear in its layers, and tracing grows faster than
    that (400 layers took minutes)."""
    from mstar_jax.models.streaming_tts.model import abstract_params  # the model's modules, when asked

    def count(talker_layers: int, flow_layers: int) -> int:
        layers = dataclasses.replace(config, talker_layers=talker_layers, flow_layers=flow_layers)
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params(layers)))

    one = count(1, 1)
    talker_layer, flow_layer = count(2, 1) - one, count(1, 2) - one
    return one + (config.talker_layers - 1) * talker_layer + (config.flow_layers - 1) * flow_layer


def weight_bytes(config: StreamingTTSConfig) -> int:
    """Device bytes of the weights: every parameter is stored in the model's dtype."""
    return weight_count(config) * config.storage_dtype.itemsize


def workspace_bytes(
    config: StreamingTTSConfig,
    talker: BoundedKVConfig,
    flow: BoundedKVConfig,
    batch: int,
    tokens: int,
    flow_tokens: int,
) -> int:
    """An upper estimate of the activations of the largest step: the talker's or the flow's, whichever
    is larger (one program runs at a time, and its buffers are freed when it returns).

    Counts one layer's activations at once (XLA frees a layer's buffers before the next): the residual
    stream and its norm, q, k, v and the attention output, and the MLP's hidden units, in the model's
    dtype; the keys and values the XLA attention path gathers per row (`min(K, L) + min(K, C)` of each
    cache's), in its dtype; that path's scores and probabilities over those keys plus the step's own, in
    float32 (the Pallas kernels hold only tiles of them); the talker's logits and sampling noise, and
    the flow's Euler state, noise, velocity, mel and audio samples, in float32. Not counted: the weights
    and caches (their own parts), and per-row tables.

    Args:
      config: the model's geometry.
      talker, flow: the two caches' configs.
      batch: rows of the largest batch bucket (`engine.max_batch`).
      tokens: the talker's largest token bucket (its prefill chunk).
      flow_tokens: the flow's token bucket (the smallest holding a flow chunk).
    """
    itemsize, f32 = config.storage_dtype.itemsize, 4
    # The talker runs `batch` prefill rows of `tokens`, or a combined step: `batch` decode rows beside
    # the engine's one prefill row (`Engine.from_deployment(max_prefill_rows_in_combined=1)`).
    rows, token_rows = batch + 1, max(batch * tokens, batch + tokens)
    e, heads, dim = config.d_model, config.talker_heads, config.talker_head_dim
    groups = config.talker_kv_heads
    keys = _gathered_keys(talker)
    talker_bytes = (
        token_rows * (4 * e + (2 * heads + 2 * groups) * dim + 3 * config.talker_ffn_dim) * itemsize
        + 2 * rows * groups * keys * dim * talker.dtype.itemsize
        + 2 * token_rows * heads * (keys + tokens) * f32
        + 2 * rows * config.codec_vocab_size * f32
    )
    # The flow runs two rows per request (classifier-free guidance).
    rows, token_rows = 2 * batch, 2 * batch * flow_tokens
    e, heads, dim = config.flow_d_model, config.flow_heads, config.flow_head_dim
    keys = _gathered_keys(flow)
    flow_bytes = (
        token_rows * (5 * e + 4 * heads * dim + 2 * 4 * e) * itemsize
        + 2 * rows * heads * keys * dim * flow.dtype.itemsize
        + 2 * token_rows * heads * (keys + flow_tokens) * f32
        + 6 * batch * flow_tokens * config.mel_bins * f32
        + batch * flow_tokens * SAMPLES_PER_FRAME * f32
    )
    return max(talker_bytes, flow_bytes)


def _gathered_keys(config: BoundedKVConfig) -> int:
    """Keys the XLA attention path gathers per row: from the source bank, then from the slot."""
    source = store_capacity(config.max_source_len, config.head_dim)
    return min(config.max_retained, source) + min(config.max_retained, config.slot_capacity)


# -- the device -------------------------------------------------------------------------------------


def _streaming_tts(deployment: Deployment) -> StreamingTTSConfig:
    if not isinstance(deployment.model_config, StreamingTTSConfig):
        raise TypeError(
            f"memory_budget counts the weights of streaming_tts only; model {deployment.model!r} has a "
            f"{type(deployment.model_config).__name__}"
        )
    return deployment.model_config


def _kv(specs: list[BoundedKVSpec], key: str) -> BoundedKVConfig:
    return next(spec.config for spec in specs if spec.resource_key == key)


def _flow_tokens(deployment: Deployment) -> int:
    """The flow's token bucket: the smallest token count holding a flow chunk (`tts_buckets`)."""
    chunk = deployment.model_config.flow_chunk
    return min(t for t in deployment.token_counts if t >= chunk)
