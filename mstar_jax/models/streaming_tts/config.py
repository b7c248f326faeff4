"""Geometry of the streaming TTS model: an autoregressive talker and a chunked flow decoder.

The **talker** turns text tokens into codec frames (12.5 Hz, one frame per step once prefill is
done). Its stream is the voice prompt (the shared source prefix: the voice's keys, registered once
and read by every request that speaks with that voice), then the text and the frames it writes.
It keeps the whole voice plus `talker_sink_extra` written tokens as the sink and the last
`talker_window` entries as the window; `query_window` makes chunked prefill causal.

The **flow decoder** (in the style of Step-Audio 2's token2wav DiT) turns codec frames into mel
frames, `flow_chunk` frames per step, every chunk attending itself bidirectionally. It runs two rows
per request (conditional and unconditional, for classifier-free guidance), keeps the voice prompt as
the sink and the last `flow_window` frames as the window, and writes each chunk last-first
(`reverse_step_order`), so when the window cuts into the oldest chunk it keeps that chunk's front.
The flow runs at the codec frame rate: a flow frame is a codec frame, decoded into `mel_bins` values.

Both caches take their source length from the voice prompt: `[min_voice_frames, max_voice_frames]`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from mstar_jax.checks import INT32_MAX, check_choice, check_int
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, SinkWindow
from mstar_jax.resources.spec import NodeResourceSpec, register_static_pytree

__all__ = ["DTYPES", "StreamingTTSConfig"]

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""Names a config's `dtype` may take, and the storage dtype each means."""


