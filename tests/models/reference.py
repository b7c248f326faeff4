"""Dense full-history references of the streaming TTS model, the oracles of the model and engine tests.

They keep every stream entry a request ever wrote (voice included) in one array and attend it through a
mask built from the retention definition (docs/design.md §3): they never see a slot, a ring or a plan
table. A stream position `n` counts the voice, as the bounded cache's stream length does.

Shape legend: L layers, G K/V heads, H heads, D head dim, M mel bins, P voice frames, S history
entries (`total` plus `SLACK`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel, dense_attention
from mstar_jax.models.streaming_tts.talker import sample_codes

__all__ = [
    "SLACK",
    "flow_history",
    "make_reference_flow",
    "make_reference_talker",
    "talker_history",
    "vocode_reference",
    "voice_prompt",
]

SLACK = 4
"""History entries past `total`, and the most tokens a reference step takes: a padded insert never clamps."""


def voice_prompt(config: StreamingTTSConfig, seed: int, frames: int):
    """The prompt `VoiceBank.add` draws (same generator calls), unpadded.

    Returns:
      (codes i32[P], mel f32[P, M], noise f32[P, M]).
    """
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, config.codec_vocab_size, frames).astype(np.int32)
    mel = rng.standard_normal((frames, config.mel_bins)).astype(np.float32)
    noise = rng.standard_normal((config.max_voice_frames, config.mel_bins)).astype(np.float32)[:frames]
    return codes, mel, noise


def talker_history(model: StreamingTTSModel, voice_codes: np.ndarray, total: int):
    """The talker's dense history (k, v), each f32[L, G, S, D], holding the voice's keys at `[0, P)`.

    The voice is computed unpadded, at its own length (the bank computes it padded to the longest voice
    and masked: the same keys up to float rounding).
    """
    cfg, frames = model.config, len(voice_codes)
    tk, tv = model.talker_voice_kv(model.talker_params, model.code_tokens(voice_codes), jnp.int32(frames))
    shape = (cfg.talker_layers, cfg.talker_kv_heads, total + SLACK, cfg.talker_head_dim)
    return (
        jnp.zeros(shape).at[:, :, :frames].set(tk[:, 0]),
        jnp.zeros(shape).at[:, :, :frames].set(tv[:, 0]),
    )


def flow_history(
    model: StreamingTTSModel, voice_codes: np.ndarray, mel: np.ndarray, noise: np.ndarray, total: int
):
    """The flow's dense history (k, v), each f32[L, 2, H, S, D], holding the voice's keys at `[0, P)`."""
    cfg, frames = model.config, len(voice_codes)
    fk, fv = model.flow_voice_kv(model.flow_params, voice_codes, mel, noise, jnp.int32(frames))
    shape = (cfg.flow_layers, 2, cfg.flow_heads, total + SLACK, cfg.flow_head_dim)
    return (
        jnp.zeros(shape).at[:, :, :, :frames].set(fk),
        jnp.zeros(shape).at[:, :, :, :frames].set(fv),
    )


def make_reference_talker(model: StreamingTTSModel, total: int):
    """One jitted dense step over the full history [L, G, total, D], masked by the retention definition.

    Tokens come padded to `SLACK` (one program for every step); `m` of them are real. The history has
    `SLACK` entries of slack so the padded insert never clamps. The code is sampled with the model's
    `sample_codes` at the last real token's position, as the bounded step samples it.
    """
    kv = model.talker_kv
    talker_def = model._talker_def
    temperature = model.temperature

    @jax.jit
    def step(params, hist_k, hist_v, tokens, m, n, sink, window, seed):
        talker = nnx.merge(talker_def, params)
        qpos = n + jnp.arange(tokens.shape[1])
        kpos = jnp.arange(total + SLACK)
        kept = (kpos < jnp.minimum(sink, n)) | ((kpos >= jnp.maximum(sink, n - window)) & (kpos < n))
        own = (kpos >= n) & (kpos < n + m)
        band = (kpos[None] <= qpos[:, None]) & (
            (kpos[None] < sink) | (kpos[None] > qpos[:, None] - kv.query_window)
        )
        mask = (kept | own)[None] & band

        def attend(state, layer, q, k, v):
            hk, hv = state
            hk = hk.at[layer].set(jax.lax.dynamic_update_slice(hk[layer], k[0].transpose(1, 0, 2), (0, n, 0)))
            hv = hv.at[layer].set(jax.lax.dynamic_update_slice(hv[layer], v[0].transpose(1, 0, 2), (0, n, 0)))
            keys, values = hk[layer].transpose(1, 0, 2)[None], hv[layer].transpose(1, 0, 2)[None]
            return dense_attention(q, keys, values, mask), (hk, hv)

        (hidden,), (hist_k, hist_v) = talker([tokens], [qpos[None]], (hist_k, hist_v), [attend])
        last = jax.lax.dynamic_index_in_dim(hidden, m - 1, axis=1, keepdims=False)
        code = sample_codes(talker.logits(last), seed[None], (n + m - 1)[None], temperature=temperature)
        return hist_k, hist_v, code[0]

    return step


def make_reference_flow(model: StreamingTTSModel, total: int):
    """A jitted dense flow chunk over the full history [L, 2, H, total, D] (written last-first).

    Chunks come padded to `SLACK` frames, `m` of them real; the history has `SLACK` entries of slack.
    Returns the chunk's mel f32[SLACK, M] (frames past `m` are meaningless).
    """
    flow_def = model._flow_def
    flow_steps = model.config.flow_steps

    @jax.jit
    def chunk(params, hist_k, hist_v, codes, m, n, sink, window, seed):
        flow = nnx.merge(flow_def, params)
        steps = codes.shape[1]
        kpos = jnp.arange(total + SLACK)
        kept = (kpos < jnp.minimum(sink, n)) | ((kpos >= jnp.maximum(sink, n - window)) & (kpos < n))
        mask = jnp.broadcast_to(kept | ((kpos >= n) & (kpos < n + m)), (steps, total + SLACK))
        # Token j joins the stream at n + m - 1 - j: position n + i holds token m - 1 - i.
        order = jnp.clip(m - 1 - jnp.arange(steps), 0, steps - 1)

        def with_own(hk, hv, layer, k, v):
            own_k, own_v = (
                k[:, order].transpose(0, 2, 1, 3),
                v[:, order].transpose(0, 2, 1, 3),
            )  # [2, H, T, D]
            hk = hk.at[layer].set(jax.lax.dynamic_update_slice(hk[layer], own_k, (0, 0, n, 0)))
            hv = hv.at[layer].set(jax.lax.dynamic_update_slice(hv[layer], own_v, (0, 0, n, 0)))
            return hk, hv

        def read(state, layer, q, k, v):
            hk, hv = with_own(*state, layer, k, v)
            out = dense_attention(q, hk[layer].transpose(0, 2, 1, 3), hv[layer].transpose(0, 2, 1, 3), mask)
            return out, state  # reading leaves the history as it was

        def write(state, layer, q, k, v):
            hk, hv = with_own(*state, layer, k, v)
            out = dense_attention(q, hk[layer].transpose(0, 2, 1, 3), hv[layer].transpose(0, 2, 1, 3), mask)
            return out, (hk, hv)

        noise = model.flow_noise(n[None], seed[None], steps)
        mel, (hist_k, hist_v) = flow.decode(
            codes, noise, (hist_k, hist_v), read=read, write=write, steps=flow_steps
        )
        return hist_k, hist_v, mel[0]

    return chunk


def vocode_reference(model: StreamingTTSModel, mel: np.ndarray) -> np.ndarray:
    """f32[T, M] mel -> f32[T * samples_per_frame] samples, through the flow's vocoder."""
    flow = nnx.merge(model._flow_def, model.flow_params)
    return np.asarray(flow.vocode(jnp.asarray(mel)[None])[0])
