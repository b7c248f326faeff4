"""Gemma 3 streams on the bounded caches: the two cache specs, their managers, and the step.

`Gemma3Streams` holds the model's weights and two `BoundedKVManager`s (local and global layers, see
`model.py`), and runs requests through them: each step is admitted, planned and committed by both
caches, and runs one jitted program per step shape (prefill chunks of `chunk` tokens, or one token),
the caches donated. `score` streams a text through in chunks and returns every token's log-probability,
`logits` every position's logits (for short texts), `greedy` continues a prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.models.gemma3.gguf import Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

__all__ = ["GLOBAL_KV", "LOCAL_KV", "Gemma3Streams", "cache_configs"]

LOCAL_KV, GLOBAL_KV = "gemma3_local_kv", "gemma3_global_kv"


def cache_configs(
    config: Gemma3Config, *, global_retention: SinkWindow, max_slots: int = 1, dtype=jnp.float32
) -> tuple[BoundedKVConfig, BoundedKVConfig]:
    """The local and global layers' cache configs.

    Local layers keep the last `sliding_window - 1` positions and attend a causal band of
    `sliding_window` (Gemma's window, which counts the query's own position). Global layers keep what
    `global_retention` says and attend a band of its window + 1, so a prefill chunk attends exactly
    what one-token steps would.

    Raises:
      ValueError: for a retention that is not a `SinkWindow` of ints, or a window below 1.
    """
    if not isinstance(global_retention, SinkWindow) or global_retention.window < 1:
        raise ValueError(f"global_retention={global_retention!r} must be a SinkWindow(sink, window >= 1)")
    if global_retention.window_includes_step:
        raise ValueError(
            f"global_retention={global_retention!r} has window_includes_step=True: it must be False (the "
            "causal band of window + 1 already counts the step's own position)"
        )
    layers = sum(config.is_global(i) for i in range(config.num_layers))
    common = {
        "num_heads": config.num_kv_heads, "head_dim": config.head_dim, "rows_per_request": 1,
        "max_source_len": 0, "max_slots": max_slots, "dtype": dtype,
    }  # fmt: skip
    window = config.sliding_window
    local = BoundedKVConfig(
        num_layers=config.num_layers - layers,
        retention=SinkWindow(0, window - 1),
        query_window=window,
        **common,
    )
    global_ = BoundedKVConfig(
        num_layers=layers, retention=global_retention, query_window=global_retention.window + 1, **common
    )
    return local, global_


class Gemma3Streams:
    """A Gemma 3 model serving streams on its two bounded caches.

    Args:
      config: the model's geometry.
      model: the weights (`Gemma3.from_tensors`).
      global_retention: what the global layers keep (`SinkWindow(0, n)` with `n` at least the stream's
        length is the dense model).
      max_slots: streams served at once.
      chunk: prefill tokens per step.
      implementation, interpret: the attention implementation (`sink_window_attention`).
    """

    def __init__(
        self,
        config: Gemma3Config,
        model: Gemma3,
        *,
        global_retention: SinkWindow,
        max_slots: int = 1,
        chunk: int = 128,
        implementation: str = "auto",
        interpret=False,
    ):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be an int >= 1")
        self.config, self.chunk = config, chunk
        dtype = model.embed[...].dtype
        local, global_ = cache_configs(
            config, global_retention=global_retention, max_slots=max_slots, dtype=dtype
        )
        self.local = BoundedKVManager(BoundedKVSpec(LOCAL_KV, {"gemma3"}, local), num_sources=1)
        self.global_ = BoundedKVManager(BoundedKVSpec(GLOBAL_KV, {"gemma3"}, global_), num_sources=1)
        self._graphdef, self.params = nnx.split(model)
        self._step = jax.jit(
            functools.partial(self.step, implementation=implementation, interpret=interpret),
            donate_argnums=(1,),
            static_argnames=("all_logits",),
        )
        self._counter = 0

    @property
    def managers(self) -> tuple[BoundedKVManager, BoundedKVManager]:
        return self.local, self.global_

    def step(
        self, params, caches, banks, tables, tokens: jax.Array, lengths: jax.Array, *, all_logits: bool,
        implementation: str = "auto", interpret=False,
    ):  # fmt: skip
        """One step of every row: prefill chunks or one-token decode, the same code.

        Args:
          params: the model's state (`nnx.split`).
          caches, banks: (local, global) caches (donated) and source banks.
          tables: (local, global) plan tables, i32[B, ROW_INTS] each.
          tokens: i32[B, T]; row b's first `lengths[b]` are real.
          lengths: i32[B].
          all_logits: static; return every position's logits (f32[B, T, V]) rather than the last real
            token's (f32[B, V]).

        Returns:
          (caches, logits).
        """
        model = nnx.merge(self._graphdef, params)
        configs = (self.local.config, self.global_.config)
        positions = (
            tables[0][:, tbl.STREAM_LEN][:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        )

        def attend_fn(state, is_global, index, q, k, v):
            kind = int(is_global)
            config = configs[kind]
            out, cache = attend(
                state[kind], banks[kind], BoundedKVPlan(tables[kind]), index, q.astype(config.dtype),
                k.astype(config.dtype), v.astype(config.dtype), config=config,
                implementation=implementation, interpret=interpret,
            )  # fmt: skip
            caches = (cache, state[1]) if kind == 0 else (state[0], cache)
            return out, caches

        hidden, caches = model(tokens, positions, caches, attend_fn)
        if not all_logits:
            last = jnp.maximum(lengths - 1, 0)
            hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return caches, model.logits(hidden)

    def _run(self, rids: Sequence[str], spans: Sequence[int], tokens: np.ndarray, *, all_logits: bool):
        """Admit, plan, run and commit one step of `rids` (each writing its `span` tokens) on both caches."""
        b, t = tokens.shape
        step = BoundedKVStep(
            tuple(Segment(rid, "main", span) for rid, span in zip(rids, spans, strict=True)),
            {rid: StreamPosition(0, self.local.written(rid)) for rid in rids},
            dict(zip(rids, spans, strict=True)),
        )
        ctx = StepContext(
            list(rids), "gemma3", 0, capture=False, slot_lease=SlotLease(0, BucketKey("gemma3", b, t))
        )
        tables = []
        for manager in self.managers:
            outcome = manager.admit(step, ctx)
            if not outcome.ok:
                raise RuntimeError(f"{manager.spec.resource_key} refused the step: {outcome.reason}")
            tables.append(manager.plan(step, ctx).table)
        caches = (self.local.cache, self.global_.cache)
        banks = (self.local.bank, self.global_.bank)
        lengths = np.asarray(spans, np.int32)
        caches, logits = self._step(
            self.params, caches, banks, tuple(tables), tokens, lengths, all_logits=all_logits
        )
        self.local.cache, self.global_.cache = caches
        for manager in self.managers:
            manager.commit(step, ctx)
        return logits

    def _open(self) -> str:
        self._counter += 1
        rid = f"stream{self._counter}"
        for manager in self.managers:
            manager.ingest_request(rid)
        return rid

    def _close(self, rid: str) -> None:
        for manager in self.managers:
            manager.remove_request(rid)

    def _stream(self, tokens: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """Stream `tokens` through one new request in chunks; yield each chunk's start and its logits at
        every real position, f32[chunk length, V]. The request's slots are given back at the end."""
        rid = self._open()
        try:
            for start in range(0, len(tokens), self.chunk):
                piece = tokens[start : start + self.chunk]
                padded = np.zeros((1, self.chunk), np.int32)
                padded[0, : len(piece)] = piece
                logits = self._run([rid], [len(piece)], padded, all_logits=True)
                yield start, np.asarray(logits)[0, : len(piece)]
        finally:
            self._close(rid)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """f32[len, V]: the next-token logits after each prefix of `tokens` (a short text: V floats each)."""
        return np.concatenate([logits for _, logits in self._stream(np.asarray(tokens, np.int32))])

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Stream `tokens` through in chunks; return f64[len - 1] the log-probability of each token after
        the first given those before it (as the bounded caches retain them), at flat memory."""
        tokens = np.asarray(tokens, np.int32)
        scores = []
        for start, logits in self._stream(tokens[:-1]):
            targets = tokens[start + 1 : start + 1 + len(logits)]
            logits = logits.astype(np.float64)
            top = logits.max(axis=-1, keepdims=True)
            log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
            scores.append(logits[np.arange(len(targets)), targets] - log_norm)
        return np.concatenate(scores) if scores else np.zeros(0)

    def greedy(self, prompt: Sequence[int], count: int) -> list[int]:
        """The `count` tokens greedy decoding appends to `prompt` (prefilled in chunks)."""
        prompt = np.asarray(prompt, np.int32)
        rid, out = self._open(), []
        try:
            for start in range(0, len(prompt), self.chunk):
                piece = prompt[start : start + self.chunk]
                padded = np.zeros((1, self.chunk), np.int32)
                padded[0, : len(piece)] = piece
                logits = self._run([rid], [len(piece)], padded, all_logits=False)
            for _ in range(count):
                out.append(int(np.argmax(np.asarray(logits)[0])))
                logits = self._run([rid], [1], np.asarray([[out[-1]]], np.int32), all_logits=False)
        finally:
            self._close(rid)
        return out
