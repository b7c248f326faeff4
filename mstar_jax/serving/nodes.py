"""A served model made of nodes: each node serves its half of the protocol over its own progress in
every stream, and the model says only how a request becomes a stream and what its client is handed.

`ServedNode` is one graph node as served: which of the streams' rows it runs next and in which bucket,
where each stands in its caches, its program's inputs, what a dispatched step does to its streams, what
its outputs do once read, and how to snapshot and rewind its progress. `NodeGraph` is a `ServedModel` of
such nodes: every per-node call of the engine goes to the node of that name, and a stream's snapshot
holds every node's mark. The library's nodes are the decoder (`serving/decoder.py`: prompt chunks, decode
blocks, feeding on the device, stop tokens) and the chunk node (`serving/chunks.py`: another node's
tokens, a fixed chunk at a time). A stream of several nodes (`NodeStream`) keeps each node's progress
under the node's name.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.compile import Buckets
from mstar_jax.distributed import manager_shards
from mstar_jax.resources.kv.bounded.config import BoundedKVSpec, StreamPosition
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import place_on_mesh
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.stream import Stream

__all__ = ["GraphPrograms", "NodeGraph", "NodeStream", "ServedNode", "node_caches", "on_mesh"]


class ServedNode(abc.ABC):
    """One graph node as served: `ServedModel`'s per-node methods, for this node alone (module doc).

    Attributes:
      node: its `Node` (runner, caches, weights, walks, whether it feeds).
      programs: its captured programs (`buckets`, and walk -> `CapturedStep` as `steps`).
    """

    node: Node
    programs: Any

    @abc.abstractmethod
    def rows(
        self, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        """The node's next programs (`ServedModel.rows`)."""

    @abc.abstractmethod
    def choose_bucket(self, rows: Sequence, *, rows_per_shard: int | None = None) -> BucketKey:
        """The tightest bucket of `rows` (`ServedModel.choose_bucket`)."""

    def block_steps(self, bucket: BucketKey) -> int:
        """The one-token steps a program of `bucket` runs (default 1)."""
        return 1

    @abc.abstractmethod
    def position(self, stream: Stream) -> StreamPosition:
        """Where `stream` stands in the node's caches before its next step."""

    def positions(self, streams: Sequence[Stream]) -> Sequence[StreamPosition]:
        return [self.position(stream) for stream in streams]

    @abc.abstractmethod
    def inputs(self, bucket: BucketKey, rows: Sequence, layout: Any) -> tuple:
        """The program's host inputs (`ServedModel.inputs`)."""

    @abc.abstractmethod
    def dispatched(self, step: InFlight, now: float) -> None:
        """Advance the step's streams by what it will do; set `step.emits`."""

    @abc.abstractmethod
    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        """Hand the step's outputs, on the host, to its streams."""

    @abc.abstractmethod
    def mark(self, stream: Stream) -> Any:
        """`stream`'s progress on this node, for a snapshot."""

    @abc.abstractmethod
    def rewind(self, stream: Stream, mark: Any | None) -> None:
        """Roll `stream`'s progress on this node back to `mark` (its start when None)."""

    def warm_up_position(self) -> StreamPosition:
        """A position a warm-up request may borrow a slot of the node at (default: no source)."""
        return StreamPosition(0, 0)

    def check(self, request: Any) -> None:
        """Refuse a request the node cannot serve (`TypeError`, `ValueError` naming the field); default
        none."""

    def new_progress(self) -> Any:
        """A new stream's progress on the node (`NodeGraph.new_stream` keeps it under the node's name)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its progress on the stream itself")

    live_streams: bool = False
    """Whether a model of this node alone may serve live streams: it implements `check_input`, `append`,
    `interrupt` and `history` as `ServedModel` names them."""


@dataclasses.dataclass(frozen=True, eq=False)
class GraphPrograms:
    """Every node's captured programs as the engine takes them: all buckets, and walk -> `CapturedStep`
    (each walk belongs to one node).

    Attributes:
      buckets: every node's buckets.
      steps: walk -> its `CapturedStep`.
    """

    buckets: Buckets
    steps: dict[str, Any]

    @classmethod
    def of(cls, *programs: Any) -> GraphPrograms:
        """Several nodes' programs (each with `buckets` and `steps`) as one."""
        sets = tuple(s for p in programs for s in p.buckets.sets)
        return cls(Buckets(sets), {walk: step for p in programs for walk, step in p.steps.items()})


