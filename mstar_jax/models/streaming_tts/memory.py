"""The streaming TTS model's device memory: its weights, counted from its own parameters, and the
workspace of its largest step, beside every cache's slots and source bank (`mstar_jax.memory`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax

from mstar_jax.budget import BudgetPart, MemoryBudget, cache_parts, fitted
from mstar_jax.devices import DeviceMemory
from mstar_jax.memory import num_sources
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, store_capacity

if TYPE_CHECKING:
    from mstar_jax.deployment import Deployment

__all__ = ["memory_budget", "weight_bytes", "weight_count", "workspace_bytes"]

SAMPLES_PER_FRAME = 1920
"""Audio samples per codec frame (24 kHz at 12.5 Hz): the vocoder's width, `model.SAMPLES_PER_FRAME`."""


def memory_budget(deployment: Deployment, device: DeviceMemory) -> MemoryBudget:
    """What a streaming TTS `deployment` allocates on one device (`mstar_jax.memory`), against `device`."""
    config = deployment.model_config
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


def _kv(specs: list[BoundedKVSpec], key: str) -> BoundedKVConfig:
    return next(spec.config for spec in specs if spec.resource_key == key)


def _flow_tokens(deployment: Deployment) -> int:
    """The flow's token bucket: the smallest token count holding a flow chunk (`tts_buckets`)."""
    chunk = deployment.model_config.flow_chunk
    return min(t for t in deployment.token_counts if t >= chunk)
