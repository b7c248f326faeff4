"""`StreamingTTSModel`: the talker and the flow decoder as pure step functions over the bounded caches.

Every step function has the form `(params, cache, bank, plan, *inputs, settings) -> (cache, outputs)`:
pure, jittable with the cache donated (argument 1) and `settings` (a `StreamingTTSSettings`) static, and
compilable ahead of time from `jax.ShapeDtypeStruct`s. Per-step numbers (positions, lengths, seeds) are
array data, so a new position never recompiles; only the shapes (the bucket) and the settings pick the
program. `StreamingTTSModel` holds the weights and its `settings`; its step methods call these
functions with them.

Graph walks (the `BucketKey.graph_walk` of each program):

- `talker_prefill`: rows of up to `T` text tokens, causal through `query_window` (chunked prefill);
- `talker_decode`: one token per row;
- `talker_mixed`: a combined step: `bs` decode rows and `prefill_rows` prefill rows of `T` tokens in one
  program (`CombinedSplit("talker_mixed", ("talker_prefill",))`);
- `flow_chunk`: rows of up to `T` codec frames, decoded to mel and samples.

Shape legend: B rows (requests), T step tokens, P voice frames, M mel bins, L layers, G K/V heads,
D head dim, R cache rows per request.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.flow import FlowDecoder
from mstar_jax.models.streaming_tts.settings import StreamingTTSSettings
from mstar_jax.models.streaming_tts.sharding import param_shardings
from mstar_jax.models.streaming_tts.talker import Talker, sample_codes
from mstar_jax.models.streaming_tts.weights import draw_weights
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig
from mstar_jax.resources.spec import CombinedSplit
from mstar_jax.serving.attention import LayerAttention, layer_attention

__all__ = [
    "FLOW_CHUNK",
    "FRAME_RATE_HZ",
    "MIXED_SPLIT",
    "SAMPLES_PER_FRAME",
    "SAMPLE_RATE",
    "TALKER_DECODE",
    "TALKER_MIXED",
    "TALKER_PREFILL",
    "StreamingTTSModel",
    "dense_attention",
    "flow_step",
    "talker_combined_step",
    "talker_step",
]

FRAME_RATE_HZ = 12.5
"""Codec frames per second of audio."""
SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = int(SAMPLE_RATE / FRAME_RATE_HZ)

TALKER_PREFILL, TALKER_DECODE, TALKER_MIXED, FLOW_CHUNK = (
    "talker_prefill",
    "talker_decode",
    "talker_mixed",
    "flow_chunk",
)
MIXED_SPLIT = CombinedSplit(TALKER_MIXED, (TALKER_PREFILL,))
_FLOW_NOISE_STREAM = 1  # folded into a request's seed so the flow's noise differs from the talker's


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Plain masked attention in float32, for voice prompts (no cache).

    Args:
      q: [N, T, H, D]; k, v: [N, S, G, D] with H % G == 0.
      mask: bool[T, S] which keys each query sees.

    Returns:
      f32[N, T, H, D].
    """
    n, t, heads, dim = q.shape
    groups = k.shape[2]
    qg = q.astype(jnp.float32).reshape(n, t, groups, heads // groups, dim)
    scores = jnp.einsum("ntgid,nsgd->ngits", qg, k.astype(jnp.float32)) * dim**-0.5
    scores = jnp.where(mask[None, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("ngits,nsgd->ntgid", weights, v.astype(jnp.float32))
    return out.reshape(n, t, heads, dim)


def _modules(config: StreamingTTSConfig) -> tuple[Talker, FlowDecoder]:
    rngs = nnx.Rngs(config.seed)
    talker = Talker(
        text_vocab=config.text_vocab_size, codec_vocab=config.codec_vocab_size, d_model=config.d_model,
        layers=config.talker_layers, heads=config.talker_heads, kv_heads=config.talker_kv_heads,
        head_dim=config.talker_head_dim, ffn_dim=config.talker_ffn_dim, rngs=rngs,
    )  # fmt: skip
    flow = FlowDecoder(
        codec_vocab=config.codec_vocab_size, mel_bins=config.mel_bins, d_model=config.flow_d_model,
        layers=config.flow_layers, heads=config.flow_heads, head_dim=config.flow_head_dim,
        samples_per_frame=SAMPLES_PER_FRAME, rngs=rngs,
    )  # fmt: skip
    return talker, flow


@functools.cache
def _graphdefs(config: StreamingTTSConfig) -> tuple[nnx.GraphDef, nnx.GraphDef]:
    """The talker's and the flow's structure, which the step functions merge their `params` into."""
    talker, flow = nnx.eval_shape(lambda: _modules(config))
    return nnx.graphdef(talker), nnx.graphdef(flow)


def abstract_params(config: StreamingTTSConfig) -> tuple[nnx.State, nnx.State]:
    """The talker's and the flow's parameters as `ShapeDtypeStruct`s (`nnx.eval_shape`: nothing is
    allocated); the model stores each in `config.storage_dtype`."""
    talker, flow = nnx.eval_shape(lambda: _modules(config))
    return nnx.state(talker), nnx.state(flow)


class StreamingTTSModel:
    """The random-initialised talker and flow decoder of a `StreamingTTSConfig`, as step functions.

    Args:
      config: the model's geometry; the weights are drawn from `config.seed` and stored in its dtype.
      talker_kv, flow_kv: the caches' configs (default: the config's; pass the built managers'
        configs when a deployment tuned them).
      implementation, interpret: passed to the attention op (see `sink_window_attention`).
      temperature: sampling temperature of the talker (0: greedy).
      mesh: a `(data, model)` mesh (`sharding.make_mesh`): the weights are laid out Megatron-style on
        `model` and every attention call runs `sharded_attend`, so the steps take global, shard-major
        batches and caches of `BoundedKVManager(data_shards=...)` placed on the mesh. None: one device.

    Attributes:
      settings: the arguments but the weights, as the `StreamingTTSSettings` every step is compiled
        for; `config`, `talker_kv`, `flow_kv`, `implementation`, `interpret`, `temperature` and `mesh`
        read its fields.
      talker_params, flow_params: the weights.
    """

    def __init__(
        self,
        config: StreamingTTSConfig,
        *,
        talker_kv: BoundedKVConfig | None = None,
        flow_kv: BoundedKVConfig | None = None,
        implementation: str = "auto",
        interpret: Any = False,
        temperature: float = 1.0,
        mesh: Mesh | None = None,
    ):
        self.settings = StreamingTTSSettings(
            config=config, talker_kv=talker_kv or config.talker_kv_config,
            flow_kv=flow_kv or config.flow_kv_config, implementation=implementation, interpret=interpret,
            temperature=temperature, mesh=mesh,
        )  # fmt: skip
        _graphdefs(config)  # built here, not first inside a trace on one of capture's threads
        talker, flow = nnx.eval_shape(lambda: _modules(config))  # the structure only; weights are drawn below
        rng = np.random.default_rng(config.seed)
        self._talker_def, self.talker_params = nnx.split(talker)
        self._flow_def, self.flow_params = nnx.split(flow)
        # Weights in the storage dtype (bf16 deployments compute in bf16, softmax statistics in f32).
        self.talker_params = draw_weights(self.talker_params, rng, config.storage_dtype)
        self.flow_params = draw_weights(self.flow_params, rng, config.storage_dtype)
        if mesh is not None:  # the same weights, laid out Megatron-style (`sharding.param_shardings`)
            self.talker_params = jax.device_put(
                self.talker_params, param_shardings(self.talker_params, mesh, kv_heads=config.talker_kv_heads)
            )
            self.flow_params = jax.device_put(
                self.flow_params, param_shardings(self.flow_params, mesh, kv_heads=config.flow_heads)
            )
        self.bos = talker.bos
        self.text_vocab = config.text_vocab_size

    # Read-only: a step compiled for the settings would not see a new value.
    config = property(lambda self: self.settings.config)
    talker_kv = property(lambda self: self.settings.talker_kv)
    flow_kv = property(lambda self: self.settings.flow_kv)
    implementation = property(lambda self: self.settings.implementation)
    interpret = property(lambda self: self.settings.interpret)
    temperature = property(lambda self: self.settings.temperature)
    mesh = property(lambda self: self.settings.mesh)

    # The step functions with this model's settings (also what notebooks jit).
    def talker_step(self, params, cache, bank, plan, *inputs) -> tuple[BoundedKVCache, jax.Array]:
        """`talker_step(..., settings=self.settings)`."""
        return talker_step(params, cache, bank, plan, *inputs, settings=self.settings)

    def talker_combined_step(self, params, cache, bank, plan, *inputs) -> tuple[BoundedKVCache, jax.Array]:
        """`talker_combined_step(..., settings=self.settings)`."""
        return talker_combined_step(params, cache, bank, plan, *inputs, settings=self.settings)

    def flow_step(
        self, params, cache, bank, plan, *inputs
    ) -> tuple[BoundedKVCache, tuple[jax.Array, jax.Array]]:
        """`flow_step(..., settings=self.settings)`."""
        return flow_step(params, cache, bank, plan, *inputs, settings=self.settings)

    def flow_noise(self, starts: jax.Array, seeds: jax.Array, frames: int) -> jax.Array:
        """`flow_noise(self.config.mel_bins, ...)`."""
        return flow_noise(self.config.mel_bins, starts, seeds, frames)

    def talker_voice_kv(self, params: nnx.State, tokens: jax.Array, length: jax.Array):
        """Keys and values of a voice prompt, as the talker's source prefix (causal, positions 0..P-1).

        Args:
          tokens: i32[P] the prompt's input tokens (padded to a fixed P so one program serves every voice).
          length: i32[] real prompt tokens.

        Returns:
          (k, v), each [L, R=1, G, P, D] in the cache dtype; entries past `length` are meaningless.
        """
        talker = nnx.merge(self._talker_def, params)
        frames = tokens.shape[0]
        idx = jnp.arange(frames, dtype=jnp.int32)
        mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] < length)

        def collect(kv, layer, q, k, v):
            return dense_attention(q, k, v, mask), (*kv, (k, v))

        _, kv = talker([tokens[None]], [idx[None]], (), [collect])
        return self._stack_kv(kv, self.talker_kv.dtype)

    @staticmethod
    def _stack_kv(kv, dtype) -> tuple[jax.Array, jax.Array]:
        # [N, P, G, D] per layer -> [L, N (= R), G, P, D]
        k = jnp.stack([k.transpose(0, 2, 1, 3) for k, _ in kv]).astype(dtype)
        v = jnp.stack([v.transpose(0, 2, 1, 3) for _, v in kv]).astype(dtype)
        return k, v

    # Flow decoder.
    def flow_voice_kv(
        self, params: nnx.State, codes: jax.Array, mel: jax.Array, noise: jax.Array, length: jax.Array
    ):
        """Keys and values of a voice prompt as the flow's source: its frames at the last Euler step.

        The prompt's ground-truth mel sits on the flow-matching path at that step's time,
        `x = (1 - t) noise + t mel`, and the whole prompt attends itself (keys past `length` masked).

        Args:
          codes: i32[P] the prompt's codec frames; mel, noise: f32[P, M].
          length: i32[] real prompt frames.

        Returns:
          (k, v), each [L, R=2, H, P, D] in the cache dtype.
        """
        flow = nnx.merge(self._flow_def, params)
        steps = self.config.flow_steps
        t = (steps - 1) / steps
        x = ((1 - t) * noise + t * mel)[None]
        mask = jnp.broadcast_to(jnp.arange(codes.shape[0])[None, :] < length, (codes.shape[0],) * 2)

        def collect(kv, layer, q, k, v):
            return dense_attention(q, k, v, mask), (*kv, (k, v))

        _, kv = flow.estimate(x, flow.conditions(codes[None]), jnp.float32(t), (), collect)
        return self._stack_kv(kv, self.flow_kv.dtype)

    # Host-side helpers.
    def code_tokens(self, codes: np.ndarray) -> np.ndarray:
        """Codec indices -> the talker's input tokens."""
        return np.asarray(codes, np.int32) + self.text_vocab

    @functools.cached_property
    def jitted_voice_kv(self):
        """The two voice-prompt functions, jitted (one program each: prompts are padded to a fixed P)."""
        return jax.jit(self.talker_voice_kv), jax.jit(self.flow_voice_kv)


# The step functions: pure in their arguments, `settings` static.


def _attention(
    settings: StreamingTTSSettings, bank: SourceBank, table: jax.Array, config: BoundedKVConfig, *, write=True
) -> LayerAttention:
    """A layer's attention over the retained stream (`layer_attention`), storing the step's keys when
    `write`."""
    return layer_attention(
        config, bank, table, implementation=settings.implementation, interpret=settings.interpret,
        mesh=settings.mesh, write=write,
    )  # fmt: skip


def _talker_codes(settings: StreamingTTSSettings, talker: Talker, hidden, table, lengths, seeds) -> jax.Array:
    """Sample the next frame from the hidden state of each row's last real token."""
    last = jnp.maximum(lengths - 1, 0)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    positions = BoundedKVPlan(table).stream_lengths() + last
    return sample_codes(talker.logits(h_last), seeds, positions, temperature=settings.temperature)


def talker_step(
    params: nnx.State, cache: BoundedKVCache, bank: SourceBank, plan: BoundedKVPlan, tokens: jax.Array,
    lengths: jax.Array, seeds: jax.Array, *, settings: StreamingTTSSettings,
) -> tuple[BoundedKVCache, jax.Array]:  # fmt: skip
    """One talker step: prefill chunks (T tokens) or decode (T = 1), same code.

    Args:
      params: `talker_params`.
      cache, bank: the talker's cache (donated) and source bank.
      plan: the manager's plan, its table i32[B, ROW_INTS].
      tokens: i32[B, T] input tokens; row b's first `lengths[b]` are real.
      lengths: i32[B] real tokens per row (0 for padding rows).
      seeds: u32[B] per-request sampling seeds.
      settings: static; the model's `settings`.

    Returns:
      (cache, i32[B] the frame each row's last real token predicts; meaningless for padding rows).
    """
    talker = nnx.merge(_graphdefs(settings.config)[0], params)
    table = plan.table
    positions = BoundedKVPlan(table).positions(tokens.shape[1])
    (hidden,), cache = talker(
        [tokens], [positions], cache, [_attention(settings, bank, table, settings.talker_kv)]
    )
    return cache, _talker_codes(settings, talker, hidden, table, lengths, seeds)


def talker_combined_step(
    params: nnx.State, cache: BoundedKVCache, bank: SourceBank, plan: BoundedKVPlan,
    decode_tokens: jax.Array, decode_lengths: jax.Array, prefill_tokens: jax.Array,
    prefill_lengths: jax.Array, seeds: jax.Array, *, settings: StreamingTTSSettings,
) -> tuple[BoundedKVCache, jax.Array]:  # fmt: skip
    """Decode rows and prefill rows in one program, each group on its own attention call.

    On a mesh of D data shards every array holds each shard's rows in turn (shard-major, split on
    `data`): a shard's `Bd / D` decode rows, then its `Bp / D` prefill rows in the table, the seeds and
    the outputs, and its rows of each group in the group's arrays. One device is D = 1.

    Args:
      plan: its table i32[Bd + Bp, ROW_INTS] holds each shard's decode rows, then its prefill rows.
      decode_tokens: i32[Bd, 1]; decode_lengths: i32[Bd].
      prefill_tokens: i32[Bp, T]; prefill_lengths: i32[Bp].
      seeds: u32[Bd + Bp], in the table's order.
      settings: static; the model's `settings`.

    Returns:
      (cache, i32[Bd + Bp] next frames, in the table's order).
    """
    talker = nnx.merge(_graphdefs(settings.config)[0], params)
    shards = 1 if settings.mesh is None else settings.mesh.shape["data"]
    bd, bp = decode_tokens.shape[0] // shards, prefill_tokens.shape[0] // shards

    def split(rows: jax.Array) -> tuple[jax.Array, jax.Array]:  # [D * (bd + bp), ...] -> each group's
        by_shard = rows.reshape(shards, bd + bp, *rows.shape[1:])
        return tuple(part.reshape(-1, *rows.shape[1:]) for part in (by_shard[:, :bd], by_shard[:, bd:]))

    tables, groups = split(plan.table), (decode_tokens, prefill_tokens)
    positions = [BoundedKVPlan(t).positions(g.shape[1]) for t, g in zip(tables, groups, strict=True)]
    attends = [_attention(settings, bank, t, settings.talker_kv) for t in tables]
    hiddens, cache = talker(list(groups), positions, cache, attends)
    codes = [
        _talker_codes(settings, talker, h, t, n, s).reshape(shards, -1)
        for h, t, n, s in zip(hiddens, tables, (decode_lengths, prefill_lengths), split(seeds), strict=True)
    ]
    return cache, jnp.concatenate(codes, axis=1).reshape(-1)


def flow_noise(mel_bins: int, starts: jax.Array, seeds: jax.Array, frames: int) -> jax.Array:
    """f32[B, T, M] starting noise; frame i of a row depends only on (seed, starts + i).

    Args:
      mel_bins: M.
      starts: i32[B] each row's stream length before the chunk.
      seeds: u32[B] per-request seeds.
      frames: T.
    """

    def row(seed, start):
        key = jax.random.fold_in(jax.random.key(seed), _FLOW_NOISE_STREAM)
        ids = start + jnp.arange(frames, dtype=jnp.int32)
        return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (mel_bins,)))(ids)

    return jax.vmap(row)(seeds, starts)


