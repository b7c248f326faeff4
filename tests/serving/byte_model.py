"""A third model in one file: a two-layer byte decoder (vocab 256, greedy) served by `ServingEngine`.

One bounded cache: query i sees keys j <= i with j < 2 or i - j <= 6 (`RETENTION`, a causal band of 7). One
feeding node, one walk: decode rows (a byte `fed` on the device) and prefill rows (prompt chunks) share it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import Buckets, BucketSet, CapturedStep, cap_batch_sizes, capture
from mstar_jax.resources.kv import bounded as kv
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving import abstract, layer_attention, shaped
from mstar_jax.serving.feed import fed
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.stream import Phase, ReplayMismatchError, Stream

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


def step(params, cache, bank, plan: kv.BoundedKVPlan, tokens: jax.Array, lengths: jax.Array, *, config):
    """Every row's next greedy byte: tokens i32[B, T] (row b's first lengths[b] real) -> (cache, i32[B])."""
    attention = layer_attention(config, bank, plan)
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


@dataclasses.dataclass(eq=False)
class ByteStream(Stream):
    """`tokens` delivered (kept through a fault), `generated` since a rewind, `in_flight` unread, `feed`."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    on_output: Callable[[int], None] = lambda byte: None
    written: int = 0
    generated: int = 0
    in_flight: int = 0
    feed: tuple[int, int] | None = None  # (step serial, row) of its newest byte, still on the device

    def written_in(self, node: str) -> int:
        return self.written


class ByteRow(NamedTuple):
    """A stream's part of a step: `tokens` written (a placeholder when `feed` >= 0 names its row)."""

    stream: ByteStream
    tokens: tuple[int, ...]
    decode: bool
    feed: int = -1
    span = property(lambda row: len(row.tokens))


@dataclasses.dataclass(frozen=True, eq=False)
class BytePrograms:
    """The fed step captured per bucket (`capture`), its outputs padded to the most rows a bucket has."""

    buckets: Buckets
    steps: dict[str, CapturedStep]

    @classmethod
    def capture(cls, params: dict, manager: kv.BoundedKVManager, chunk: int) -> BytePrograms:
        sizes = cap_batch_sizes((1,), manager.config.max_slots)
        buckets = Buckets((BucketSet(graph_walk=WALK, batch_sizes=sizes, token_counts=(chunk,)),))
        i32 = lambda *shape: shaped(shape, jnp.int32)  # noqa: E731
        arguments = lambda b: (  # noqa: E731
            abstract(params), abstract(manager.cache), abstract(manager.bank),
            kv.BoundedKVPlan(i32(b.bs, tbl.ROW_INTS), num_tokens=b.num_tokens),
            i32(sizes[-1]), i32(b.bs), i32(b.bs, b.num_tokens), i32(b.bs),
        )  # fmt: skip
        program = capture(fed(step, width=sizes[-1]), buckets[WALK].keys(), arguments, donate_argnums=(1,),
                          static_kwargs={"config": manager.config}, name="bytes", progress=False)  # fmt: skip
        return cls(buckets=buckets, steps={WALK: program})


