"""A chunk node: another node's tokens, a fixed chunk at a time, turned into outputs the client is handed.

A streaming model's second stage (a flow or codec decoder turning a talker's codes into audio) reads
what its first stage generated: whenever a stream's source node has `chunk` tokens the chunk node has
not read, or its last ones once the source is done, the chunk node runs a row of them at the stream's
next positions in its own caches. Its step returns every row's outputs (`values`, one entry per token);
a row's are handed to the client as a `ChunkOutput`, in order, and the stream is done once the last
chunk of a finished source is handed on.

The node reads only what its source generated since the source's start or its last rewind
(`DecoderProgress.generated`): after a fault the source regenerates its tokens first, and the chunk
node's replay (its progress rewound to a snapshot) recomputes chunks the client has, which must come out
bit for bit the same and are not handed on again: one replay mechanism, the same as the decoder's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.compile import Buckets, CapturedStep, capture
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.kv.bounded.sharding import DATA
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.model import InFlight, Node, StreamOps, notify
from mstar_jax.serving.nodes import GraphPrograms, ServedNode
from mstar_jax.serving.stream import ReplayMismatchError, Stream

__all__ = ["ChunkNode", "ChunkOutput", "ChunkProgress", "ChunkRow", "capture_chunks"]


@dataclasses.dataclass(eq=False)
class ChunkProgress:
    """A stream's progress on a chunk node.

    Attributes:
      written: source tokens read, each an entry of the node's caches.
      delivered: source tokens whose outputs the client was handed (never rewound).
    """

    written: int = 0
    delivered: int = 0


class ChunkRow(NamedTuple):
    """One stream's part of a chunk step: source tokens `[start, start + len(tokens))`."""

    stream: Stream
    start: int
    tokens: tuple[int, ...]

    @property
    def span(self) -> int:
        return len(self.tokens)


class ChunkOutput(NamedTuple):
    """What a chunk node hands the client for one chunk.

    Attributes:
      start: the first source token it covers.
      tokens: i32[span], the source tokens read.
      values: the node's outputs for them, `[span, ...]`.
    """

    start: int
    tokens: np.ndarray
    values: np.ndarray