class NodeGraph(ServedModel):
    """A `ServedModel` of `ServedNode`s (module doc). By default a request of `request_type` that passes
    `check` becomes a `NodeStream` holding each node's fresh progress, and its client is handed the
    stream's `outputs`; a subclass overrides any of these.

    Args:
      served: its nodes, in the order each engine round runs them.
      programs: every node's programs (default: the nodes' own, `GraphPrograms.of` them).
      mesh: the `(data, model)` mesh its arrays live on (None: one device).
      decode_steps: K, the one-token steps its decode programs run (default: the most any node runs).
    """

    def __init__(
        self, served: Sequence[ServedNode], *, programs: Any = None, mesh: Any = None,
        decode_steps: int | None = None,
    ):  # fmt: skip
        names = [s.node.name for s in served]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes {names} must have distinct names")
        self.served = {s.node.name: s for s in served}
        self.nodes = tuple(s.node for s in served)
        self._by_walk = {walk: s for s in served for walk in s.node.walks}
        if programs is None:
            programs = GraphPrograms.of(*(s.programs for s in served))
        if decode_steps is None:
            decode_steps = max(getattr(s, "decode_steps", 1) for s in served)
        self.programs, self.mesh, self.decode_steps = programs, mesh, decode_steps

    request_type: type = object
    """The requests it serves (others are refused with a `TypeError`)."""

    def check(self, request: Any) -> None:
        """Refuse a request the model cannot serve (`TypeError`, `ValueError` naming the field)."""

    def new_stream(self, request: Any, *, on_output: Any, now: float) -> Stream:
        if not isinstance(request, self.request_type):
            raise TypeError(f"request={request!r} must be a {self.request_type.__name__}")
        for served in self.served.values():
            served.check(request)
        self.check(request)
        progress = {name: served.new_progress() for name, served in self.served.items()}
        return NodeStream(request, on_output=on_output, submitted_at=now, progress=progress)

    def outputs(self, stream: Stream) -> Sequence:
        return stream.outputs

    def rows(
        self, node: Node, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        return self.served[node.name].rows(streams, now=now, max_batch=max_batch, in_flight=in_flight)

    def choose_bucket(self, node: Node, rows: Sequence, *, rows_per_shard: int | None = None) -> BucketKey:
        return self.served[node.name].choose_bucket(rows, rows_per_shard=rows_per_shard)

    def block_steps(self, bucket: BucketKey) -> int:
        return self._by_walk[bucket.graph_walk].block_steps(bucket)

    def position(self, node: Node, stream: Stream) -> StreamPosition:
        return self.served[node.name].position(stream)

    def positions(self, node: Node, streams: Sequence[Stream]) -> Sequence[StreamPosition]:
        return self.served[node.name].positions(streams)

    def inputs(self, node: Node, bucket: BucketKey, rows: Sequence, layout: Any) -> tuple:
        return self.served[node.name].inputs(bucket, rows, layout)

    def dispatched(self, step: InFlight, now: float) -> None:
        self.served[step.node.name].dispatched(step, now)

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        self.served[step.node.name].read(step, outputs, now, ops)

    def mark(self, stream: Stream) -> dict[str, Any]:
        return {name: served.mark(stream) for name, served in self.served.items()}

    def rewind(self, stream: Stream, node: Node, mark: dict[str, Any] | None) -> None:
        self.served[node.name].rewind(stream, None if mark is None else mark[node.name])

    def warm_up_position(self, node: Node) -> StreamPosition:
        return self.served[node.name].warm_up_position()

    @property
    def live_streams(self) -> bool:
        """A graph of one node that serves live streams does (a graph of several: not yet)."""
        return len(self.served) == 1 and self._only.live_streams

    @property
    def _only(self) -> ServedNode:
        return next(iter(self.served.values()))

    def check_input(self, stream: Stream, tokens: Any, max_new_tokens: Any) -> None:
        self._only.check_input(stream, tokens, max_new_tokens)

    def append(self, stream: Stream, tokens: Sequence[int], max_new_tokens: int) -> None:
        self._only.append(stream, tokens, max_new_tokens)

    def interrupt(self, stream: Stream) -> int:
        return self._only.interrupt(stream)

    def history(self, stream: Stream) -> int:
        return self._only.history(stream)


@dataclasses.dataclass(eq=False)
class NodeStream(Stream):
    """A stream of several nodes: each node's progress under its name, and what the client is handed.

    Attributes:
      progress: node name -> that node's progress (`DecoderProgress`, `ChunkProgress`).
      outputs: what the client was handed so far, in order (a fault's replay never takes one back).
      on_output: called with each new output (from the engine's thread); None: nobody listens.
      first_output_at: clock stamp of its first output (None until then).
    """

    progress: dict[str, Any] = dataclasses.field(default_factory=dict)
    outputs: list = dataclasses.field(default_factory=list)
    on_output: Callable[[Any], None] | None = None
    first_output_at: float | None = None

    def written_in(self, node: str) -> int:
        return self.progress[node].written


def node_caches(
    specs: Sequence[BoundedKVSpec], *, mesh: Any = None, num_sources: int = 1
) -> list[BoundedKVManager]:
    """A `BoundedKVManager` per spec, with `num_sources` source-bank entries; on `mesh` where one is given
    (its data and model shards, and this process's own data shards on a mesh of many processes)."""
    shards = {} if mesh is None else manager_shards(mesh)
    managers = [BoundedKVManager(spec, num_sources=num_sources, **shards) for spec in specs]
    for manager in managers if mesh is not None else ():
        place_on_mesh(manager, mesh)
    return managers


def on_mesh(params: Any, mesh: Any) -> Any:
    """`params` replicated over `mesh` (as they are for None: one device)."""
    return params if mesh is None else jax.device_put(params, NamedSharding(mesh, P()))