class ByteServing(ServedModel):
    """The byte model as the engine serves it: `slots` streams at once (module doc)."""

    def __init__(self, params: dict, *, slots: int, chunk: int = 4, programs: BytePrograms | None = None):
        config = kv.BoundedKVConfig(num_layers=len(params["layers"]), num_heads=1, head_dim=HEAD_DIM,
                                 rows_per_request=1, max_source_len=0, retention=RETENTION, max_slots=slots,
                                 query_window=RETENTION.window + 1)  # fmt: skip
        self.manager = kv.BoundedKVManager(kv.BoundedKVSpec(CACHE, {NODE}, config), num_sources=1)
        self.programs = programs or BytePrograms.capture(params, self.manager, chunk)
        self.chunk = self.programs.buckets.max_tokens(WALK)
        no_feed = jnp.zeros(self.programs.buckets.max_batch(WALK), jnp.int32)  # nothing in flight: unread
        runner = ResourceRunner({CACHE: self.manager})
        self.nodes = (Node(NODE, runner, (CACHE,), params, (WALK,), feeds=True, no_feed=no_feed),)

    def new_stream(self, request: Any, *, on_output: Any, now: float) -> ByteStream:
        if not isinstance(request, ByteRequest):
            raise TypeError(f"request={request!r} must be a ByteRequest")
        rid, prompt, n = request.request_id, request.prompt, request.max_new_tokens
        if not isinstance(prompt, bytes) or not prompt:
            raise ValueError(f"request {rid!r}: prompt={prompt!r} must be non-empty bytes")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens={n!r} must be an int >= 1")
        return ByteStream(request, on_output=on_output or ByteStream.on_output, submitted_at=now)

    def outputs(self, stream: ByteStream) -> list[int]:
        return stream.tokens

    def rows(self, node: Node, streams: Sequence[ByteStream], *, now: float, max_batch: int, in_flight=None):
        decode, prefill = [], []
        for s in streams:
            if s.phase.finished or s.phase is Phase.FLUSH or s.paused or s.hold_until > now:
                continue
            if s.phase is not Phase.DECODE:
                prefill.append(ByteRow(s, tuple(s.request.prompt[s.written :][: self.chunk]), False))
            elif s.feed is not None and s.feed[0] == in_flight:
                decode.append(ByteRow(s, (0,), True, feed=s.feed[1]))
            else:
                decode.append(ByteRow(s, (s.tokens[s.generated - 1],), True))
        rows = decode + prefill  # every stream's row, in programs of at most max_batch
        return [(rows[i : i + max_batch], WALK) for i in range(0, len(rows), max_batch)]

    def choose_bucket(self, node: Node, rows: Sequence[ByteRow], *, rows_per_shard=None) -> BucketKey:
        return self.programs.buckets.bucket_for(WALK, rows_per_shard or len(rows), max(r.span for r in rows))

    def position(self, node: Node, stream: ByteStream) -> kv.StreamPosition:
        return kv.StreamPosition(0, stream.written)

    def inputs(self, node: Node, bucket: BucketKey, rows: Sequence[ByteRow], layout: Any) -> tuple:
        feed, lengths = np.full(bucket.bs, -1, np.int32), np.zeros(bucket.bs, np.int32)
        tokens = np.zeros((bucket.bs, bucket.num_tokens), np.int32)
        for i, row in enumerate(rows):
            feed[i], lengths[i], tokens[i, : row.span] = row.feed, row.span, row.tokens
        return feed, tokens, lengths

    def dispatched(self, step: InFlight, now: float) -> None:
        emits = []
        for (s, tokens, decode, _), index in zip(step.rows, step.indices, strict=True):
            s.written, s.last_step_at = s.written + len(tokens), now  # a prompt is all written before decode
            emits.append(decode or s.written == len(s.request.prompt))
            if emits[-1]:
                s.in_flight, s.feed = s.in_flight + 1, (step.serial, index)
            last = s.generated + s.in_flight == s.request.max_new_tokens  # no step needs it as input: FLUSH
            s.phase = Phase.FLUSH if last else Phase.DECODE if emits[-1] else Phase.PREFILL
        step.emits = tuple(emits)

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        for (s, *_), index, emits in zip(step.rows, step.indices, step.emits, strict=True):
            if s.phase.finished or not emits:
                continue
            s.feed = None if s.feed == (step.serial, index) else s.feed
            s.in_flight, s.faults, at = s.in_flight - 1, 0, s.generated
            token, s.generated = int(outputs[index]), at + 1
            if at < len(s.tokens) and s.tokens[at] != token:  # a replay must redo what was delivered
                ops.fail(s, ReplayMismatchError(f"replayed byte {at} is {token}, not {s.tokens[at]}"))
            elif at == len(s.tokens):  # a new byte (a replay's bytes were delivered before)
                s.tokens.append(token)
                s.on_output(token)
            if s.generated == s.request.max_new_tokens and not s.phase.finished:
                ops.done(s)

    def mark(self, stream: ByteStream) -> tuple:
        return (stream.phase, stream.written, stream.generated)

    def rewind(self, stream: ByteStream, node: Node, mark: tuple | None) -> None:
        stream.phase, stream.written, stream.generated = mark or (Phase.WAITING, 0, 0)
        stream.in_flight, stream.feed = 0, None  # the engine rewinds only with nothing in flight