def flow_step(
    params: nnx.State, cache: BoundedKVCache, bank: SourceBank, plan: BoundedKVPlan, codes: jax.Array,
    seeds: jax.Array, *, settings: StreamingTTSSettings,
) -> tuple[BoundedKVCache, tuple[jax.Array, jax.Array]]:  # fmt: skip
    """Decode one chunk of codec frames per row into mel frames and samples.

    Args:
      params: `flow_params`.
      cache, bank: the flow's cache (donated) and source bank.
      plan: its table i32[B, ROW_INTS] (STEP_TOKENS say how many frames are real).
      codes: i32[B, T] codec frames (indices in [0, V)); padding frames may be anything valid.
      seeds: u32[B] per-request seeds.
      settings: static; the model's `settings`.

    Returns:
      (cache, (mel f32[B, T, M], samples f32[B, T * SAMPLES_PER_FRAME])); frames past a row's real
      count are meaningless.
    """
    flow = nnx.merge(_graphdefs(settings.config)[1], params)
    table = plan.table
    noise = flow_noise(settings.config.mel_bins, BoundedKVPlan(table).stream_lengths(), seeds, codes.shape[1])
    kv = settings.flow_kv
    mel, cache = flow.decode(
        codes, noise, cache, read=_attention(settings, bank, table, kv, write=False),
        write=_attention(settings, bank, table, kv), steps=settings.config.flow_steps,
    )  # fmt: skip
    return cache, (mel, flow.vocode(mel))
