"""Gemma 3 as the engine serves it: text requests in, greedy tokens out, on its two bounded caches.

`Gemma3Serving` is the model's part of `mstar_jax.serving.ServedModel`: one node, `gemma3`, whose step
runs both caches (local and global layers, `Gemma3Streams`) and returns each row's next greedy token. It
feeds: a decode row reads its input token from the previous step's outputs on the device, so a pipelined
engine dispatches step t + 1 before it reads step t. Each round runs a decode program of one token for
every stream generating, then a prefill program of prompt chunks (new streams read `chunk` tokens a
row); a stream's last chunk gives its first token. Served through `mstar_jax.engine.ServingEngine`, every
stream gets `Gemma3Streams.greedy`'s tokens exactly, alone or in a crowd, synchronous or pipelined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.checks import check_int
from mstar_jax.compile import Buckets, CapturedStep, capture
from mstar_jax.models.gemma3.stream import DECODE, GLOBAL_KV, LOCAL_KV, PREFILL, Gemma3Streams
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.feed import fed
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.stream import Phase, ReplayMismatchError, RequestError, Stream

__all__ = ["GEMMA3", "Gemma3Programs", "Gemma3Serving", "TextRequest", "TextRow", "TextStream"]

GEMMA3 = "gemma3"
"""The one node's name."""


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """Continue `prompt` greedily for at most `max_new_tokens` tokens.

    Attributes:
      request_id: unique among live requests.
      prompt: i32[tokens] token ids (at least one).
      max_new_tokens: tokens to generate, at most.
      stop_tokens: generation ends after any of these (it is kept, as the last token).
    """

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} must be a non-empty str")
        for name in ("prompt", "stop_tokens"):
            values = np.asarray(getattr(self, name))
            if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
                raise ValueError(
                    f"request {self.request_id!r}: {name}={getattr(self, name)!r} must be one sequence of "
                    "integer token ids"
                )
            object.__setattr__(self, name, tuple(int(t) for t in values))
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r}: prompt is empty; it needs at least one token")
        check_int(f"request {self.request_id!r}: max_new_tokens", self.max_new_tokens, minimum=1)


