"""The talker: an autoregressive decoder turning text tokens into codec frames, one frame per step.

Shape legend: B requests (one cache row each), T step tokens, E model width, H query heads, G K/V
heads, D head dim, V_in the input vocabulary, V codec tokens, P voice prompt frames.

Input tokens share one embedding table: text tokens `[0, text_vocab)`, codec tokens
`[text_vocab, text_vocab + codec_vocab)`, then `BOS` (the token after the text that asks for the first
frame). A request's stream is `voice ++ text ++ BOS ++ frame_0 ++ frame_1 ...`; the logits at a step's
last real token pick the next frame, which is the next step's input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mstar_jax.models.norm import RMSNorm
from mstar_jax.models.rope import apply_rope
from mstar_jax.serving.sampling import gumbel_noise

__all__ = ["AttendFn", "Talker", "TalkerBlock", "sample_codes"]

ModuleList = getattr(nnx, "List", list)
"""A list of submodules: `nnx.List` where Flax has it (>= 0.12 requires it), a plain list before."""

AttendFn = Callable[[object, int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]
"""`(state, layer, q [N, T, H, D], k [N, T, G, D], v) -> (out [N, T, H, D], state)`: how a block's
queries meet their keys. The serving path threads the bounded cache through it; the voice prompt path
collects each layer's keys and values."""


class TalkerBlock(nnx.Module):
    """Pre-norm transformer block: GQA attention with RoPE at absolute positions, then a SwiGLU MLP."""

    def __init__(
        self, *, d_model: int, heads: int, kv_heads: int, head_dim: int, ffn_dim: int, rngs: nnx.Rngs
    ):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.attn_norm = RMSNorm(d_model, rngs=rngs)
        self.wq = linear(d_model, heads * head_dim)
        self.wk = linear(d_model, kv_heads * head_dim)
        self.wv = linear(d_model, kv_heads * head_dim)
        self.wo = linear(heads * head_dim, d_model)
        self.mlp_norm = RMSNorm(d_model, rngs=rngs)
        self.gate = linear(d_model, ffn_dim)
        self.up = linear(d_model, ffn_dim)
        self.down = linear(ffn_dim, d_model)

    def project(self, x: jax.Array, positions: jax.Array, theta: float) -> tuple[jax.Array, ...]:
        """x [N, T, E], positions i32[N, T] -> q [N, T, H, D], k and v [N, T, G, D] (q, k rotated)."""
        n, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).reshape(n, t, self.heads, self.head_dim)
        k = self.wk(h).reshape(n, t, self.kv_heads, self.head_dim)
        v = self.wv(h).reshape(n, t, self.kv_heads, self.head_dim)
        return apply_rope(q, positions, theta=theta), apply_rope(k, positions, theta=theta), v

    def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        """Residual attention output, then the MLP: x [N, T, E], attended [N, T, H, D] -> [N, T, E]."""
        n, t, _ = x.shape
        x = x + self.wo(attended.reshape(n, t, self.heads * self.head_dim).astype(x.dtype))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Talker(nnx.Module):
    """Text and codec tokens in, next-frame logits out.

    Args:
      text_vocab, codec_vocab: sizes of the two token ranges (`V = codec_vocab`).
      d_model, layers, heads, kv_heads, head_dim, ffn_dim: the transformer's geometry.
      rope_theta: RoPE base.
      rngs: initialisation randomness.
    """

    def __init__(
        self,
        *,
        text_vocab: int,
        codec_vocab: int,
        d_model: int,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        ffn_dim: int,
        rope_theta: float = 10_000.0,
        rngs: nnx.Rngs,
    ):
        self.text_vocab, self.codec_vocab, self.rope_theta = text_vocab, codec_vocab, rope_theta
        self.embed = nnx.Embed(text_vocab + codec_vocab + 1, d_model, rngs=rngs)
        self.blocks = ModuleList(
            [
                TalkerBlock(
                    d_model=d_model,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    ffn_dim=ffn_dim,
                    rngs=rngs,
                )
                for _ in range(layers)
            ]
        )
        self.norm = RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, codec_vocab, use_bias=False, rngs=rngs)

    @property
    def bos(self) -> int:
        """The input token that asks for the first frame."""
        return self.text_vocab + self.codec_vocab

    def code_token(self, code: jax.Array) -> jax.Array:
        """Codec index (in `[0, V)`) -> input token."""
        return code + self.text_vocab

    def __call__(
        self,
        tokens: Sequence[jax.Array],
        positions: Sequence[jax.Array],
        state,
        attends: Sequence[AttendFn],
    ) -> tuple[list[jax.Array], object]:
        """Run the blocks over one or more groups of rows in lockstep, layer by layer.

        A combined step passes two groups (one-token decode rows and prefill chunks), each with its
        own attention; every group goes through exactly the code it would alone.

        Args:
          tokens: per group i32[N_g, T_g] input tokens (padding may be any valid token: never attended).
          positions: per group i32[N_g, T_g] absolute stream positions.
          state: threaded through the attentions (the cache, or a list collecting K/V).
          attends: per group, how its queries meet their keys.

        Returns:
          (per group the hidden states [N_g, T_g, E] after the final norm, state).
        """
        xs = [self.embed(group) for group in tokens]
        for layer, block in enumerate(self.blocks):
            for g, (x, pos, attend) in enumerate(zip(xs, positions, attends, strict=True)):
                q, k, v = block.project(x, pos, self.rope_theta)
                attended, state = attend(state, layer, q, k, v)
                xs[g] = block.finish(x, attended)
        return [self.norm(x) for x in xs], state

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> f32[..., V]."""
        return self.head(hidden).astype(jnp.float32)


def sample_codes(
    logits: jax.Array, seeds: jax.Array, positions: jax.Array, *, temperature: float
) -> jax.Array:
    """Draw one codec index per row, reproducibly: the noise depends only on (seed, position).

    Gumbel-max sampling with the key `fold_in(key(seed), position)`, so a request draws the same frame
    at the same stream position whichever batch, bucket or slot it runs in (and after an offload).

    Args:
      logits: f32[B, V].
      seeds: u32[B] per-request seeds.
      positions: i32[B] the stream position of the token the logits were computed at.
      temperature: static; 0 picks the argmax.

    Returns:
      i32[B] codec indices.
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    noise = gumbel_noise(seeds, positions, logits.shape[-1])
    return jnp.argmax(logits / temperature + noise, axis=-1).astype(jnp.int32)
