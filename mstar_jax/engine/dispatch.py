"""One step of the engine loop, dispatched and read back.

`_run` admits a node's rows, plans them, replays the bucket's program on the donated cache, commits,
and advances the streams by what the step will do (`outputs`). Its outputs are read back at once by a
synchronous engine, and by a pipelined one once the next step is dispatched (the talker's) or once
its copy is on the host (the flow's audio): `_read` hands them to their streams and records the step;
where they cannot be read, the step's state is treated as lost (docs/design.md §11)."""

from __future__ import annotations

import jax

from mstar_jax.compile import warn_on_compilations
from mstar_jax.distributed import host_local
from mstar_jax.engine import batch
from mstar_jax.engine.records import InFlight, Node, StepRecord
from mstar_jax.engine.request import StateLostError
from mstar_jax.serving.transaction import Resources, run_admitted

__all__ = ["Dispatch"]


class Dispatch:
    """The part of `Engine` that runs one step and reads steps back (module doc)."""

    def _run(self, node: Node, rows: list, walk: str | None = None) -> bool:
        """Dispatch one program on `rows` (of `walk`, where the rows alone do not say it); True if it
        ran. A synchronous engine reads its outputs at once, a pipelined one when the next has gone."""
        started = self.clock()
        agreed = self._agreed_bucket(node, rows, walk) if self.lockstep else None
        if self.lockstep and agreed is None:
            return False
        admitted = self._admit(node, rows, agreed)
        if admitted is None:
            if agreed is None:
                return False
            admitted = self._declare(node, [], agreed)  # the others run it: enter it with no rows
        declared, rows = admitted
        bucket, node_step = declared.bucket, declared.sub.steps[node.key]
        params = self.model.talker_params if node.name == "talker" else self.model.flow_params
        positions = tuple(r.stream.written_in(node.name) for r in rows)
        talker = node.name == "talker"
        layout = None  # a mesh's placement of the rows, made once the step is planned

        def replay(resources: Resources):
            nonlocal layout
            if self.mesh is not None:
                layout = node.manager.plan_rows(node_step, declared.sub.ctx)
            inputs = batch.step_inputs(bucket, rows, layout)
            if talker:
                step = self._talker_in_flight
                inputs = (self._no_codes if step is None else step.outputs, *inputs)
            (cache,), (bank,), (plan,) = resources.caches, resources.banks, resources.plans
            with warn_on_compilations(f"engine step {bucket}") as counter:
                cache, outputs = self.programs.steps[bucket.graph_walk].replay(
                    bucket, params, cache, bank, plan, *inputs
                )
                if not self.pipelined:  # read inside the transaction: a failed read fails the step
                    outputs = host_local(outputs)  # this process's rows (every row, in one process)
            return (cache,), (outputs, counter)

        try:  # an error aborts what admit claimed (run_admitted), then the node recovers
            outputs, counter = run_admitted(node.runner, declared, replay)
        except Exception as err:
            self.drain()  # the streams as every earlier step left them, for the recovery
            self._recover(node, rows, err)
            return True
        if self.warmed_up:
            self.compilations += counter.count
        if not rows:
            self.counters["lockstep_empty_steps"] += 1
            return True
        self._dispatched += 1
        step = InFlight(
            node, self._dispatched, bucket, rows, batch.row_indices(bucket, rows, layout), outputs, started,
            positions, counter.count,
        )  # fmt: skip
        if talker:
            step.coded = self._talker_dispatched(step, self.clock())
            self.overlap["rows_fed_on_device"] += sum(row.feed >= 0 for row in rows)
            earlier, self._talker_in_flight = self._talker_in_flight, step
            if earlier is not None:
                self.overlap["talker_steps_read_behind"] += 1
                self._read(earlier)
        else:
            self._flow_dispatched(rows, self.clock())
            self._audio_in_flight.append(step)
            for array in jax.tree.leaves(outputs):
                if isinstance(array, jax.Array) and not array.is_deleted():  # a lost one fails when read
                    array.copy_to_host_async()  # the audio comes back while the device goes on
        if not self.pipelined:
            self.drain()
        return True

    def drain(self) -> bool:
        """Read back every step in flight and deliver its outputs (a pipelined engine); True if any was."""
        drained = self._talker_in_flight is not None and self._read(self._talker_in_flight)
        return self._deliver_audio(wait=True) or drained

    def _deliver_audio(self, *, wait: bool) -> bool:
        """Deliver the flow steps in flight whose outputs are on the host, in order (all, if `wait`)."""
        delivered = False
        while self._audio_in_flight and (
            wait
            or all(x.is_deleted() or x.is_ready() for x in jax.tree.leaves(self._audio_in_flight[0].outputs))
        ):
            self.overlap["flow_steps_read_behind"] += self.pipelined and not wait
            delivered |= self._read(self._audio_in_flight[0])
        return delivered

    def _read(self, step: InFlight) -> bool:
        """Bring `step`'s outputs to the host and hand them to its streams; True (it came back)."""
        if step is self._talker_in_flight:
            self._talker_in_flight = None
        elif step.node.name == "flow":
            self._audio_in_flight.remove(step)
        try:
            outputs = host_local(step.outputs)
        except Exception as err:  # the step failed on the device after it was dispatched
            self._lost_in_flight(step, err)
            return True
        now = self.clock()
        rids = tuple(r.stream.request_id for r in step.rows)
        self.records.append(StepRecord(
            step.bucket.graph_walk, step.bucket, len(step.rows), step.started, now - step.started,
            step.positions, step.compilations, rids,
        ))  # fmt: skip
        if step.node.name == "talker":
            self._talker_read(step, outputs)
        else:
            self._flow_read(step, outputs, now)
        return True

    def _lost_in_flight(self, step: InFlight, err: Exception) -> None:
        """A dispatched step whose outputs cannot be read: its node's cache state, and every later step
        of that node (built on it), are lost. Its requests still hold their slots (a talker slot is
        freed only when its last code is read), so the node recovers as from a lost cache: restored
        from the last snapshot and replayed, or failed with the retryable `StateLostError`. A request
        of those steps moved to host memory since (offloaded: its copy was read from the lost state)
        holds no slot for the recovery to rewind; it fails the same way."""
        if step.node.name == "talker":
            dropped = [s for s in (step, self._talker_in_flight) if s is not None]
            self._talker_in_flight = None
        else:
            dropped = [step, *self._audio_in_flight]  # every flow step in flight came after it
            self._audio_in_flight.clear()
        manager = step.node.manager
        offloaded = {
            row.stream.request_id: row.stream for s in dropped for row in s.rows
            if not row.stream.phase.finished and manager.slot_of(row.stream.request_id) is None
        }  # fmt: skip
        self._recover(step.node, [], err, lost=True)
        for stream in offloaded.values():
            self._fail(stream, StateLostError(
                f"a {step.node.name} step with request {stream.request_id!r} failed on the device after it "
                f"was dispatched ({err!r}); its offloaded copy came from what it left: submit it again"
            ))  # fmt: skip