@dataclasses.dataclass(eq=False)
class TextStream(Stream):
    """A text request's progress and tokens; `request` is its `TextRequest`.

    Attributes:
      tokens: the tokens delivered so far (a fault's replay never takes one back).
      generated: tokens the stream's steps have generated since its start or its last rewind; behind
        `len(tokens)` while a replay regenerates delivered tokens, which must come out the same.
      on_token: called with each new token (from the engine's thread).
      first_token_at: clock stamp of its first token (None until then).
      prefilled: prompt tokens read.
      written: entries committed to both caches.
      tokens_in_flight: tokens of steps dispatched but not read back yet (a pipelined engine).
      feed: `(step, row)`: where the newest of those tokens sits in that step's device output; None once
        read.
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    generated: int = 0
    on_token: Callable[[int], None] | None = None
    first_token_at: float | None = None
    prefilled: int = 0
    written: int = 0
    tokens_in_flight: int = 0
    feed: tuple[int, int] | None = None

    def written_in(self, node: str) -> int:
        return self.written

    @property
    def tokens_scheduled(self) -> int:
        """Tokens generated or being generated."""
        return self.generated + self.tokens_in_flight


@dataclasses.dataclass(frozen=True)
class TextRow:
    """One stream's part of a step: `tokens` written at its end; `feed` >= 0: the token is the step in
    flight's output at that row (`tokens` is then a placeholder)."""

    stream: TextStream
    tokens: tuple[int, ...]
    decode: bool
    feed: int = -1

    @property
    def span(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class Gemma3Programs:
    """The fed `next`-token step of every bucket (`Gemma3Programs.capture`).

    Attributes:
      buckets: `Gemma3Streams.buckets` (prefill and decode walks).
      steps: walk -> `CapturedStep`; each takes `(params, caches, banks, plans, prev_tokens i32[C],
        feed i32[B], tokens i32[B, T], lengths i32[B], targets i32[B, T])` and returns the caches and
        every row's next token, padded to `C`.
      width: `C`, the most rows any program runs.
    """

    buckets: Buckets
    steps: dict[str, CapturedStep]
    width: int

    @classmethod
    def capture(cls, streams: Gemma3Streams, *, progress: bool = False) -> Gemma3Programs:
        """Compile every bucket ahead of time (or load it from `streams`' executable store)."""
        buckets = streams.buckets
        width = max(buckets.max_batch(walk) for walk in buckets.walks)

        def arguments(bucket: BucketKey) -> tuple:
            rows, tokens = bucket.bs, bucket.num_tokens
            table = BoundedKVPlan(shaped((rows, tbl.ROW_INTS), jnp.int32), num_tokens=tokens)
            ids = shaped((rows, tokens), jnp.int32)
            return (
                abstract(streams.params), abstract((streams.local.cache, streams.global_.cache)),
                abstract((streams.local.bank, streams.global_.bank)), (table, table),
                shaped((width,), jnp.int32), shaped((rows,), jnp.int32), ids, shaped((rows,), jnp.int32), ids,
            )  # fmt: skip

        step, steps = fed(streams.step_fn, width=width), {}
        fingerprint = ("fed", width, streams.config, streams.local.config, streams.global_.config)
        for walk in buckets.walks:
            steps[walk] = capture(
                step, buckets[walk].keys(), arguments, static_kwargs={"head": "next"}, donate_argnums=(1,),
                name=f"gemma3 fed {walk}", progress=progress, store=streams.store, fingerprint=fingerprint,
            )  # fmt: skip
        return cls(buckets=buckets, steps=steps, width=width)


class Gemma3Serving(ServedModel):
    """Gemma 3 served by the engine (module doc).

    Args:
      streams: the weights, both caches and their buckets.
      programs: the captured programs (`Gemma3Programs.capture(streams)`, the default).
    """

    def __init__(self, streams: Gemma3Streams, programs: Gemma3Programs | None = None):
        if not isinstance(streams, Gemma3Streams):
            raise TypeError(f"streams={streams!r} must be a Gemma3Streams")
        if programs is not None and not isinstance(programs, Gemma3Programs):
            raise TypeError(f"programs={programs!r} must be a Gemma3Programs (Gemma3Programs.capture)")
        self.streams = streams
        self.programs = programs or Gemma3Programs.capture(streams)
        no_feed = jax.device_put(jnp.zeros((self.programs.width,), jnp.int32))
        keys = (LOCAL_KV, GLOBAL_KV)
        walks = self.programs.buckets.walks
        self.nodes = (Node(GEMMA3, streams.runner, keys, streams.params, walks, feeds=True, no_feed=no_feed),)

    # -- requests -----------------------------------------------------------------------------------

    def new_stream(self, request: Any, *, on_output: Any, now: float) -> TextStream:
        if not isinstance(request, TextRequest):
            raise TypeError(f"request={request!r} must be a TextRequest")
        vocab = self.streams.config.vocab_size
        for name in ("prompt", "stop_tokens"):
            bad = [t for t in getattr(request, name) if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"request {request.request_id!r}: {name} tokens {bad[:5]} are outside "
                    f"[0, vocab_size={vocab})"
                )
        return TextStream(request, on_token=on_output, submitted_at=now)

    def outputs(self, stream: TextStream) -> list[int]:
        return stream.tokens

    # -- scheduling ---------------------------------------------------------------------------------

    def rows(
        self, node: Node, streams: Sequence[TextStream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        decode, prefill = [], []
        chunk = self.streams.chunk
        for stream in streams:
            if stream.phase.finished or stream.paused or stream.hold_until > now:
                continue
            if stream.phase is Phase.FLUSH:
                continue
            if stream.phase is Phase.DECODE:
                if stream.feed is not None and stream.feed[0] == in_flight:
                    decode.append(TextRow(stream, (0,), decode=True, feed=stream.feed[1]))
                else:
                    decode.append(TextRow(stream, (stream.tokens[stream.generated - 1],), decode=True))
            else:
                prompt = stream.request.prompt
                prefill.append(
                    TextRow(stream, prompt[stream.prefilled : stream.prefilled + chunk], decode=False)
                )
        return [(decode[:max_batch], DECODE), (prefill[:max_batch], PREFILL)]

    def choose_bucket(self, node: Node, rows: Sequence, *, rows_per_shard: int | None = None) -> BucketKey:
        span = max(row.span for row in rows)
        walk = DECODE if span == 1 else PREFILL  # as Gemma3Streams.declare picks it, so tokens are the same
        return self.programs.buckets.bucket_for(walk, rows_per_shard or len(rows), span)

    def position(self, node: Node, stream: TextStream) -> StreamPosition:
        return StreamPosition(0, stream.written)

    def inputs(self, node: Node, bucket: BucketKey, rows: Sequence[TextRow], layout: Any) -> tuple:
        size, width = bucket.bs, bucket.num_tokens
        feed = np.full(size, -1, np.int32)
        tokens = np.zeros((size, width), np.int32)
        lengths = np.zeros(size, np.int32)
        for i, row in enumerate(rows):
            feed[i], lengths[i] = row.feed, row.span
            tokens[i, : row.span] = row.tokens
        return feed, tokens, lengths, np.zeros_like(tokens)

    # -- outputs ------------------------------------------------------------------------------------

    def dispatched(self, step: InFlight, now: float) -> None:
        emits = []
        for row, index in zip(step.rows, step.indices, strict=True):
            stream = row.stream
            stream.written += row.span
            stream.last_step_at = now
            if not row.decode:
                stream.prefilled += row.span
                stream.phase = Phase.PREFILL
            emits.append(row.decode or stream.prefilled == len(stream.request.prompt))
            if emits[-1]:
                stream.tokens_in_flight += 1
                stream.feed = (step.serial, index)
                stream.phase = Phase.DECODE
            if stream.tokens_scheduled >= stream.request.max_new_tokens:
                stream.phase = Phase.FLUSH  # its last token is coming: no step needs it as input
        step.emits = tuple(emits)

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        for row, index, emits in zip(step.rows, step.indices, step.emits, strict=True):
            stream = row.stream
            if stream.phase.finished or not emits:
                continue
            if stream.feed == (step.serial, index):
                stream.feed = None
            stream.tokens_in_flight -= 1
            stream.faults = 0
            token, at = int(outputs[index]), stream.generated
            stream.generated += 1
            if at < len(stream.tokens):  # replayed after a fault: the client has it already
                if stream.tokens[at] != token:
                    ops.fail(stream, ReplayMismatchError(
                        f"request {stream.request_id!r}: replaying after a fault generated token {token} "
                        f"at {at}, where it had generated {stream.tokens[at]}"
                    ))  # fmt: skip
                continue
            stream.tokens.append(token)
            if stream.first_token_at is None:
                stream.first_token_at = now
            if stream.on_token is not None:
                try:
                    stream.on_token(token)
                except Exception as err:  # a client's callback must not stop the other streams
                    ops.fail(stream, RequestError(f"request {stream.request_id!r}: on_token raised {err!r}"))
                    continue
                if stream.phase.finished:  # the callback cancelled its own stream
                    continue
            if stream.generated == stream.request.max_new_tokens or token in stream.request.stop_tokens:
                ops.done(stream)

    # -- recovery -----------------------------------------------------------------------------------

    def mark(self, stream: TextStream) -> tuple:
        return (stream.phase, stream.prefilled, stream.written, stream.generated)

    def rewind(self, stream: TextStream, node: Node, mark: tuple | None) -> None:
        phase, prefilled, written, generated = mark or (Phase.WAITING, 0, 0, 0)
        stream.tokens_in_flight, stream.feed = 0, None  # an engine rewinds only with nothing in flight
        stream.phase, stream.prefilled = phase, prefilled
        stream.written, stream.generated = written, generated
