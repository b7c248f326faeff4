"""The engine loop, for any served model: requests in, batches per graph node through the resources and
the captured programs, outputs out per request.

Each `step()` is one round over the model's nodes, in order (`ServedModel.nodes`): the model says which
rows each node runs next (`rows`), and each program of them goes: pick the tightest captured bucket,
declare the rows' step on the node's bounded caches padded to it, admit it through the node's
`ResourceRunner`, plan, replay the bucket's compiled program on the donated caches, commit
(`mstar_jax.serving.transaction`), and hand each request its outputs (`ServedModel.read`).

A pipelined engine (`EngineSettings(pipelined=True)`: one device, a mesh, or one across processes, whose
processes still agree on every program's bucket before they enter it) does not wait for a step's outputs
before it forms, admits, plans and dispatches the next: what a step does to its streams' positions is
known from its rows (`ServedModel.dispatched`), a feeding node's sampled tokens feed its next step on the
device, and they come back to the host a step later; other nodes' outputs come back with an asynchronous
copy, delivered when they are there. It gives every request the same outputs as the synchronous engine.
Whatever needs the streams as they are (a snapshot, a fault, an offload, nothing left to dispatch) first
reads everything in flight (`drain`).

The engine is made of parts, each given the state it needs: `Admission` (how a refused admission is
answered, docs/design.md §4), `Dispatch` (one step dispatched and read back), `Recovery` (how it
survives a fault), `Lockstep` (many processes in step) and `warm_up`.

Cancelling or finishing a request returns its slots at once. Nothing compiles after `warm_up()`: every
step replays a program captured at load time, and a step that compiles anyway warns
(`RecompileWarning`) and is counted in `compilations`.

A step that raises does not stop the engine (`recovery`, docs/design.md §11): if its node's caches
survived, its rows retry (each failing alone after `MAX_STEP_FAULTS`); if the failed step consumed them,
only the requests that held a slot there are affected, restored from the last snapshot when
`snapshot_every` is set and failed with the retryable `StateLostError` otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mstar_jax.checks import check_int
from mstar_jax.compile import count_compilations
from mstar_jax.engine import batch, recovery
from mstar_jax.engine.admission import Admission
from mstar_jax.engine.dispatch import Dispatch
from mstar_jax.engine.lockstep import Lockstep
from mstar_jax.engine.records import StepRecord
from mstar_jax.engine.recovery import Recovery
from mstar_jax.engine.stats import EngineStats
from mstar_jax.engine.warmup import warm_up
from mstar_jax.resources.step import UnknownRequestError
from mstar_jax.serving.model import ServedModel
from mstar_jax.serving.stream import Phase, RequestCancelledError, RequestError, Stream
from mstar_jax.settings import EngineSettings

__all__ = ["ServingEngine", "StepRecord"]


class ServingEngine:
    """Serves any `ServedModel`: on one host, or in every process of a multi-process mesh (`lockstep`).

    Args:
      served: the model as the engine serves it (its nodes, their caches and captured programs).
      settings: how the loop batches, holds, offloads, snapshots and pipelines (`EngineSettings`,
        validated when it was made); its `max_batch` must fit the largest bucket, and `pipelined` needs
        one device.
      history: finished streams and step records kept for reports, the most recent (None: all; a
        server that runs for days bounds it).
      clock: the time source (`time.perf_counter`).
    """

    def __init__(
        self,
        served: ServedModel,
        *,
        settings: EngineSettings,
        history: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not isinstance(served, ServedModel):
            raise TypeError(f"served={served!r} must be a ServedModel (mstar_jax.serving.ServedModel)")
        if not isinstance(settings, EngineSettings):
            raise TypeError(f"settings={settings!r} must be an EngineSettings (mstar_jax.settings)")
        if not callable(clock):
            raise TypeError(f"clock={clock!r} must be callable, returning seconds")
        check_int("history", history, minimum=1, allow_none=True)
        self.served, self.mesh = served, served.mesh
        buckets = served.programs.buckets
        # On a mesh a bucket's batch size counts one data shard's rows.
        shards = 1 if self.mesh is None else self.mesh.shape["data"]
        largest = shards * min(buckets.max_batch(walk) for walk in buckets.walks)
        if settings.max_batch > largest:
            raise ValueError(
                f"max_batch={settings.max_batch!r} must be an int in [1, {largest}] (the largest bucket)"
            )
        if settings.decode_steps != served.decode_steps:
            raise ValueError(
                f"decode_steps={settings.decode_steps!r} must be {served.decode_steps}, the decode steps a "
                "program runs in the programs given; capture them for the setting (it is part of the "
                "decode walk's bucket)"
            )
        self.settings, self.history, self.clock = settings, history, clock
        # The settings the loop reads on every step, by name.
        self.pipelined, self.max_batch = settings.pipelined, settings.max_batch
        self.hold_backoff_s, self.snapshot_every = settings.hold_backoff_s, settings.snapshot_every
        self.offload_idle_after_s = settings.offload_idle_after_s
        self.nodes = {node.name: node for node in served.nodes}
        self.steps_run = 0
        self.streams: dict[str, Stream] = {}  # live, in arrival order
        self.finished: dict[str, Stream] = {}
        self._ended = 0  # streams ended so far: rows formed before one ends are filtered again
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        # Its own counts (`stats` reads them with its parts'): streams ended per phase, offloads asked
        # for, snapshots taken.
        self._ended_as: collections.Counter[Phase] = collections.Counter()
        self._offloads = self._snapshots = 0
        self.warmup_compilations = 0
        # The thread that alone may drive the engine (an `EngineHost`'s, while it runs); None: any.
        self.driver: int | None = None
        self._lockstep = Lockstep(self.mesh, self.nodes, buckets)
        self._lockstep.check()
        self._admission = Admission(
            served=served, nodes=self.nodes, streams=self.streams, clock=self._now,
            hold_backoff_s=settings.hold_backoff_s, fail=self._fail,
        )  # fmt: skip
        self._recovery = Recovery(
            served=served, streams=self.streams,
            snapshot_every=settings.snapshot_every, fail=self._fail, hold=self._admission.hold,
        )  # fmt: skip
        self._dispatch = Dispatch(
            served=served, clock=self._now, pipelined=settings.pipelined,
            admission=self._admission, recovery=self._recovery, lockstep=self._lockstep,
            records=self.records, ops=_StreamOps(self), fail=self._fail,
        )  # fmt: skip

    def _now(self) -> float:
        """The engine's clock, read at each call, so a caller may replace `clock` (a test's fake one)."""
        return self.clock()

    @property
    def lockstep(self) -> bool:
        """Whether this engine is one of a multi-process deployment's (`Lockstep`)."""
        return self._lockstep.enabled

    @property
    def stats(self) -> EngineStats:
        """What the engine counted so far (a new record each time)."""
        admission, recovery, dispatch, ended = self._admission, self._recovery, self._dispatch, self._ended_as
        return EngineStats(
            done=ended[Phase.DONE], failed=ended[Phase.FAILED], cancelled=ended[Phase.CANCELLED],
            holds=admission.holds, allocation_failed=admission.allocation_failed,
            offloads=admission.offloads + self._offloads, reloads=admission.reloads,
            faults=recovery.faults, requests_lost=recovery.requests_lost,
            requests_restored=recovery.requests_restored, snapshots=self._snapshots,
            lockstep_empty_steps=dispatch.lockstep_empty_steps,
            rows_fed_on_device=dispatch.rows_fed_on_device,
            steps_read_behind=dict(dispatch.steps_read_behind),
        )  # fmt: skip

    @property
    def programs(self) -> Any:
        """The captured programs the engine replays: its model's (`faults.inject_faults` replaces the
        model's with failing ones)."""
        return self.served.programs

    @property
    def compilations(self) -> int:
        """Programs compiled after warm-up (0 unless something went wrong)."""
        return self._dispatch.compilations

    @contextlib.contextmanager
    def counting_compilations(self) -> Iterator[None]:
        """Count in `compilations` what compiles inside, once warmed up: a model's own calls on a serving
        engine (a voice registered at run time) must compile nothing either."""
        with count_compilations() as counter:
            yield
        if self.warmed_up:
            self._dispatch.compilations += counter.count

    @property
    def warmed_up(self) -> bool:
        return self._dispatch.warmed_up

    @property
    def last_snapshot(self) -> recovery.EngineSnapshot | None:
        """The snapshot a fault restores from (None: none taken yet)."""
        return self._recovery.last_snapshot

    def busy_anywhere(self, busy: bool) -> bool:
        """Whether any process has work (`busy` itself in one process): a loop driving the engine ends on
        it, so every process steps as often."""
        return self._lockstep.anywhere(busy)

    def drain(self) -> bool:
        """Read back every step in flight and deliver its outputs (a pipelined engine); True if any was."""
        self._check_driver("drain")
        return self._dispatch.drain()

    def warm_up(self) -> int:
        """Compile what serving calls besides the captured steps (`warmup.warm_up`); from here on
        `compilations` counts any compilation a step causes.

        Runs on an idle engine (it borrows a slot of each cache). Returns the compilations it caused.
        """
        self._check_driver("warm_up")
        if self.streams:
            raise RuntimeError("warm_up() runs on an idle engine; call it before submitting requests")
        snapshot = None if self.snapshot_every is None else self.snapshot
        count = warm_up(served=self.served, nodes=self.nodes, lockstep=self._lockstep, snapshot=snapshot)
        if snapshot is not None:
            self._recovery.last_snapshot, self._snapshots = None, 0
        self._dispatch.warmed_up = True
        self._dispatch.compilations = 0
        self.warmup_compilations = count
        return count

    # -- requests -----------------------------------------------------------------------------------

    def submit(
        self, request: Any, *, on_output: Callable[[Any], None] | None = None, live: bool = False
    ) -> Stream:
        """Queue a request; its stream fills as steps run.

        Args:
          request: the model's request, of the type its `new_stream` takes.
          on_output: called with each output as it is delivered (from the engine's thread).
          live: the stream takes more input after each turn (`append`) and ends only when `close`d or
            cancelled; between turns it is idle (`Phase.IDLE`) in its slots, offloaded like a paused
            stream when they are wanted or it idles past `offload_idle_after_s`.

        Raises:
          TypeError: `on_output` is not callable, `live` not a bool, or the model refuses the request's
            type.
          ValueError: a duplicate or reserved request id, a request the model refuses (its message names
            the field), or `live` for a model that serves no live streams; nothing is queued then.
        """
        self._check_driver("submit")
        if on_output is not None and not callable(on_output):
            raise TypeError(f"on_output={on_output!r} must be callable or None")
        if not isinstance(live, bool):
            raise TypeError(f"live={live!r} must be a bool")
        if live and not self.served.live_streams:
            raise ValueError(f"live=True: {type(self.served).__name__} serves no live streams")
        rid = getattr(request, "request_id", None)
        if isinstance(rid, str) and (rid in self.streams or rid.startswith(batch.PAD)):
            raise ValueError(f"request_id={rid!r} is already live or reserved; use a unique id")
        stream = self.served.new_stream(request, on_output=on_output, now=self.clock())
        stream.last_step_at, stream.live = stream.submitted_at, live
        for node in self.nodes.values():
            node.runner.ingest_request(rid)
        self.streams[rid] = stream
        self.finished.pop(rid, None)
        return stream

    def stream(self, request: Any) -> Iterator[Any]:
        """Submit `request` and yield its outputs as the engine produces them (driving it).

        Raises:
          RequestError: when the request fails or is cancelled, with the reason.
        """
        stream = self.submit(request)
        sent = 0
        try:
            while True:
                outputs = self.served.outputs(stream)
                while sent < len(outputs):
                    yield outputs[sent]
                    sent += 1
                if stream.phase.finished:
                    if stream.failure is not None:
                        raise stream.failure
                    return
                if not self.step():
                    self._sleep_until_runnable()
        finally:  # a client that drops the iterator must not leave the request holding its slots
            if not stream.phase.finished:
                self.cancel(stream.request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a live request and return everything it holds.

        Raises:
          UnknownRequestError: `request_id` is not live: never submitted, or already ended (a stream
            ends once; check `stream.phase.finished` first).
        """
        self._check_driver("cancel")
        stream = self._live(request_id)
        self._finish(
            stream, Phase.CANCELLED, RequestCancelledError(f"request {request_id!r} cancelled by the client")
        )

    def append(self, request_id: str, tokens: Any, *, max_new_tokens: int) -> None:
        """Give a live stream its next turn: `tokens` read in its slots after all it holds (its sinks and
        window carry on), then at most `max_new_tokens` generated. It starts once the current turn ends,
        at once if the stream is idle.

        Raises:
          UnknownRequestError: `request_id` is not live.
          ValueError: the stream is not live (`submit(live=True)`), or `max_new_tokens` is not an int >= 1.
          TypeError: `tokens` is not a non-empty sequence of ints (the model's `check_input`).
        """
        self._check_driver("append")
        stream = self._live(request_id)
        if not stream.live:
            raise ValueError(f"request_id={request_id!r} is not a live stream; submit it with live=True")
        self.served.check_input(stream, tokens, max_new_tokens)
        self.served.append(stream, tokens, max_new_tokens)

    def interrupt(self, request_id: str) -> int:
        """Barge-in: stop a live stream's turn at once, keeping what it read and delivered (the steps in
        flight are read back first) and dropping the input it has not read; it is left idle, ready for
        more. Returns the tokens it holds (input read and outputs delivered).

        Raises:
          UnknownRequestError: `request_id` is not live.
          ValueError: the stream is not live.
        """
        self._check_driver("interrupt")
        stream = self._live(request_id)
        if not stream.live:
            raise ValueError(f"request_id={request_id!r} is not a live stream; cancel it instead")
        self.drain()
        if stream.phase.finished:  # a step read back just now ended it (a failure, or its callback)
            raise UnknownRequestError(f"request_id={request_id!r} ended: {stream.phase.value}")
        return self.served.interrupt(stream)

    def close(self, request_id: str) -> None:
        """A live stream takes no more input: it ends (done) once the turns it was given are read, at
        once if idle.

        Raises:
          UnknownRequestError: `request_id` is not live.
          ValueError: the stream is not live (it ends by itself).
        """
        self._check_driver("close")
        stream = self._live(request_id)
        if not stream.live:
            raise ValueError(f"request_id={request_id!r} is not a live stream; it ends by itself")
        if stream.phase is Phase.IDLE:
            self._finish(stream, Phase.DONE, None)
        else:
            stream.closing = True

    def pause(self, request_id: str) -> None:
        """Stop scheduling a stream (its client is not reading); its slots may be offloaded."""
        self._check_driver("pause")
        self._live(request_id).paused = True

    def resume(self, request_id: str) -> None:
        self._check_driver("resume")
        self._live(request_id).paused = False

    def offload(self, request_id: str) -> int:
        """Move a request's cache state to host memory now; return the device bytes freed.

        Raises:
          UnknownRequestError: `request_id` is not live.
        """
        self._check_driver("offload")
        self._live(request_id)
        freed = sum(node.runner.offload(request_id) for node in self.nodes.values())
        self._offloads += freed > 0
        return freed

    def is_offloaded(self, request_id: str) -> bool:
        return any(node.runner.is_offloaded(request_id) for node in self.nodes.values())

    def _check_driver(self, call: str) -> None:
        # Two threads stepping one engine would each donate buffers the other still holds, and a call
        # that changes streams or caches from another thread races the driver's step: refuse it loudly,
        # before any state changes, instead of losing a request's cache to the race.
        if self.driver is not None and self.driver != threading.get_ident():
            raise RuntimeError(
                f"ServingEngine.{call}() was called from thread {threading.current_thread().name!r} while "
                "an EngineHost drives this engine from its own; submit through the host, or stop it first"
            )

    def _live(self, request_id: str) -> Stream:
        stream = self.streams.get(request_id)
        if stream is None:
            live = sorted(self.streams)
            ended = self.finished.get(request_id)  # the most recent `history` ended streams
            why = "" if ended is None else f" (it ended: {ended.phase.value})"
            raise UnknownRequestError(
                f"request_id={request_id!r} is not a live request{why}; live: {live[:8]}"
                + (f" and {len(live) - 8} more" if len(live) > 8 else "")
            )
        return stream

    @property
    def idle(self) -> bool:
        return not self.streams

    def snapshot(self) -> recovery.EngineSnapshot:
        """Copy every cache and every live stream's progress to host memory (what a fault restores); in a
        multi-process deployment every process calls it at the same step, each copying its own shards."""
        self._check_driver("snapshot")
        self.drain()
        managers = {key: node.runner[key] for node in self.nodes.values() for key in node.keys}
        marks = {s.request_id: (s, self.served.mark(s)) for s in self.streams.values()}
        self._recovery.last_snapshot = recovery.take_snapshot(self.steps_run, managers, marks)
        self._snapshots += 1
        return self.last_snapshot

    # -- the loop -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """One round over the model's nodes, each running the programs it has rows for. True if any ran
        (for a pipelined engine: was dispatched, or came back)."""
        self._check_driver("step")
        now = self.clock()
        if self.offload_idle_after_s is not None:
            self._admission.offload_idle(now, self.offload_idle_after_s)
        ran = False
        for turn, node in enumerate(self.nodes.values()):
            dispatch = self._dispatch
            dispatched, in_flight = dispatch.dispatched, dispatch.in_flight.get(node.name)
            programs = self.served.rows(
                node, list(self.streams.values()), now=now if turn == 0 else self.clock(),
                max_batch=self.max_batch, in_flight=None if in_flight is None else in_flight.serial,
            )  # fmt: skip
            faults, ended = self._recovery.faults, self._ended
            for rows, walk in programs:
                if self._recovery.faults != faults:
                    rows = []  # formed before a fault failed or rewound their streams: stale
                if self._ended != ended:  # a client's callback (an earlier program's outputs) ended some
                    rows = [row for row in rows if not row.stream.phase.finished]
                if rows or self.lockstep:  # in lockstep every process enters every program (lockstep.py)
                    ran |= dispatch.run(node, rows, walk)
            if node.feeds:
                in_flight = dispatch.in_flight.get(node.name)
                if dispatch.dispatched == dispatched and in_flight is not None:
                    ran |= dispatch.read(in_flight)  # nothing behind it: the nodes after wait for its tokens
                ran |= dispatch.deliver_copied(wait=False)
        ran = ran or self.drain()  # nothing could be dispatched: what is in flight comes back now
        if self.snapshot_every is None:
            self.steps_run += ran
            return ran
        ran = self._lockstep.anywhere(ran)  # every process counts the same steps, so snapshots together
        if ran:
            self.steps_run += 1
            if self.steps_run % self.snapshot_every == 0:
                # A cache already lost (a poisoned buffer) keeps the last good snapshot for its recovery.
                lost = any(m.cache_lost() for node in self.nodes.values() for m in node.managers)
                if not self._lockstep.anywhere(lost):
                    self.snapshot()
        return ran

    def run_until_idle(self, *, max_steps: int | None = None) -> int:
        """Step until every stream finished (paused and idle live ones excepted), or `max_steps` steps ran;
        return the steps run. In lockstep every round counts, whether or not this process had rows in it:
        every process turns the loop as often, so all stop after the same round.

        Raises:
          ValueError: for a `max_steps` that is not None or an int >= 0 (before any step).
        """
        check_int("max_steps", max_steps, minimum=0, allow_none=True)
        steps = 0
        while max_steps is None or steps < max_steps:
            if not self.busy_anywhere(any(self._runnable(s) for s in self.streams.values())):
                break
            ran = self.step()
            steps += ran or self.lockstep
            if not ran:
                self._sleep_until_runnable()
        return steps

    @staticmethod
    def _runnable(stream: Stream) -> bool:
        """Whether the stream may have rows: neither paused nor a live stream waiting for input."""
        return not stream.paused and stream.phase is not Phase.IDLE

    def _sleep_until_runnable(self) -> None:
        holds = [s.hold_until for s in self.streams.values() if self._runnable(s)]
        wait = (min(holds) - self.clock()) if holds else 0.0
        time.sleep(min(max(wait, 0.0), self.hold_backoff_s) or 1e-4)

    # -- how streams end ----------------------------------------------------------------------------

    def _fail(self, stream: Stream, failure: RequestError) -> None:
        self._finish(stream, Phase.FAILED, failure)

    def _finish(self, stream: Stream, phase: Phase, failure: RequestError | None) -> None:
        if stream.phase.finished:  # a stream ends once
            return
        rid = stream.request_id
        for node in self.nodes.values():
            node.runner.remove_request(rid)
        stream.phase, stream.failure, stream.finished_at = phase, failure, self.clock()
        stream.error = None if failure is None else str(failure)
        self.streams.pop(rid, None)
        self._ended += 1
        self.finished[rid] = stream
        if self.history is not None and len(self.finished) > self.history:
            del self.finished[next(iter(self.finished))]
        self._ended_as[phase] += 1


class _StreamOps:
    """What a model may do to its streams while the engine reads a step (`StreamOps`)."""

    def __init__(self, engine: ServingEngine):
        self._engine = engine

    def fail(self, stream: Stream, failure: RequestError) -> None:
        self._engine._fail(stream, failure)

    def done(self, stream: Stream) -> None:
        self._engine._finish(stream, Phase.DONE, None)

    def release(self, stream: Stream, node: str) -> None:
        self._engine.nodes[node].runner.remove_request(stream.request_id)
