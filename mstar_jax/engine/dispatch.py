"""One step of the engine loop, dispatched and read back.

`_run` admits a node's rows, plans them, replays the bucket's program on the donated caches, commits
(`mstar_jax.serving.transaction`), and advances the streams by what the step will do (the model's
`dispatched`). Its outputs are read back at once by a synchronous engine, and by a pipelined one once
the node's next step is dispatched (a node that feeds) or once its copy is on the host (any other):
`_read` hands them to the model's `read` and records the step; where they cannot be read, the step's
state is treated as lost (docs/design.md §11)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax

from mstar_jax.compile import warn_on_compilations
from mstar_jax.compile.frozen import freeze
from mstar_jax.distributed import host_local
from mstar_jax.engine import batch
from mstar_jax.engine.admission import Admission
from mstar_jax.engine.lockstep import Lockstep
from mstar_jax.engine.records import StepRecord
from mstar_jax.engine.recovery import Recovery
from mstar_jax.resources.kv.bounded.config import PositionColumns
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.stream import RequestError, StateLostError, Stream
from mstar_jax.serving.transaction import Resources, run_admitted

__all__ = ["Dispatch"]


class Dispatch:
    """Runs one step and reads steps back (module doc).

    Args:
      served: the model (its captured programs, its inputs, and what a step does at dispatch and read).
      clock: the engine's time source.
      pipelined: read a step back only once the next is dispatched.
      admission: admits the rows (`Admission`).
      recovery: serves on after a step raised (`Recovery`).
      lockstep: keeps the processes in step (`Lockstep`).
      records: the engine's step records.
      ops: what the model may do to its streams while a step is read (`StreamOps`).
      fail: ends a stream with a failure (the engine's).

    Attributes:
      in_flight: each feeding node's newest step not read back yet.
      copying: the other nodes' steps whose outputs are on their way to the host, in dispatch order.
      dispatched: steps dispatched so far.
      compilations: programs compiled by steps once `warmed_up`.
      lockstep_empty_steps, rows_fed_on_device, steps_read_behind: what it counted (`EngineStats`).
    """

    def __init__(
        self,
        *,
        served: ServedModel,
        clock: Callable[[], float],
        pipelined: bool,
        admission: Admission,
        recovery: Recovery,
        lockstep: Lockstep,
        records: collections.deque,
        ops: StreamOps,
        fail: Callable[[Stream, RequestError], None],
    ):
        self._served, self._clock, self._pipelined = served, clock, pipelined
        self._admission, self._recovery, self._lockstep = admission, recovery, lockstep
        self._records = records
        self.lockstep_empty_steps = self.rows_fed_on_device = 0
        self.steps_read_behind: collections.Counter[str] = collections.Counter()
        self._ops, self._fail = ops, fail
        self.in_flight: dict[str, InFlight | None] = dict.fromkeys(n.name for n in served.nodes if n.feeds)
        # Each node's weights flattened once, for programs that take them frozen (capture's
        # frozen_argnums): an nnx.State flattens in Python, hundreds of µs a step.
        self._weights = {n.name: freeze(n.params) for n in served.nodes}
        self.copying: collections.deque[InFlight] = collections.deque()
        self.dispatched = 0
        self.compilations = 0
        self.warmed_up = False

    def run(self, node: Node, rows: list, walk: str | None = None) -> bool:
        """Dispatch one program on `rows` (of `walk`, where the rows alone do not say it); True if it
        ran. A synchronous engine reads its outputs at once, a pipelined one when the next has gone."""
        started = self._clock()
        lockstep = self._lockstep.enabled
        agreed = self._lockstep.agreed_bucket(node, rows, walk) if lockstep else None
        if lockstep and agreed is None:
            return False
        admitted = self._admission.admit(node, rows, agreed)
        if admitted is None:
            if agreed is None:
                return False
            admitted = self._admission.declare(node, [], agreed)  # the others run it: enter it with no rows
        declared, rows = admitted
        bucket, node_step = declared.bucket, declared.sub.steps[node.key]
        declared_positions = node_step.positions  # what each row declared it had written, in row order
        if type(declared_positions) is PositionColumns and declared_positions.request_ids == tuple(
            [r.stream.request_id for r in rows]
        ):
            positions = tuple(declared_positions.written.tolist())
        else:
            positions = tuple(r.stream.written_in(node.name) for r in rows)
        layout = None  # a mesh's placement of the rows, made once the step is planned

        def replay(resources: Resources):
            nonlocal layout
            if self._served.mesh is not None:
                layout = node.manager.plan_rows(node_step, declared.sub.ctx)
            inputs = self._served.inputs(node, bucket, rows, layout)
            if node.feeds:
                step = self.in_flight.get(node.name)
                inputs = (node.no_feed if step is None else step.outputs, *inputs)
            # A node of one cache takes it bare, a node of several takes them as a tuple.
            caches, banks, plans = (
                (x[0] if len(node.keys) == 1 else x)
                for x in (resources.caches, resources.banks, resources.plans)
            )
            step = self._served.programs.steps[bucket.graph_walk]
            params = self._weights[node.name] if 0 in getattr(step, "frozen_argnums", ()) else node.params
            with warn_on_compilations(f"engine step {bucket}") as counter:
                caches, outputs = step.replay(bucket, params, caches, banks, plans, *inputs)
                if not self._pipelined:  # read inside the transaction: a failed read fails the step
                    outputs = host_local(outputs)  # this process's rows (every row, in one process)
            return ((caches,) if len(node.keys) == 1 else tuple(caches)), (outputs, counter)

        try:  # an error aborts what admit claimed (run_admitted), then the node recovers
            outputs, counter = run_admitted(node.runner, declared, replay)
        except Exception as err:
            self.drain()  # the streams as every earlier step left them, for the recovery
            self._recovery.recover(node, rows, err)
            return True
        if self.warmed_up:
            self.compilations += counter.count
        if not rows:
            self.lockstep_empty_steps += 1
            return True
        self.dispatched += 1
        step = InFlight(
            node, self.dispatched, bucket, rows, batch.row_indices(bucket, rows, layout), outputs, started,
            positions, counter.count,
        )  # fmt: skip
        self._served.dispatched(step, self._clock())
        if node.feeds:
            self.rows_fed_on_device += sum(getattr(row, "feed", -1) >= 0 for row in rows)
            earlier, self.in_flight[node.name] = self.in_flight.get(node.name), step
            if earlier is not None:
                self.steps_read_behind[node.name] += 1
                self.read(earlier)
        else:
            self.copying.append(step)
            for array in jax.tree.leaves(outputs):
                if isinstance(array, jax.Array) and not array.is_deleted():  # a lost one fails when read
                    array.copy_to_host_async()  # the outputs come back while the device goes on
        if not self._pipelined:
            self.drain()
        return True

    def drain(self) -> bool:
        """Read back every step in flight and deliver its outputs (a pipelined engine); True if any was."""
        drained = False
        for step in list(self.in_flight.values()):
            drained |= step is not None and self.read(step)
        return self.deliver_copied(wait=True) or drained

    def deliver_copied(self, *, wait: bool) -> bool:
        """Deliver the non-feeding steps in flight whose outputs are on the host, in order (all, if
        `wait`)."""
        delivered = False
        while self.copying and (
            wait or all(x.is_deleted() or x.is_ready() for x in jax.tree.leaves(self.copying[0].outputs))
        ):
            self.steps_read_behind[self.copying[0].node.name] += self._pipelined and not wait
            delivered |= self.read(self.copying[0])
        return delivered

    def read(self, step: InFlight) -> bool:
        """Bring `step`'s outputs to the host and hand them to its streams; True (it came back)."""
        if step.node.feeds:
            if self.in_flight.get(step.node.name) is step:
                self.in_flight[step.node.name] = None
        else:
            self.copying.remove(step)
        try:
            outputs = host_local(step.outputs)
        except Exception as err:  # the step failed on the device after it was dispatched
            self._lost_in_flight(step, err)
            return True
        for row in step.rows:  # it came back: the failed steps its rows rode out were not in a row
            row.stream.faults = 0
        now = self._clock()
        rids = tuple([r.stream.request_id for r in step.rows])
        self._records.append(StepRecord(
            step.bucket.graph_walk, step.bucket, len(step.rows), step.started, now - step.started,
            step.positions, step.compilations, rids,
        ))  # fmt: skip
        self._served.read(step, outputs, now, self._ops)
        return True

    def _lost_in_flight(self, step: InFlight, err: Exception) -> None:
        """A dispatched step whose outputs cannot be read: its node's cache state, and every later step
        of that node (built on it), are lost. Its requests still hold their slots (a model gives a
        feeding node's slot back only once the stream's last token is read), so the node recovers as
        from a lost cache: restored from the last snapshot and replayed, or failed with the retryable
        `StateLostError`. A request of those steps moved to host memory since (offloaded: its copy was
        read from the lost state) holds no slot for the recovery to rewind; it fails the same way."""
        node = step.node
        if node.feeds:
            dropped = [s for s in (step, self.in_flight.get(node.name)) if s is not None]
            self.in_flight[node.name] = None
        else:  # every later step of the node in flight came after it
            dropped = [step, *(s for s in self.copying if s.node is node)]
            self.copying = collections.deque(s for s in self.copying if s.node is not node)
        offloaded = {
            row.stream.request_id: row.stream for s in dropped for row in s.rows
            if not row.stream.phase.finished and not node.holds(row.stream.request_id)
        }  # fmt: skip
        self._recovery.recover(step.node, [], err, lost=True)
        for stream in offloaded.values():
            self._fail(stream, StateLostError(
                f"a {step.node.name} step with request {stream.request_id!r} failed on the device after it "
                f"was dispatched ({err!r}); its offloaded copy came from what it left: submit it again"
            ))  # fmt: skip
