"""A decoder node, as the engine serves it: the protocol's bookkeeping, written once.

`DecoderNode` serves a graph node whose step returns one token per row (its greedy choice, or any choice
a replay reproduces) and feeds: a decode row reads its input token from the previous step's outputs on
the device (`serving/feed.py`). Each round runs a decode row of one token (or a block of K) for every
stream generating, then prompt chunks of `chunk` tokens for the others; a prompt's last chunk gives the
stream its first token. After a fault, a rewound stream regenerates its tokens against
`DecoderProgress.tokens` (a `generated` counter), which must come out the same and are not handed on
again.

A model says in small hooks what differs (`DecoderHooks`): `prompt`, `chunk`, the walks (`decode_walk`,
`prefill_walk`, `choose_walk`), `stop_tokens` and `extra_inputs`; its programs come from
`capture_decoder`. `GreedyDecoder` is a whole model of one such node, whose tokens are its outputs; in a
model of several nodes (`serving/nodes.py`) a decoder's tokens may feed a later node instead
(`DecoderNode(final=False)`, read by a `ChunkNode`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import numpy as np

from mstar_jax.checks import brief, check_int, is_int
from mstar_jax.compile import Buckets
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.kv.bounded.sharding import DATA
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.decoder_programs import MAX_STOP_TOKENS, DecoderPrograms, capture_decoder, decoder_node
from mstar_jax.serving.model import InFlight, Node, StreamOps, fit_shards, notify, rows_bucket
from mstar_jax.serving.nodes import NodeGraph, ServedNode
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase, ReplayMismatchError, Stream

__all__ = ["DecodeRow", "DecoderHooks", "DecoderNode", "DecoderProgress", "DecoderStream", "GreedyDecoder"]


@dataclasses.dataclass(eq=False, kw_only=True)
class DecoderProgress:
    """A stream's progress on a decoder node (`DecoderNode`).

    Attributes:
      tokens: the tokens the node generated and handed on (a fault's replay never takes one back).
      generated: tokens the node's steps have generated since its start or its last rewind; behind
        `len(tokens)` while a replay regenerates those, which must come out the same.
      prefilled: prompt tokens read.
      written: entries committed to the node's caches.
      tokens_in_flight: tokens of steps dispatched but not read back yet (a pipelined engine).
      feed: `(step, row)`: where the newest of those tokens sits in that step's device output; None once
        read.
      finished: its last token is read (the request's `max_new_tokens`, or a stop token).
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    generated: int = 0
    prefilled: int = 0
    written: int = 0
    tokens_in_flight: int = 0
    feed: tuple[int, int] | None = None
    finished: bool = False

    @property
    def tokens_scheduled(self) -> int:
        """Tokens generated or being generated."""
        return self.generated + self.tokens_in_flight


@dataclasses.dataclass(eq=False)
class DecoderStream(DecoderProgress, Stream):
    """A stream of a one-node decoder: its own progress on the node (`DecoderProgress`), whose tokens
    are its outputs.

    Attributes:
      on_output: called with each new token (from the engine's thread); None: nobody listens.
      first_token_at: clock stamp of its first token (None until then).
    """

    on_output: Callable[[int], None] | None = None
    first_token_at: float | None = None

    def written_in(self, node: str) -> int:
        return self.written


class DecodeRow(NamedTuple):
    """One stream's part of a step: `tokens` written at its end; `feed` >= 0: the token is the step in
    flight's output there (its index in them, flattened; `tokens` is then a placeholder). A decode row
    of a block (`serving/steps.py`) takes `steps` one-token steps from its one input token.

    A NamedTuple: the engine builds one per stream per step, which a frozen dataclass makes four times
    as costly (its `__init__` sets each field through `object.__setattr__`)."""

    stream: Stream
    tokens: tuple[int, ...]
    decode: bool
    feed: int = -1
    steps: int = 1

    @property
    def span(self) -> int:
        """Entries the row writes: a decode row's steps, a prefill row's tokens."""
        return self.steps if self.decode else len(self.tokens)


class DecoderHooks:
    """What a decoder node asks its model, with the defaults a model overrides (module doc).

    Attributes:
      decode_walk, prefill_walk: the walks of its decode and its prefill rows, which a model sets; the
        same walk: one program runs both (decode rows first).
      chunk: prompt tokens a prefill row reads, at most (an attribute or a property the model sets).
    """

    decode_walk: str
    prefill_walk: str
    chunk: int

    def prompt(self, stream: Stream) -> Sequence[int]:
        """The tokens the stream reads before it generates (default: its request's `prompt`)."""
        return stream.request.prompt

    def limit(self, stream: Stream) -> int:
        """Tokens the stream generates at most (default: its request's `max_new_tokens`)."""
        return stream.request.max_new_tokens

    def input_token(self, token: int) -> int:
        """The input token a decode row writes for its last generated `token` (default: itself; the TTS
        talker's codes follow the text vocabulary). A fed program adds the same on the device."""
        return token

    def stop_tokens(self, stream: Stream) -> Collection[int]:
        """Tokens that end the stream, kept as its last (default: its request's `stop_tokens`, if any)."""
        return getattr(stream.request, "stop_tokens", ())

    def choose_walk(self, rows: Sequence[DecodeRow]) -> str:
        """The walk of a program of `rows` (default: decode rows and rows of one prompt token run the
        decode walk, a block's one-token step or the one step it is)."""
        one = all(row.decode or row.span == 1 for row in rows)
        return self.decode_walk if one else self.prefill_walk

    def extra_inputs(self, rows: Sequence[DecodeRow], places: Sequence[int], size: int, span: int) -> tuple:
        """Host inputs the programs take after `lengths`: `size` rows of `span` tokens, `rows[i]` at row
        `places[i]` (default none)."""
        return ()


class DecoderNode(ServedNode):
    """A decoder node: a prompt read in chunks, then one token a step, or a block of K, fed on the device.

    Each round runs a decode row for every stream generating (its input token fed from the step in
    flight, or its last token from the host), then prompt chunks of `hooks.chunk` tokens for the others;
    a prompt's last chunk gives the stream its first token. A stream ends at its request's
    `max_new_tokens` or a stop token. After a fault a rewound stream regenerates its tokens against
    `DecoderProgress.tokens` (the `generated` counter): they must come out the same, and are not handed
    on again.

    Args:
      node: its `Node` (it feeds).
      hooks: what differs per model (`DecoderHooks`).
      buckets: its programs' buckets.
      decode_steps: K, the one-token steps a decode program runs.
      mesh: the mesh its programs run on (None: one device); there a round is always one decode program
        and one prefill program.
      progress_of: a stream's progress on the node (default: the stream itself, a `DecoderStream`).
      final: its tokens are the client's outputs (`on_output`) and its end is the stream's; False: a later
        node reads them, and once the node is done the stream gives its caches back and goes on
        (`Phase.FLUSH`).
      one_prefill_program: a round runs at most one prefill program, as on a mesh (False: as many as its
        prompts need).

    Where the node's rows say their walk (`node.row_walks`) and its buckets hold the combined walk, a
    round is one program: its decode rows and as many prompt chunks as the combined bucket has room for
    (all prompt chunks, up to `max_batch`, when no stream decodes).
    """

    def __init__(
        self, node: Node, hooks: DecoderHooks, *, buckets: Buckets, decode_steps: int = 1, mesh: Any = None,
        progress_of: Callable[[Stream], DecoderProgress] | None = None, final: bool = True,
        one_prefill_program: bool = False,
    ):  # fmt: skip
        self.node, self.hooks, self.buckets, self.decode_steps = node, hooks, buckets, decode_steps
        self.mesh, self.final, self.programs = mesh, final, None
        self.progress_of = progress_of or (lambda stream: stream)
        self._own = progress_of is None  # the stream is its progress: read it directly in the hot loops
        self._fixed = mesh is not None or one_prefill_program
        walks = node.row_walks
        combined = walks is not None and walks.combined is not None and walks.combined in buckets
        self._combined_room = buckets[walks.combined].prefill_rows[-1] if combined else 0

    @classmethod
    def capture(
        cls, hooks: DecoderHooks, name: str, step: Callable, manager: Any, params: Any, buckets: Buckets, *,
        mesh: Any = None, decode_walk: str | None = None, progress_of: Any = None, final: bool = True,
        **options: Any,
    ) -> DecoderNode:  # fmt: skip
        """The decoder node of `step` over one cache (`manager`, on `mesh` already: `node_caches`), its
        programs captured for `buckets` (`capture_decoder`; `options`: its keywords, `static_kwargs`
        defaulting to the cache's `config` and the `mesh`, as `layer_attention` takes them) and its
        weights `params` (placed: `on_mesh`)."""
        options.setdefault("static_kwargs", {"config": manager.config, "mesh": mesh})
        cache, bank = manager.cache, manager.bank
        options.update(name=name, mesh=mesh, decode_walk=decode_walk)
        steps = capture_decoder(step, buckets, params, cache, bank, **options)
        shards = 1 if mesh is None else mesh.shape[DATA]
        programs = DecoderPrograms(buckets, steps, shards, decode_walk=decode_walk)
        runner, keys = ResourceRunner({manager.spec.resource_key: manager}), (manager.spec.resource_key,)
        options = {"mesh": mesh, "progress_of": progress_of, "final": final}
        return cls.of(hooks, name, runner, keys, params, programs, **options)

    @classmethod
    def of(
        cls, hooks: DecoderHooks, name: str, runner: ResourceRunner, keys: tuple[str, ...], params: Any,
        programs: Any, *, mesh: Any = None, **options: Any,
    ) -> DecoderNode:  # fmt: skip
        """The decoder node of `programs` (`DecoderPrograms`), its `Node` made from the rest (`decoder_node`);
        `options`: `progress_of`, `final`."""
        node = decoder_node(name, runner, keys, params, programs, mesh=mesh)
        steps = getattr(programs, "decode_steps", 1)
        served = cls(node, hooks, buckets=programs.buckets, decode_steps=steps, mesh=mesh, **options)
        served.programs = programs
        return served

    def new_progress(self) -> DecoderProgress:
        return DecoderProgress()

    def check(self, request: Any) -> None:
        """Refuse a request without an int `max_new_tokens` >= 1, or with stop tokens not ints."""
        rid = getattr(request, "request_id", None)
        check_int(f"request {rid!r}: max_new_tokens", getattr(request, "max_new_tokens", None), minimum=1)
        stops = getattr(request, "stop_tokens", ())
        if not isinstance(stops, tuple | list) or not all(is_int(t) for t in stops):
            raise TypeError(f"request {rid!r}: stop_tokens={brief(stops)} must be a tuple of ints")

    # -- scheduling ---------------------------------------------------------------------------------

    def rows(
        self, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        """A decode row for each stream generating, a prompt chunk for each other, in programs of at most
        `max_batch` rows. Every decode row is in the round's first program: a later one's previous
        outputs are the first's, not the step's that was in flight. On a mesh a round is always one
        decode program and one prefill program (either may have no rows), so every process of a
        multi-process mesh enters the same programs in the same order (`engine/lockstep.py`)."""
        hooks, own, progress_of, limit = self.hooks, self._own, self.progress_of, self.hooks.limit
        placeholder = (hooks.input_token(0),)  # a fed row's host token, which its program replaces
        decode, prefill = [], []
        for s in streams:
            if s.phase.finished or s.phase is FLUSH or s.paused or s.hold_until > now:
                continue
            p = s if own else progress_of(s)
            if s.phase is not DECODE:
                chunk = hooks.prompt(s)[p.prefilled : p.prefilled + hooks.chunk]
                prefill.append(DecodeRow(s, tuple(chunk), decode=False))
                continue
            steps = min(self.decode_steps, limit(s) - p.tokens_scheduled)
            if p.feed is not None and p.feed[0] == in_flight:
                decode.append(DecodeRow(s, placeholder, decode=True, feed=p.feed[1], steps=steps))
            else:
                token = hooks.input_token(p.tokens[p.generated - 1])
                decode.append(DecodeRow(s, (token,), decode=True, steps=steps))
        decode = decode[:max_batch]  # the rest wait for the next round
        if self._combined_room:  # one program; its rows say their walk
            room = min(max_batch - len(decode), self._combined_room) if decode else max_batch
            return [(decode + prefill[:room], None)]
        fixed = self._fixed
        if hooks.decode_walk == hooks.prefill_walk:
            rows, walk = decode + prefill, hooks.decode_walk
            if fixed:
                return [(rows[:max_batch], walk)]
            return [(rows[i : i + max_batch], walk) for i in range(0, len(rows), max_batch)]
        if fixed:
            return [(decode, hooks.decode_walk), (prefill[:max_batch], hooks.prefill_walk)]
        chunks = [(prefill[i : i + max_batch], hooks.prefill_walk) for i in range(0, len(prefill), max_batch)]
        return [(decode, hooks.decode_walk), *chunks]

    def choose_bucket(self, rows: Sequence, *, rows_per_shard: int | None = None) -> BucketKey:
        walks = self.node.row_walks
        if walks is None:
            span = max(row.span for row in rows)
            return self.buckets.bucket_for(self.hooks.choose_walk(rows), rows_per_shard or len(rows), span)
        room = None  # on a mesh, the most prefill rows any data shard gets: a combined bucket's room
        if rows_per_shard is not None:
            prefill = [r for r in rows if not r.decode]
            placed = self.node.manager.placement([r.stream.request_id for r in prefill])
            room = fit_shards(prefill, placed, len(prefill))[1] if prefill else 0
        return rows_bucket(self.buckets, walks, rows, rows_per_shard=rows_per_shard, prefill_per_shard=room)

    def block_steps(self, bucket: BucketKey) -> int:
        block = self.decode_steps > 1 and bucket.graph_walk == self.hooks.decode_walk
        return bucket.num_tokens if block else 1

    def position(self, stream: Stream) -> StreamPosition:
        return StreamPosition(0, self.progress_of(stream).written)

    def inputs(self, bucket: BucketKey, rows: Sequence[DecodeRow], layout: Any) -> tuple:
        """`feed i32[B]`, `tokens i32[B, T]`, `lengths i32[B]`, then `extra_inputs` (and a decode block's
        `stop_tokens i32[B, MAX_STOP_TOKENS]`, -1 where none; its T is 1, one input token a row); with a
        `layout` (a mesh), `B` is its row count and each request's row is where it says."""
        block = self.block_steps(bucket) > 1
        size, span = (bucket.bs if layout is None else layout[0]), (1 if block else bucket.num_tokens)
        places = range(len(rows)) if layout is None else [layout[1][row.stream.request_id] for row in rows]
        feed, lengths = np.full(size, -1, np.int32), np.zeros(size, np.int32)
        tokens = np.zeros((size, span), np.int32)
        for i, row in zip(places, rows, strict=True):
            feed[i], lengths[i], tokens[i, : len(row.tokens)] = row.feed, len(row.tokens), row.tokens
        extras = self.hooks.extra_inputs(rows, places, size, span)
        if not block:
            return feed, tokens, lengths, *extras
        stops = np.full((size, MAX_STOP_TOKENS), -1, np.int32)
        for i, row in zip(places, rows, strict=True):
            ids = tuple(self.hooks.stop_tokens(row.stream))[:MAX_STOP_TOKENS]  # the rest are checked at read
            stops[i, : len(ids)] = ids
        return feed, tokens, lengths, *extras, stops

    # -- outputs ------------------------------------------------------------------------------------

    def dispatched(self, step: InFlight, now: float) -> None:
        emits, steps, own, progress_of = [], self.decode_steps, self._own, self.progress_of
        limit, prompt = self.hooks.limit, self.hooks.prompt
        for row, index in zip(step.rows, step.indices, strict=True):
            stream = row.stream
            p = stream if own else progress_of(stream)
            p.written += row.span
            stream.last_step_at = now
            if not row.decode:
                p.prefilled += row.span
                stream.phase = PREFILL
            # A decode row's block gives a token per step; a prompt's last chunk gives the first token.
            emits.append(row.steps if row.decode else int(p.prefilled == len(prompt(stream))))
            if emits[-1]:
                p.tokens_in_flight += emits[-1]
                p.feed = (step.serial, index * steps + emits[-1] - 1)  # its newest token, flattened
                stream.phase = DECODE
            if p.tokens_scheduled >= limit(stream):
                stream.phase = FLUSH  # its last token is coming: no step needs it as input
        step.emits = tuple(emits)

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        own, progress_of, indices = self._own, self.progress_of, step.indices
        n = len(indices)  # every row's tokens as ints, in one conversion (rows 0 .. n - 1: a slice)
        blocks = (outputs[:n] if indices == list(range(n)) else outputs[indices]).tolist()
        for row, index, emits, block in zip(step.rows, indices, step.emits, blocks, strict=True):
            stream = row.stream
            if stream.phase.finished or not emits:
                continue
            p = stream if own else progress_of(stream)
            if p.finished:  # a stop token ended it in an earlier step; this one ran on behind it
                continue
            if p.feed == (step.serial, index * self.decode_steps + emits - 1):
                p.feed = None
            p.tokens_in_flight -= emits
            for token in block[:emits]:  # in order; a block's row may end at any of them
                if not self._deliver(stream, p, token, now, ops):
                    break

    def _deliver(self, stream: Stream, p: DecoderProgress, token: int, now: float, ops: StreamOps) -> bool:
        """Hand `stream` its next generated token; False once the node is done with it (the stream ended:
        done, failed or cancelled; or, not `final`, its last token), so the tokens after it are dropped."""
        at = p.generated
        p.generated += 1
        if at < len(p.tokens):  # replayed after a fault: handed on already
            if p.tokens[at] != token:
                ops.fail(stream, ReplayMismatchError(
                    f"request {stream.request_id!r}: replaying after a fault generated token {token} "
                    f"at {at}, where it had generated {p.tokens[at]}"
                ))  # fmt: skip
                return False
            if self.final:  # a final node's last token ended the stream: it is never replayed
                return True
        else:
            p.tokens.append(token)
            if self.final:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                if not notify(stream, stream.on_output, token, ops, name="on_output"):
                    return False  # the callback raised, or cancelled its own stream
        if p.generated == self.hooks.limit(stream) or token in self.hooks.stop_tokens(stream):
            p.finished = True
            if self.final:
                ops.done(stream)
            else:  # a later node reads its tokens: its caches are free, the stream goes on
                stream.phase = FLUSH
                ops.release(stream, self.node.name)
            return False
        return True

    # -- recovery -----------------------------------------------------------------------------------

    def mark(self, stream: Stream) -> tuple:
        p = self.progress_of(stream)
        return (stream.phase, p.prefilled, p.written, p.generated, p.finished)

    def rewind(self, stream: Stream, mark: tuple | None) -> None:
        phase, prefilled, written, generated, finished = mark or (Phase.WAITING, 0, 0, 0, False)
        p = self.progress_of(stream)
        p.tokens_in_flight, p.feed = 0, None  # an engine rewinds only with nothing in flight
        stream.phase, p.prefilled = phase, prefilled
        p.written, p.generated, p.finished = written, generated, finished


class GreedyDecoder(NodeGraph, DecoderHooks):
    """A `ServedModel` of one feeding decoder node (`DecoderNode`, module doc), whose tokens are its
    streams' outputs.

    Args:
      name: the node's name.
      runner: its `ResourceRunner`.
      keys: its caches' keys, in the order its programs take them.
      params: its weights.
      programs: its programs (`DecoderPrograms`, or any with `buckets`, `steps` and `width`).
      mesh: the `(data, model)` mesh its arrays live on, as its programs were captured for (None: one
        device).

    Attributes:
      request_type: the requests it serves, which a subclass sets besides the hooks (`DecoderHooks`);
        others are refused with a `TypeError`, and `check` refuses more.
      stream_type: its streams (a `DecoderStream`).
    """

    stream_type: type[DecoderStream] = DecoderStream

    def __init__(
        self, name: str, runner: ResourceRunner, keys: tuple[str, ...], params: Any, programs: Any,
        mesh: Any = None,
    ):  # fmt: skip
        served = DecoderNode.of(self, name, runner, keys, params, programs, mesh=mesh)
        decode_steps = served.decode_steps
        if decode_steps > 1 and self.decode_walk == self.prefill_walk:
            raise ValueError(
                f"programs run decode blocks of {decode_steps} steps on {self.decode_walk!r}, the walk "
                "prefill rows run too; a decode block needs a walk of its own"
            )
        super().__init__((served,), programs=programs, mesh=mesh, decode_steps=decode_steps)

    def new_stream(self, request: Any, *, on_output: Any, now: float) -> DecoderStream:
        if not isinstance(request, self.request_type):
            raise TypeError(f"request={request!r} must be a {self.request_type.__name__}")
        self.check(request)
        return self.stream_type(request, on_output=on_output, submitted_at=now)

    def outputs(self, stream: DecoderStream) -> list[int]:
        return stream.tokens  # the stream is its node's progress: its tokens are its outputs
