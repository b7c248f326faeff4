"""The protocol a model implements to be served by the engine (`mstar_jax.engine.ServingEngine`).

A served model is a few graph nodes, each a step function over its own bounded caches, captured ahead of
time per bucket. The engine owns everything that does not depend on the model: the queue, admission and
its refusals, the step transaction, pipelining, fault recovery with snapshots, offload, many processes
in lockstep, records. The model says, per node:

- which rows run next (`rows`: pure policy over its streams' host state) and in which bucket
  (`choose_bucket`), where each row's stream stands in the node's caches (`position`);
- the program's inputs for those rows (`inputs`), after `(params, caches, banks, plans)` and, for a node
  that `feeds`, the outputs of its step still in flight;
- what the step does to its streams once dispatched (`dispatched`: known from the rows alone, so a
  pipelined engine forms the next step before reading this one), and once its outputs are on the host
  (`read`);
- a stream's progress, to snapshot (`mark`) and to rewind to after a fault (`rewind`).

A node that `feeds` (a decoder whose sampled token is the next step's input) keeps its newest step on
the device until the next one is dispatched; its programs take the previous step's outputs first. Any
other node's outputs come back with an asynchronous copy and are read, in order, once they are there.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from mstar_jax.compile import Buckets
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.stream import RequestError, Stream

__all__ = ["InFlight", "Node", "RowWalks", "ServedModel", "StreamOps", "fit_shards", "notify", "rows_bucket"]


class RowWalks(NamedTuple):
    """The walks of a decoder node whose rows say their walk (`row.decode`), for the engine to agree on
    across processes and to fit a mesh's shards: decode rows run `decode`, prefill rows `prefill`, and
    both at once `combined` (None: the node has no combined walk)."""

    decode: str
    prefill: str
    combined: str | None = None


def rows_bucket(
    buckets: Buckets,
    walks: RowWalks,
    rows: Sequence,
    *,
    rows_per_shard: int | None = None,
    prefill_per_shard: int | None = None,
) -> BucketKey:
    """The tightest bucket of decoder rows whose `decode` says their walk (`RowWalks`).

    Decode rows run as decode (a block's K steps, or one), prefill rows as chunks, both at once on the
    combined walk where the node has one. On a mesh, `rows_per_shard` (the most rows any data shard
    gets) sizes the bucket instead of the row count, and `prefill_per_shard` (the most prefill rows any
    gets) the combined bucket's room.
    """
    size = len(rows) if rows_per_shard is None else rows_per_shard
    prefill = [r for r in rows if not r.decode]
    if prefill and len(prefill) < len(rows) and walks.combined is not None:
        tokens = max([len(r.tokens) for r in prefill])  # a prefill row's span: its tokens
        room = len(prefill) if prefill_per_shard is None else prefill_per_shard
        return buckets.bucket_for(walks.combined, size, tokens, prefill_rows=room)
    if not prefill:  # a block's rows take up to its K steps (K = 1: one step): a decode row's span
        return buckets.bucket_for(walks.decode, size, max([r.steps for r in rows]))
    return buckets.bucket_for(walks.prefill, size, max([len(r.tokens) for r in rows]))


def fit_shards(rows: Sequence, placement: dict[str, int], most: int) -> tuple[list, int]:
    """`rows` with at most `most` per data shard (the first ones, in order), and the most any shard
    keeps; rows without a placement (admission would refuse them anyway) are kept and counted apart."""
    kept, per_shard = [], collections.Counter()
    for row in rows:
        shard = placement.get(row.stream.request_id)
        if per_shard[shard] < most:
            per_shard[shard] += 1
            kept.append(row)
    return kept, max((n for shard, n in per_shard.items() if shard is not None), default=1)


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One graph node: its runner, the bounded caches its steps run on, its weights.

    Attributes:
      name: the node's name (a stream's progress is kept per node).
      runner: the node's `ResourceRunner`.
      keys: its caches' resource keys, in the order its programs take them (one cache: the program
        takes it bare; several: a tuple).
      params: the weights its programs take first.
      walks: the graph walks its programs run.
      feeds: each step's outputs feed the next step of this node on the device (module doc).
      no_feed: what a feeding node's program reads as the previous outputs when none are in flight.
      row_walks: where a program's rows say their walk (`ServedModel.rows` answers walk None for them):
        the walks they run.
    """

    name: str
    runner: ResourceRunner
    keys: tuple[str, ...]
    params: Any
    walks: tuple[str, ...]
    feeds: bool = False
    no_feed: Any = None
    row_walks: RowWalks | None = None

    @property
    def key(self) -> str:
        """The node's first cache's key (every cache of a node holds the same requests)."""
        return self.keys[0]

    @property
    def managers(self) -> tuple:
        return tuple(self.runner[key] for key in self.keys)

    @property
    def manager(self):
        """The node's first cache."""
        return self.runner[self.keys[0]]

    def holds(self, request_id: str) -> bool:
        """Whether the request holds a slot in any of the node's caches (on the device, not offloaded)."""
        return any(manager.slot_of(request_id) is not None for manager in self.managers)


@dataclasses.dataclass(eq=False)
class InFlight:
    """A step dispatched to the device whose outputs are not read back yet.

    Attributes:
      node: its graph node.
      serial: the engine's count of dispatched steps when it was dispatched (a stream fed by it names it).
      bucket: the bucket it replayed.
      rows: its real rows, in bucket order.
      indices: each row's place in the per-row outputs.
      outputs: the program's outputs, on the device.
      started: clock time when its rows were formed.
      positions: each real row's stream length (entries written) when the step started.
      compilations: programs compiled during it (0 after warm-up).
      emits: how many tokens each row produces that its stream reads back (set at dispatch, by the
        model): 0, 1, or a decode block's steps.
    """

    node: Node
    serial: int
    bucket: BucketKey
    rows: list
    indices: list[int]
    outputs: Any
    started: float
    positions: tuple[int, ...]
    compilations: int
    emits: tuple[int, ...] = ()


class StreamOps(Protocol):
    """What a model may do to its streams while the engine reads a step (the engine implements it)."""

    def fail(self, stream: Stream, failure: RequestError) -> None:
        """End `stream` with `failure`, giving back everything it holds."""

    def done(self, stream: Stream) -> None:
        """End `stream`: every output is delivered."""

    def release(self, stream: Stream, node: str) -> None:
        """Give back what `stream` holds in `node`'s caches (it has nothing more to do there)."""


def notify(stream: Stream, callback: Any, output: Any, ops: StreamOps, *, name: str) -> bool:
    """Hand a client's `callback` (None: nobody listens) one new output of `stream`; False if the stream
    ended meanwhile: the callback raised (that stream alone fails, the others go on) or cancelled it.

    Args:
      name: the callback's name, for the failure's message (`on_output`).
    """
    if callback is not None:
        try:
            callback(output)
        except Exception as err:  # a client's callback must not stop the other streams
            ops.fail(stream, RequestError(f"request {stream.request_id!r}: {name} raised {err!r}"))
            return False
    return not stream.phase.finished


class ServedModel(abc.ABC):
    """A model as the engine serves it (module doc).

    Attributes:
      nodes: its graph nodes, in the order each engine round runs them.
      programs: the captured programs: `buckets` (`Buckets`) and `steps` (graph walk -> `CapturedStep`).
      mesh: the device mesh its arrays live on (None: one device).
      decode_steps: K, the one-token steps its decode programs run (`block_steps`), as captured.
    """

    nodes: tuple[Node, ...]
    programs: Any
    mesh: Any = None
    decode_steps: int = 1

    @abc.abstractmethod
    def new_stream(self, request: Any, *, on_output: Any, now: float) -> Stream:
        """A new stream of `request`, checked against the model (vocabulary, sources, limits).

        Raises:
          TypeError, ValueError: a request this model cannot serve; nothing is queued then.
        """

    @abc.abstractmethod
    def outputs(self, stream: Stream) -> Sequence:
        """What `stream` has delivered so far, in order (`Engine.stream` yields them)."""

    @abc.abstractmethod
    def rows(
        self, node: Node, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        """The node's next programs: each `(rows, walk)` (walk None: the rows alone say it).

        Args:
          node: the node.
          streams: the live streams, in arrival order.
          now: the engine clock (held and paused streams wait).
          max_batch: most rows in one program.
          in_flight: the serial of the node's step still on the device (a feeding node), or None.
        """

    @abc.abstractmethod
    def choose_bucket(self, node: Node, rows: Sequence, *, rows_per_shard: int | None = None) -> BucketKey:
        """The tightest bucket of `rows` (on a mesh, sized by the most rows any data shard gets)."""

    @abc.abstractmethod
    def position(self, node: Node, stream: Stream) -> StreamPosition:
        """Where `stream` stands in the node's caches before its next step."""

    def positions(self, node: Node, streams: Sequence[Stream]) -> Sequence[StreamPosition]:
        """`position` of each of `streams`, in order (a step's `PositionColumns`); a model may answer
        faster for a batch than stream by stream."""
        return [self.position(node, stream) for stream in streams]

    @abc.abstractmethod
    def inputs(self, node: Node, bucket: BucketKey, rows: Sequence, layout: Any) -> tuple:
        """The program's inputs after `(params, caches, banks, plans)` (and a feeding node's previous
        outputs), padded to `bucket` as host arrays; `layout` places the rows on a mesh (else None)."""

    @abc.abstractmethod
    def dispatched(self, step: InFlight, now: float) -> None:
        """Advance the step's streams by what it will do (entries written, prompt read, tokens coming);
        set `step.emits`."""

    @abc.abstractmethod
    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        """Hand the step's outputs, on the host, to its streams."""

    @abc.abstractmethod
    def mark(self, stream: Stream) -> Any:
        """`stream`'s progress, for a snapshot."""

    @abc.abstractmethod
    def rewind(self, stream: Stream, node: Node, mark: Any | None) -> None:
        """Roll `stream`'s progress on `node` back to `mark` (to its start when None); nothing is in
        flight then."""

    def warming_up(self) -> contextlib.AbstractContextManager:
        """What the engine's warm-up runs inside: the model registers what a warm-up request reads (the
        TTS model a voice, if it has none) and removes it after; the default does nothing."""
        return contextlib.nullcontext()

    def block_steps(self, bucket: BucketKey) -> int:
        """The one-token decode steps a program of `bucket` runs (`serving/steps.py`); the default, 1:
        one step of the bucket's tokens."""
        return 1

    def warm_up_position(self, node: Node) -> StreamPosition:
        """A position a warm-up request may borrow a slot of the node at (default: no source)."""
        return StreamPosition(0, 0)

    live_streams: bool = False
    """Whether its streams may be live (`Stream.live`): it implements `check_input`, `append` and
    `interrupt`."""

    def check_input(self, stream: Stream, tokens: Any, max_new_tokens: Any) -> None:
        """Refuse input a live stream cannot take (`TypeError`, `ValueError` naming the field)."""
        raise NotImplementedError(f"{type(self).__name__} serves no live streams")

    def append(self, stream: Stream, tokens: Sequence[int], max_new_tokens: int) -> None:
        """Queue a turn on a live stream (checked: `check_input`): `tokens` read after all it holds, then
        at most `max_new_tokens` generated; it starts once the stream's current turn ends (at once when
        the stream is idle)."""
        raise NotImplementedError(f"{type(self).__name__} serves no live streams")

    def interrupt(self, stream: Stream) -> int:
        """Barge-in, with nothing in flight: end the live stream's turn at what it delivered and drop the
        input not yet read, leaving it idle; return the tokens it holds (input read and outputs)."""
        raise NotImplementedError(f"{type(self).__name__} serves no live streams")

    def history(self, stream: Stream) -> int:
        """The tokens a live stream holds: input read and outputs delivered (what a continuation need not
        send again)."""
        raise NotImplementedError(f"{type(self).__name__} serves no live streams")
