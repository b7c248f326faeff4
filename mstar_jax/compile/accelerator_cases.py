"""Attention shapes the offline accelerator checks compile: the test suite asserts on them, and
`benchmarks/accelerators.py` tabulates them.

Each case is one serving geometry: the public attention op on one layer, and a whole jitted step of two
layers through `attend` (each layer's output feeds the next layer's queries, so XLA cannot drop the first
as dead code) with the cache donated. Everything is a `jax.ShapeDtypeStruct`: nothing is allocated.
Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas.sink_window_attention import sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, SinkWindow

__all__ = ["CASES", "DTYPES", "AttentionCase"]

DTYPES = (jnp.bfloat16, jnp.float32)
STEP_LAYERS = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCase:
    """One serving geometry.

    Attributes:
      name: what it stands for.
      batch: B requests (one row each); steps: T tokens per row (1 for decode).
      heads, kv_heads, head_dim: H, G, D.
      window: the ring's window; the sink holds the source (voice) plus `extra_sink` written tokens.
      source_len: L, the source (voice) length.
      slots: S, requests the cache holds.
      query_window: None, or the causal band of a chunked prefill.
    """

    name: str
    batch: int
    steps: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    source_len: int
    slots: int = 64
    extra_sink: int = 4
    query_window: int | None = None

    def config(self, dtype: Any) -> BoundedKVConfig:
        sink, window = self.extra_sink, self.window
        return BoundedKVConfig(
            num_layers=STEP_LAYERS, num_heads=self.kv_heads, head_dim=self.head_dim, rows_per_request=1,
            max_source_len=self.source_len, min_source_len=self.source_len,
            retention=lambda s: SinkWindow(s + sink, window), max_slots=self.slots, dtype=jnp.dtype(dtype),
            query_window=self.query_window,
        )  # fmt: skip

    def layer_bytes(self, dtype: Any) -> int:
        """Bytes of one layer's cache: K and V of every slot, the padding slot included."""
        shape = BoundedKVCache.slot_shape(self.config(dtype))
        return 2 * int(jnp.prod(jnp.asarray(shape))) * jnp.dtype(dtype).itemsize

    def retained_bytes(self, dtype: Any) -> int:
        """Bytes one attention call must read at least: every row's retained K and V, once."""
        per_key = 2 * self.kv_heads * self.head_dim * jnp.dtype(dtype).itemsize
        return self.batch * self.config(dtype).max_retained * per_key

    def step_arrays(self, dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        """(q, k, v, table) of one step."""
        rows = (self.batch, self.steps)
        return (
            jax.ShapeDtypeStruct((*rows, self.heads, self.head_dim), dtype),
            jax.ShapeDtypeStruct((*rows, self.kv_heads, self.head_dim), dtype),
            jax.ShapeDtypeStruct((*rows, self.kv_heads, self.head_dim), dtype),
            jax.ShapeDtypeStruct((self.batch, tbl.ROW_INTS), jnp.int32),
        )

    def score_term_specs(self, dtype: Any, names: tuple[str, ...]) -> dict[str, jax.ShapeDtypeStruct]:
        """Specs of the optional score terms `names` ("rel_bias", "sink_logits"), both float32."""
        width = self.config(dtype).max_retained + 2 * self.steps - 1
        shapes = {"rel_bias": (self.batch, self.heads, self.steps, width), "sink_logits": (self.heads,)}
        return {name: jax.ShapeDtypeStruct(shapes[name], jnp.float32) for name in names}

    def attention(
        self, dtype: Any, implementation: str, score_terms: tuple[str, ...] = ()
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The public op on one layer: (function, argument specs); `score_terms` join as trailing specs."""
        config = self.config(dtype)
        q, k, v, table = self.step_arrays(dtype)
        cache = BoundedKVCache.abstract(config)
        bank = SourceBank.abstract(config, num_sources=4)
        terms = self.score_term_specs(dtype, score_terms)

        def fn(*arrays):
            return sink_window_attention(
                *arrays[:8], **dict(zip(terms, arrays[8:], strict=True)), max_retained=config.max_retained,
                query_window=self.query_window, implementation=implementation,
            )  # fmt: skip

        return fn, (q, k, v, cache.k[0], cache.v[0], bank.k[0], bank.v[0], table, *terms.values())

    def step(self, dtype: Any, implementation: str = "auto") -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """A whole step of `STEP_LAYERS` layers through `attend`: (function, specs); donate argument 0."""
        config = self.config(dtype)
        q, k, v, table = self.step_arrays(dtype)

        def step(cache, bank, table, q, k, v):
            plan = BoundedKVPlan(table)
            for layer in range(config.num_layers):
                q, cache = attend(
                    cache, bank, plan, layer, q, k, v, config=config, implementation=implementation
                )
            return q, cache

        specs = (BoundedKVCache.abstract(config), SourceBank.abstract(config, num_sources=4), table, q, k, v)
        return step, specs


CASES = (
    # The talker's decode: 64 streams, GQA 2, a 3,000-token ring (3,004 slot tokens, not a multiple of 8).
    AttentionCase(
        name="decode_d64", batch=64, steps=1, heads=16, kv_heads=8, head_dim=64, window=3000, source_len=250
    ),
    AttentionCase(
        name="decode_d128", batch=64, steps=1, heads=16, kv_heads=8, head_dim=128, window=3000, source_len=250
    ),
    # A 24-frame voice: its bank keeps D = 64 in lanes while the slots (1,004 tokens, allocated 1,024)
    # keep tokens in lanes, so the kernel reads its two stores in different orientations. 256 slots keep
    # the layer out of reach of XLA's memory-space assignment where the store is not pinned to HBM (libtpu
    # before 0.0.50: see test_tpu_offline's known gap).
    AttentionCase(
        name="decode_d64_short_voice",
        batch=32,
        steps=1,
        heads=8,
        kv_heads=4,
        head_dim=64,
        window=1000,
        source_len=24,
        slots=256,
    ),
    # Batch 128 over one KV head (MQA, group 8), a ring of 1,001.
    AttentionCase(
        name="decode_mqa",
        batch=128,
        steps=1,
        heads=8,
        kv_heads=1,
        head_dim=128,
        window=997,
        source_len=100,
        slots=128,
    ),
    # Wide heads and the longest retained set: 8,192 keys (8,000 window + 188 voice + 4).
    AttentionCase(
        name="decode_d256_8k",
        batch=16,
        steps=1,
        heads=16,
        kv_heads=4,
        head_dim=256,
        window=8000,
        source_len=188,
        slots=16,
    ),
    # Prefill chunks: 128 tokens without GQA, 16 tokens with group 8, 64 tokens with a causal band.
    AttentionCase(
        name="prefill_d64_t128",
        batch=4,
        steps=128,
        heads=8,
        kv_heads=8,
        head_dim=64,
        window=3000,
        source_len=250,
    ),
    AttentionCase(
        name="prefill_d128_t16",
        batch=8,
        steps=16,
        heads=64,
        kv_heads=8,
        head_dim=128,
        window=4093,
        source_len=100,
    ),
    AttentionCase(
        name="prefill_d256_t64",
        batch=2,
        steps=64,
        heads=4,
        kv_heads=1,
        head_dim=256,
        window=2043,
        source_len=64,
        query_window=64,
    ),
)