class ChunkNode(ServedNode):
    """A node reading `source`'s tokens a fixed chunk at a time (module doc).

    Args:
      node: its `Node` (it does not feed).
      source: the node whose tokens it reads (a `DecoderNode`, not `final`).
      buckets: its programs' buckets, of one walk.
      chunk: source tokens a row reads, at most (a row reads fewer only at the source's end).
      progress_of: a stream's progress on the node (`ChunkProgress`).
    """

    def __init__(
        self, node: Node, source: Any, *, buckets: Buckets, chunk: int,
        progress_of: Callable[[Stream], ChunkProgress],
    ):  # fmt: skip
        (self.walk,) = buckets.walks
        if not 1 <= chunk <= buckets.max_tokens(self.walk):
            raise ValueError(
                f"chunk={chunk} must be in [1, {buckets.max_tokens(self.walk)}], its bucket's tokens"
            )
        self.node, self.source, self.buckets = node, source, buckets
        self.chunk, self.progress_of, self.programs = chunk, progress_of, None

    @classmethod
    def capture(
        cls, name: str, step: Callable, manager: Any, params: Any, buckets: Buckets, source: Any, *,
        chunk: int, progress_of: Callable[[Stream], ChunkProgress], mesh: Any = None, **options: Any,
    ) -> ChunkNode:  # fmt: skip
        """The chunk node of `step` over one cache (`manager`, on `mesh` already), its programs captured for
        `buckets` (`capture_chunks`; `options`: its keywords, `static_kwargs` defaulting to the cache's
        `config` and the `mesh`, as `layer_attention` takes them) and its weights `params` (placed)."""
        options.setdefault("static_kwargs", {"config": manager.config, "mesh": mesh})
        cache, bank = manager.cache, manager.bank
        steps = capture_chunks(step, buckets, params, cache, bank, name=name, mesh=mesh, **options)
        runner, keys = ResourceRunner({manager.spec.resource_key: manager}), (manager.spec.resource_key,)
        programs = GraphPrograms(buckets, steps)
        return cls.of(name, runner, keys, params, programs, source, chunk=chunk, progress_of=progress_of)

    @classmethod
    def of(
        cls, name: str, runner: ResourceRunner, keys: tuple[str, ...], params: Any, programs: Any,
        source: Any, **options: Any,
    ) -> ChunkNode:  # fmt: skip
        """The chunk node of `programs` (with `buckets`, as `GraphPrograms`), its `Node` made from the rest;
        `options`: `chunk`, `progress_of`."""
        node = Node(name, runner, keys, params, programs.buckets.walks)
        served = cls(node, source, buckets=programs.buckets, **options)
        served.programs = programs
        return served

    def new_progress(self) -> ChunkProgress:
        return ChunkProgress()

    def rows(
        self, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        """Every stream with a whole chunk of unread source tokens, or its last ones once the source is
        done, first come first served, at most `max_batch`."""
        rows, chunk, source = [], self.chunk, self.source.progress_of
        for stream in streams:
            if stream.phase.finished or stream.paused or stream.hold_until > now:
                continue
            p, src = self.progress_of(stream), source(stream)
            ready = src.generated - p.written
            if ready >= chunk or (ready > 0 and src.finished):
                rows.append(
                    ChunkRow(stream, p.written, tuple(src.tokens[p.written : p.written + min(chunk, ready)]))
                )
                if len(rows) == max_batch:
                    break
        return [(rows, self.walk)]

    def choose_bucket(self, rows: Sequence[ChunkRow], *, rows_per_shard: int | None = None) -> BucketKey:
        return self.buckets.bucket_for(self.walk, rows_per_shard or len(rows), max(row.span for row in rows))

    def position(self, stream: Stream) -> StreamPosition:
        return StreamPosition(0, self.progress_of(stream).written)

    def inputs(self, bucket: BucketKey, rows: Sequence[ChunkRow], layout: Any) -> tuple:
        """`tokens i32[B, T]`, `lengths i32[B]`; with a `layout` (a mesh), `B` is its row count and each
        request's row is where it says."""
        size = bucket.bs if layout is None else layout[0]
        places = range(len(rows)) if layout is None else [layout[1][row.stream.request_id] for row in rows]
        tokens, lengths = np.zeros((size, bucket.num_tokens), np.int32), np.zeros(size, np.int32)
        for i, row in zip(places, rows, strict=True):
            tokens[i, : row.span], lengths[i] = row.tokens, row.span
        return tokens, lengths

    def dispatched(self, step: InFlight, now: float) -> None:
        for row in step.rows:
            self.progress_of(row.stream).written += row.span
            row.stream.last_step_at = now

    def outputs_of(self, step: InFlight, outputs: Any) -> list:
        """What the client is handed for each of the step's rows, in order: a tuple whose first field is
        the row's `start` (default: a `ChunkOutput` of the row's entries of `outputs`)."""
        return [
            ChunkOutput(row.start, np.asarray(row.tokens, np.int32), np.asarray(outputs[index, : row.span]))
            for row, index in zip(step.rows, step.indices, strict=True)
        ]

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        for row, output in zip(step.rows, self.outputs_of(step, outputs), strict=True):
            stream = row.stream
            if stream.phase.finished:  # cancelled by an earlier row's callback, or before it came back
                continue
            p = self.progress_of(stream)
            if row.start < p.delivered:  # replayed after a fault: the client has it
                before = next((o for o in reversed(stream.outputs) if o[0] == row.start), None)
                if before is None or not _same(before, output):
                    ops.fail(stream, ReplayMismatchError(
                        f"request {stream.request_id!r}: replaying after a fault, the {self.node.name} "
                        f"node's outputs of tokens [{row.start}, {row.start + row.span}) differ from those "
                        "delivered"
                    ))  # fmt: skip
                continue
            stream.outputs.append(output)
            p.delivered = row.start + row.span
            if stream.first_output_at is None:
                stream.first_output_at = now
            if not notify(stream, stream.on_output, output, ops, name="on_output"):
                continue  # the callback raised, or cancelled its own stream
            src = self.source.progress_of(stream)
            if src.finished and p.delivered == len(src.tokens):  # every output handed on
                ops.done(stream)

    def mark(self, stream: Stream) -> int:
        return self.progress_of(stream).written

    def rewind(self, stream: Stream, mark: int | None) -> None:
        self.progress_of(stream).written = mark or 0


def _same(a: tuple, b: tuple) -> bool:
    """Whether two outputs of one chunk agree in every field, to the bit."""
    return len(a) == len(b) and all(_bits(x) == _bits(y) for x, y in zip(a, b, strict=True))


def _bits(value: Any) -> tuple:
    array = np.asarray(value)
    return array.dtype, array.shape, array.tobytes()


def capture_chunks(
    step: Callable,
    buckets: Buckets,
    params: Any,
    caches: Any,
    banks: Any,
    *,
    name: str,
    mesh: Any = None,
    progress: bool = False,
    **options: Any,
) -> dict[str, CapturedStep]:
    """`step` captured for every bucket of the chunk node's walk, from abstract arguments of the arrays.

    Args:
      step: `step(params, caches, banks, plans, tokens i32[B, T], lengths i32[B], **static) -> (caches,
        values [B, T, ...])`.
      buckets: its buckets (one walk).
      params, caches, banks: the node's weights, caches and source banks (a cache and its bank, or tuples
        of them: the plans are then a tuple too, one a cache).
      name: the programs' name.
      mesh: the `(data, model)` mesh the arrays live on (None: one device); a bucket's `B` then counts
        one data shard's rows, and its arrays hold every shard's.
      progress: show a progress bar.
      options: the rest of `capture`'s keywords (`static_kwargs`, `store`, `fingerprint`).

    Returns:
      walk -> `CapturedStep`.
    """
    shards = 1 if mesh is None else mesh.shape[DATA]
    split = None if mesh is None else NamedSharding(mesh, P(DATA))
    several = isinstance(caches, tuple)
    head = tuple(abstract(x, sharded=mesh is not None) for x in (params, caches, banks))

    def arguments(bucket: BucketKey) -> tuple:
        size, span = shards * bucket.bs, bucket.num_tokens
        plan = BoundedKVPlan.abstract(size, span, split)
        plans = (plan,) * len(caches) if several else plan
        return (*head, plans, shaped((size, span), jnp.int32, split), shaped((size,), jnp.int32, split))

    options = {"donate_argnums": (1,), "frozen_argnums": (0,), "progress": progress, **options}
    return {
        walk: capture(step, buckets[walk].keys(), arguments, name=f"{name} {walk}", **options)
        for walk in buckets.walks
    }
