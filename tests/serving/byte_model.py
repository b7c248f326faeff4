"""A third model in one file: a two-layer byte decoder (vocab 256, greedy) served by `ServingEngine`.

One bounded cache: query i sees keys j <= i with j < 2 or i - j <= 6 (`RETENTION`, a causal band of 7). One
feeding node, one walk: decode rows (a byte `fed` on the device) and prefill rows (prompt chunks) share it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mstar_jax.compile import Buckets, BucketSet, cap_batch_sizes
from mstar_jax.resources.kv import bounded as kv
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.serving import DecoderPrograms, GreedyDecoder, capture_decoder, layer_attention

NODE, CACHE, WALK = "bytes", "bytes_kv", "bytes_step"
DIM, HEADS, HEAD_DIM, RETENTION = 32, 2, 16, kv.SinkWindow(2, 6)  # one KV head, shared by both query heads


def init_params(seed: int, layers: int = 2) -> dict:
    """Random weights: `embed` f32[256, DIM], `head` f32[DIM, 256], per layer wq, wk, wv, wo, w1, w2."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 6 * layers))
    normal = lambda *shape: jax.random.normal(next(keys), shape) / math.sqrt(shape[0])  # noqa: E731
    shapes = {"wq": (DIM, HEADS * HEAD_DIM), "wk": (DIM, HEAD_DIM), "wv": (DIM, HEAD_DIM),
              "wo": (HEADS * HEAD_DIM, DIM), "w1": (DIM, 2 * DIM), "w2": (2 * DIM, DIM)}  # fmt: skip
    layers = [{name: normal(*shape) for name, shape in shapes.items()} for _ in range(layers)]
    return {"embed": normal(256, DIM) * 16, "head": normal(DIM, 256), "layers": layers}


def step(
    params, cache, bank, plan: kv.BoundedKVPlan, tokens: jax.Array, lengths: jax.Array, *, config, mesh=None
):
    """Every row's next greedy byte: tokens i32[B, T] (row b's first lengths[b] real) -> (cache, i32[B])."""
    attention = layer_attention(config, bank, plan, mesh=mesh)
    norm = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    freqs = jnp.exp(-math.log(1e4) * jnp.arange(DIM // 2, dtype=jnp.float32) / (DIM // 2))
    angles = plan.positions(tokens.shape[1])[..., None].astype(jnp.float32) * freqs[None, None, :]
    x = params["embed"][tokens] + jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    for layer, w in enumerate(params["layers"]):
        h = norm(x)
        q, k, v = (jnp.reshape(h @ w[n], (*tokens.shape, -1, HEAD_DIM)) for n in ("wq", "wk", "wv"))
        out, cache = attention(cache, layer, q, k, v)
        x = x + out.reshape(*tokens.shape, -1) @ w["wo"]
        x = x + jax.nn.relu(norm(x) @ w["w1"]) @ w["w2"]
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return cache, jnp.argmax(norm(last) @ params["head"], axis=-1).astype(jnp.int32)


class ByteRequest(NamedTuple):
    """Continue `prompt` (at least one byte) greedily for `max_new_tokens` bytes."""

    request_id: str
    prompt: bytes
    max_new_tokens: int


class ByteServing(GreedyDecoder):
    """The byte model as the engine serves it: `slots` streams at once (module doc); `GreedyDecoder` keeps
    its streams' books (rows, inputs, what a step does to them, replay after a fault)."""

    request_type, decode_walk, prefill_walk = ByteRequest, WALK, WALK  # one walk runs both kinds of row

    def __init__(self, params: dict, *, slots: int, chunk: int = 4, programs: DecoderPrograms | None = None):
        config = kv.BoundedKVConfig(num_layers=len(params["layers"]), num_heads=1, head_dim=HEAD_DIM,
                                 rows_per_request=1, max_source_len=0, retention=RETENTION, max_slots=slots,
                                 query_window=RETENTION.window + 1)  # fmt: skip
        self.manager = kv.BoundedKVManager(kv.BoundedKVSpec(CACHE, {NODE}, config), num_sources=1)
        if programs is None:
            sizes = cap_batch_sizes((1,), slots)
            buckets = Buckets((BucketSet(graph_walk=WALK, batch_sizes=sizes, token_counts=(chunk,)),))
            cache, bank, static = self.manager.cache, self.manager.bank, {"config": self.manager.config}
            steps = capture_decoder(step, buckets, params, cache, bank, name="bytes", static_kwargs=static)
            programs = DecoderPrograms(buckets, steps)
        self.chunk = programs.buckets.max_tokens(WALK)
        super().__init__(NODE, ResourceRunner({CACHE: self.manager}), (CACHE,), params, programs)

    def check(self, request: ByteRequest) -> None:
        rid, prompt, n = request.request_id, request.prompt, request.max_new_tokens
        if not isinstance(prompt, bytes) or not prompt:
            raise ValueError(f"request {rid!r}: prompt={prompt!r} must be non-empty bytes")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens={n!r} must be an int >= 1")