def _voice_sink_retention(source_len: int, *, extra: int, window: int) -> SinkWindow:
    """Sink = the whole voice prompt plus `extra` written tokens; then `window` recent entries."""
    return SinkWindow(source_len + extra, window)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StreamingTTSConfig:
    """Frozen geometry of the streaming TTS model; every field is validated at construction.

    Attributes:
      text_vocab_size: text tokens the talker reads.
      codec_vocab_size: codec tokens per frame the talker emits (one codebook).
      d_model: talker residual width.
      talker_layers: talker transformer layers.
      talker_heads: talker query heads (a multiple of `talker_kv_heads`: GQA).
      talker_kv_heads: talker K/V heads stored in its cache.
      talker_head_dim: size of each talker key, value and query vector.
      talker_ffn_dim: hidden width of the talker's feed-forward blocks.
      min_voice_frames: shortest voice prompt (the shared source prefix), in frames.
      max_voice_frames: longest voice prompt, in frames.
      talker_sink_extra: written tokens kept after the voice in the talker's sink (the first text
        tokens, StreamingLLM's attention sinks).
      talker_window: most recent talker entries kept.
      query_window: causal band, in positions, of each talker query; at most `talker_window + 1` so
        that a chunked prefill attends exactly what token-by-token decoding would.
      flow_d_model: flow decoder residual width.
      flow_layers: flow decoder transformer layers.
      flow_heads: flow decoder heads (query and K/V: no GQA in the DiT).
      flow_head_dim: size of each flow key, value and query vector.
      flow_chunk: codec frames the flow decodes per step.
      flow_window: most recent flow frames kept (the sink is the voice prompt).
      flow_steps: ODE (Euler) steps per flow chunk.
      mel_bins: mel values the flow produces per frame.
      max_slots: requests each cache holds at once (a deployment's `resources:` block can tune
        each cache's own).
      dtype: storage and compute dtype name, one of `DTYPES`.
      seed: seed of the weight initialisation.
    """

    text_vocab_size: int = 256
    codec_vocab_size: int = 256
    d_model: int = 64
    talker_layers: int = 2
    talker_heads: int = 4
    talker_kv_heads: int = 2
    talker_head_dim: int = 16
    talker_ffn_dim: int = 128
    min_voice_frames: int = 8
    max_voice_frames: int = 24
    talker_sink_extra: int = 4
    talker_window: int = 32
    query_window: int = 33
    flow_d_model: int = 64
    flow_layers: int = 2
    flow_heads: int = 4
    flow_head_dim: int = 16
    flow_chunk: int = 8
    flow_window: int = 16
    flow_steps: int = 2
    mel_bins: int = 16
    max_slots: int = 4
    dtype: str = "float32"
    seed: int = 0

    FLOW_ROWS_PER_REQUEST: ClassVar[int] = 2
    """Conditional and unconditional rows (classifier-free guidance run as a batch of two)."""
    FLOW_REVERSE_STEP_ORDER: ClassVar[bool] = True
    """Chunks join the flow's stream last-first, so a window cutting a chunk keeps its front."""
    UNREAD_WORKLOAD: ClassVar[tuple[str, ...]] = ("min_new_tokens", "max_new_tokens")
    """A text model's workload settings: a deployment of this model refuses them."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.name in ("dtype", "talker_sink_extra", "seed"):
                continue
            check_int(field.name, getattr(self, field.name), minimum=1, maximum=INT32_MAX)
        check_int("talker_sink_extra", self.talker_sink_extra, minimum=0, maximum=INT32_MAX)
        check_int("seed", self.seed, minimum=0, maximum=2**63 - 1)  # a JAX random key's seed
        if self.talker_heads % self.talker_kv_heads:
            raise ValueError(
                f"talker_heads={self.talker_heads} must be a multiple of talker_kv_heads="
                f"{self.talker_kv_heads} (grouped-query attention shares each K/V head among a group)"
            )
        if self.min_voice_frames > self.max_voice_frames:
            raise ValueError(
                f"min_voice_frames={self.min_voice_frames} must be <= "
                f"max_voice_frames={self.max_voice_frames}"
            )
        if self.query_window > self.talker_window + 1:
            raise ValueError(
                f"query_window={self.query_window} must be <= talker_window + 1 = {self.talker_window + 1}: "
                "a wider band lets a prefill chunk attend its own tokens that decoding would have evicted"
            )
        check_choice("dtype", self.dtype, sorted(DTYPES))

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype `dtype` names."""
        return np.dtype(DTYPES[self.dtype])

    @property
    def talker_kv_config(self) -> BoundedKVConfig:
        """The talker's cache: one row per request, sink = voice + `talker_sink_extra`, causal band."""
        return BoundedKVConfig(
            num_layers=self.talker_layers,
            num_heads=self.talker_kv_heads,
            head_dim=self.talker_head_dim,
            rows_per_request=1,
            max_source_len=self.max_voice_frames,
            min_source_len=self.min_voice_frames,
            retention=functools.partial(
                _voice_sink_retention, extra=self.talker_sink_extra, window=self.talker_window
            ),
            max_slots=self.max_slots,
            dtype=DTYPES[self.dtype],
            query_window=self.query_window,
        )

    @property
    def flow_kv_config(self) -> BoundedKVConfig:
        """The flow decoder's cache: two rows per request, sink = the voice, chunks written last-first."""
        return BoundedKVConfig(
            num_layers=self.flow_layers,
            num_heads=self.flow_heads,
            head_dim=self.flow_head_dim,
            rows_per_request=self.FLOW_ROWS_PER_REQUEST,
            max_source_len=self.max_voice_frames,
            min_source_len=self.min_voice_frames,
            retention=functools.partial(_voice_sink_retention, extra=0, window=self.flow_window),
            max_slots=self.max_slots,
            dtype=DTYPES[self.dtype],
            reverse_step_order=self.FLOW_REVERSE_STEP_ORDER,
        )

    def resource_specs(self) -> list[NodeResourceSpec]:
        """The resources the model's nodes need: `talker_kv` (node "talker") and `flow_kv` (node "flow")."""
        return [
            BoundedKVSpec(resource_key=TALKER_KV, nodes={"talker"}, config=self.talker_kv_config),
            BoundedKVSpec(resource_key=FLOW_KV, nodes={"flow"}, config=self.flow_kv_config),
        ]


register_static_pytree(StreamingTTSConfig)
