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

from mstar_jax.compile import Buckets
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.stream import Stream

__all__ = ["GraphPrograms", "NodeGraph", "NodeStream", "ServedNode"]


class ServedNode(abc.ABC):
    """One graph node as served: `ServedModel`'s per-node methods, for this node alone (module doc).

    Attributes:
      node: its `Node` (runner, caches, weights, walks, whether it feeds).
    """

    node: Node

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
    """A `ServedModel` of `ServedNode`s (module doc). A subclass says how a request becomes a stream
    (`new_stream`) and what its client is handed (`outputs`).

    Args:
      served: its nodes, in the order each engine round runs them.
      programs: every node's programs (`GraphPrograms`, or one node's own).
      mesh: the `(data, model)` mesh its arrays live on (None: one device).
      decode_steps: K, the one-token steps its decode programs run.
    """

    def __init__(
        self, served: Sequence[ServedNode], *, programs: Any, mesh: Any = None, decode_steps: int = 1
    ):
        names = [s.node.name for s in served]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes {names} must have distinct names")
        self.served = {s.node.name: s for s in served}
        self.nodes = tuple(s.node for s in served)
        self._by_walk = {walk: s for s in served for walk in s.node.walks}
        self.programs, self.mesh, self.decode_steps = programs, mesh, decode_steps

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
