"""The flow decoder: codec frames to mel frames, one chunk per step, then a trivial vocoder to samples.

In the style of Step-Audio 2's token2wav DiT: a transformer estimates the flow-matching velocity,
integrated with a few Euler steps from noise; classifier-free guidance runs as two rows per request
(row 0 conditioned on the codes, row 1 on a null code), combined as `(1 + w) v_cond - w v_uncond`.
Attention has no positions (a frame's order inside its chunk enters through an input embedding
only), so every chunk attends itself whole and the cache may store chunks last-first.

The cache holds, per layer, the keys and values each frame had at the **last** Euler step; every
Euler step of a later chunk attends those (the earlier steps read the cache without writing, since a
second write of the same positions would evict entries the next step still reads).

Shape legend: B requests, N = 2B rows (conditional, unconditional; request-major), T chunk frames,
E model width, H heads (query and K/V), D head dim, M mel bins, V codec tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mstar_jax.models.norm import RMSNorm
from mstar_jax.models.streaming_tts.talker import AttendFn, ModuleList

__all__ = ["CFG_RATE", "FlowBlock", "FlowDecoder", "sinusoid"]

CFG_RATE = 0.7
"""Guidance weight `w` (Step-Audio 2's value)."""
_FEATURES = 32  # sinusoid features of the time and of a frame's index within its chunk


def sinusoid(x: jax.Array, features: int = _FEATURES) -> jax.Array:
    """f32[...] -> f32[..., features]: sin and cos at geometrically spaced frequencies."""
    freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(features // 2, dtype=jnp.float32) / (features // 2))
    angles = x.astype(jnp.float32)[..., None] * freqs.reshape((1,) * x.ndim + freqs.shape)
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class FlowBlock(nnx.Module):
    """Pre-norm transformer block without positions: multi-head attention, then a GELU MLP."""

    def __init__(self, *, d_model: int, heads: int, head_dim: int, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.attn_norm = RMSNorm(d_model, rngs=rngs)
        self.wq = linear(d_model, heads * head_dim)
        self.wk = linear(d_model, heads * head_dim)
        self.wv = linear(d_model, heads * head_dim)
        self.wo = linear(heads * head_dim, d_model)
        self.mlp_norm = RMSNorm(d_model, rngs=rngs)
        self.mlp_in = linear(d_model, 4 * d_model)
        self.mlp_out = linear(4 * d_model, d_model)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, T, E] -> q, k, v [N, T, H, D]."""
        n, t, _ = x.shape
        h = self.attn_norm(x)
        shape = (n, t, self.heads, self.head_dim)
        return self.wq(h).reshape(shape), self.wk(h).reshape(shape), self.wv(h).reshape(shape)

    def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        n, t, _ = x.shape
        x = x + self.wo(attended.reshape(n, t, self.heads * self.head_dim).astype(x.dtype))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class FlowDecoder(nnx.Module):
    """Velocity estimator, Euler integration and vocoder.

    Args:
      codec_vocab: V; index V is the null code of the unconditional row.
      mel_bins: M.
      d_model, layers, heads, head_dim: the estimator's geometry.
      samples_per_frame: audio samples the vocoder makes of one mel frame.
      rngs: initialisation randomness.
    """

    def __init__(
        self,
        *,
        codec_vocab: int,
        mel_bins: int,
        d_model: int,
        layers: int,
        heads: int,
        head_dim: int,
        samples_per_frame: int,
        rngs: nnx.Rngs,
    ):
        self.codec_vocab, self.mel_bins, self.samples_per_frame = codec_vocab, mel_bins, samples_per_frame
        self.code_embed = nnx.Embed(codec_vocab + 1, d_model, rngs=rngs)
        self.mel_in = nnx.Linear(mel_bins, d_model, rngs=rngs)
        self.time_in = nnx.Linear(_FEATURES, d_model, rngs=rngs)
        self.index_in = nnx.Linear(_FEATURES, d_model, rngs=rngs)
        self.blocks = ModuleList(
            [FlowBlock(d_model=d_model, heads=heads, head_dim=head_dim, rngs=rngs) for _ in range(layers)]
        )
        self.norm = RMSNorm(d_model, rngs=rngs)
        self.mel_out = nnx.Linear(d_model, mel_bins, rngs=rngs)
        self.vocoder = nnx.Linear(mel_bins, samples_per_frame, rngs=rngs)

    def conditions(self, codes: jax.Array) -> jax.Array:
        """i32[B, T] codes -> [N, T, E]: each request's conditional row, then its unconditional one."""
        cond = self.code_embed(codes)
        uncond = jnp.broadcast_to(self.code_embed(jnp.full((1, 1), self.codec_vocab, jnp.int32)), cond.shape)
        return jnp.stack([cond, uncond], axis=1).reshape(-1, *cond.shape[1:])

    def estimate(self, x: jax.Array, conditions: jax.Array, t: jax.Array, state, attend: AttendFn):
        """The velocity of both rows at time `t`.

        Args:
          x: [B, T, M] the current sample.
          conditions: [N, T, E] from `conditions`.
          t: f32[] time in [0, 1).
          state, attend: threaded through every block's attention.

        Returns:
          (velocity [N, T, M], state).
        """
        frames = x.shape[1]
        h = jnp.repeat(self.mel_in(x), 2, axis=0) + conditions
        h = h + self.time_in(sinusoid(1000.0 * t))[None, None, :]
        h = h + self.index_in(sinusoid(jnp.arange(frames, dtype=jnp.float32)))[None]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.project(h)
            attended, state = attend(state, layer, q, k, v)
            h = block.finish(h, attended)
        return self.mel_out(self.norm(h)), state

    def decode(
        self, codes: jax.Array, noise: jax.Array, state, *, read: AttendFn, write: AttendFn, steps: int
    ):
        """Integrate from `noise` to mel in `steps` Euler steps with guidance.

        Args:
          codes: i32[B, T] the chunk's codec frames.
          noise: f32[B, T, M] the starting sample.
          state: the cache, threaded through `read` (every step but the last) and `write` (the last).
          steps: static number of Euler steps.

        Returns:
          (mel f32[B, T, M], state).
        """
        conditions = self.conditions(codes)

        def euler(x, velocity):
            v_cond, v_uncond = velocity[0::2], velocity[1::2]
            return x + ((1 + CFG_RATE) * v_cond - CFG_RATE * v_uncond) / steps

        def read_step(i, x):
            # The cache is loop-invariant here: these steps only read it.
            velocity, _ = self.estimate(x, conditions, i.astype(jnp.float32) / steps, state, read)
            return euler(x, velocity)

        # A loop, not an unrolled sequence: one compiled body whatever the number of steps.
        x = jax.lax.fori_loop(0, steps - 1, read_step, noise)
        velocity, state = self.estimate(x, conditions, jnp.float32((steps - 1) / steps), state, write)
        return euler(x, velocity), state

    def vocode(self, mel: jax.Array) -> jax.Array:
        """f32[B, T, M] -> f32[B, T * samples_per_frame] samples in (-1, 1)."""
        batch, frames, _ = mel.shape
        return jnp.tanh(self.vocoder(mel)).reshape(batch, frames * self.samples_per_frame)
