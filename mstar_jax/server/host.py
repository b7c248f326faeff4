"""`EngineHost`: a `ServingEngine` on a thread of its own, and the thread-safe way in and out of it.

The engine is not thread-safe: one thread, the host's, calls it. Everything else crosses through
queues. Clients (coroutines on the server's event loop) post commands (submit, cancel, resume) on a
thread-safe queue; the host thread runs them between engine steps, steps while any stream can run, and
otherwise blocks on the queue (it never spins). Each request's outputs go to its `RequestHandle`, a
small per-request buffer on the event loop (`handle.py`; one `loop.call_soon_threadsafe` per host
loop), so the loop never waits on the device and the engine never waits on a client.

Bounds, so nothing grows with a client's behaviour:

- at most `max_waiting` requests wait: submitted with no step run yet, or paused for a client that
  stopped reading; one more is refused with `OverloadedError` (429 and `Retry-After`) before anything
  is queued, so neither a burst nor a crowd of readers that never read grows memory without bound;
- a stream whose client has not read `stream_buffer` outputs is paused in the engine (it runs no
  step, and after `offload_paused_after_s` its slots move to host memory); it resumes (reloaded by
  the engine's admission) once the client has read half of them;
- a client that goes away cancels its request (`RequestHandle.cancel`): the engine frees its slots at
  its next command drain, before its next step.

Shutdown (`begin_shutdown`, signal-safe: it only sets attributes): new requests are refused with
`ServerShuttingDownError`, streams in flight have `grace_s` to finish, the rest are cancelled, each
handle ending with that typed, retryable error; `close` then joins the thread.

In a multi-process (lockstep) deployment every process runs a host over its own engine and serves its
own clients; the host keeps stepping while `engine.busy_anywhere` says any process has work, so every
process steps as often as the others, and its thread ends only once every process's host is done (each
told to stop, every request answered): a process that left early would leave the others waiting in a
step it never enters.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any

from mstar_jax.checks import check_int, check_number
from mstar_jax.engine.engine import ServingEngine
from mstar_jax.server.errors import (
    BadRequestError,
    HostNotStartedError,
    OverloadedError,
    ServerShuttingDownError,
)
from mstar_jax.server.handle import Cancel, RequestHandle, Resume, Submit, receive_all
from mstar_jax.serving.stream import Phase, RequestError, StepFailedError

__all__ = ["EngineHost", "HostObserver"]

_IDLE_WAIT_S = 0.25  # how long an idle host blocks on its queue before it looks at its deadline again
_LOCKSTEP_WAIT_S = 0.005  # the least an idle lockstep host waits between rounds of collectives


class HostObserver:
    """What the host reports as it runs (the server's metrics); every method is called from the host
    thread, and does nothing here."""

    def first_output(self, seconds: float) -> None:
        """A request's first output came, `seconds` after it was submitted."""

    def ended(self, outcome: str) -> None:
        """A request ended: `done`, `failed`, `cancelled`, `invalid` or `shutdown`."""

    def stepped(self, host: EngineHost, latencies: list[float]) -> None:
        """Once a loop of the host thread: the engine ran steps of these latencies (seconds, none when
        it was idle); `host` may be read for gauges."""


_STOP = object()


class EngineHost:
    """Runs `engine` on a thread of its own (module doc).

    Args:
      engine: a warmed-up `ServingEngine` of any model; from `start()` on only the
        host's thread calls it.
      max_waiting: requests that may wait at once (`ServerSettings.max_waiting`).
      stream_buffer: outputs buffered per stream before it is paused (`ServerSettings.stream_buffer`).
      retry_after_s: the `Retry-After` of an `OverloadedError`.
      offload_paused_after_s: seconds a paused stream keeps its device slots before the host offloads
        it (None: never; never in a multi-process engine).
      history: finished streams and step records the engine keeps, the most recent (a server runs
        for days: an engine built with `history=None` would keep every stream); a finished stream's
        audio is dropped from its record once every chunk was handed to its client.
      observer: told of first outputs, ends and steps (the metrics); default: nobody.
    """

    def __init__(
        self,
        engine: ServingEngine,
        *,
        max_waiting: int = 64,
        stream_buffer: int = 16,
        retry_after_s: int = 1,
        offload_paused_after_s: float | None = None,
        history: int = 64,
        observer: HostObserver | None = None,
    ):
        if not isinstance(engine, ServingEngine):
            raise TypeError(f"engine={engine!r} must be a ServingEngine (mstar_jax.engine)")
        check_int("max_waiting", max_waiting, minimum=1)
        check_int("stream_buffer", stream_buffer, minimum=1)
        check_int("retry_after_s", retry_after_s, minimum=1)
        check_number("offload_paused_after_s", offload_paused_after_s, minimum=0.0, allow_none=True)
        self.history = check_int("history", history, minimum=1)
        if observer is not None and not isinstance(observer, HostObserver):
            raise TypeError(f"observer={observer!r} must be a HostObserver or None")
        self.engine, self.max_waiting, self.stream_buffer = engine, max_waiting, stream_buffer
        self.retry_after_s, self.offload_paused_after_s = retry_after_s, offload_paused_after_s
        self._observer = observer or HostObserver()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards `_waiting` and `accepting` against concurrent submits
        self._waiting = 0
        self.accepting = True
        self._deadline: float | None = None
        self._live: dict[str, RequestHandle] = {}  # host thread only
        self._delivering = 0  # event loop only: `begin_delivery` minus `end_delivery`
        # Outputs and ends not yet handed to their loops: one wake-up of each loop per host loop, not
        # one per output, so the two threads contend for the interpreter less (host thread only).
        self._outbox: list[tuple[RequestHandle, tuple[bool, Any]]] = []
        self._unstarted: set[RequestHandle] = set()  # submitted, no step run yet (host thread only)
        self._thread: threading.Thread | None = None
        self._seen_record: Any = None
        self.failure: BaseException | None = None  # what stopped the thread, if anything did
        self.free_slots = {m.spec.resource_key: m.free_slots for m in self.managers}
        if engine.history is None or engine.history > history:  # the engine trims `finished` to it
            engine.history = history

    @property
    def managers(self) -> list[Any]:
        """Every cache manager of the engine's nodes."""
        return [m for node in self.engine.nodes.values() for m in node.managers]

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> EngineHost:
        """Start the host thread (once)."""
        if self._thread is not None:
            raise RuntimeError("EngineHost.start() was called already")
        self._thread = threading.Thread(target=self._run, name="mstar-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; cancel those still running `grace_s` seconds from now. Safe to call from
        a signal handler (it only sets attributes); a second call keeps the first deadline."""
        self.accepting = False
        if self._deadline is None:
            self._deadline = time.monotonic() + grace_s

    def close(self, grace_s: float = 0.0, *, timeout_s: float = 60.0) -> None:
        """`begin_shutdown(grace_s)`, then wait for the thread to end (every request answered)."""
        self.begin_shutdown(grace_s)
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout_s} s")

    # -- requests (any thread) ----------------------------------------------------------------------

    def submit(self, request: Any, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue `request` for the engine; read its outputs from the handle returned.

        Args:
          request: the model's request (`TTSRequest`, `TextRequest`), already checked by the caller.
          loop: the event loop that reads the handle (default: the running one).

        Raises:
          HostNotStartedError: `start()` was not called yet (not retryable: nothing would serve it).
          ServerShuttingDownError: the host no longer accepts requests, or its thread has stopped.
          OverloadedError: `max_waiting` requests wait already.
        """
        if self._thread is None:
            raise HostNotStartedError(
                "EngineHost.submit() was called before EngineHost.start(): call start() first (an app "
                "from create_app starts its host when it starts up)"
            )
        loop = loop or asyncio.get_running_loop()
        if not self.alive:
            raise ServerShuttingDownError("the engine is not running") from self.failure
        with self._lock:
            if not self.accepting:
                raise ServerShuttingDownError("the server is shutting down; it accepts no new requests")
            if self._waiting >= self.max_waiting:
                raise OverloadedError(
                    f"{self._waiting} requests are waiting for the engine already (max_waiting="
                    f"{self.max_waiting}); retry after {self.retry_after_s} s",
                    retry_after_s=self.retry_after_s,
                )
            self._waiting += 1
        handle = RequestHandle(self, request, loop)
        self._commands.put(Submit(handle))
        return handle

    @property
    def waiting(self) -> int:
        """Requests submitted that have not run a step yet, and streams paused for their readers."""
        return self._waiting

    @property
    def live(self) -> int:
        """Requests the host holds (submitted and not ended): 0 once every client is answered."""
        return len(self._live)

    @property
    def delivering(self) -> int:
        """Deliveries under way that a shutdown waits for, as `live` requests (`begin_delivery`)."""
        return self._delivering

    def begin_delivery(self) -> None:
        """Count one delivery under way until `end_delivery` (event loop only): outputs that may still be
        on their way to a client after the engine has finished their request, such as a WebSocket's
        segment whose audio its slow client has not read yet (an HTTP response, uvicorn waits for)."""
        self._delivering += 1

    def end_delivery(self, count: int = 1) -> None:
        """End `count` deliveries `begin_delivery` counted (event loop only).

        Raises:
          ValueError: `count` is not an int in [0, deliveries under way].
        """
        self._delivering -= check_int("count", count, minimum=0, maximum=self._delivering)

    def _post(self, command: Any) -> None:
        self._commands.put(command)

    # -- the host thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        engine.driver = threading.get_ident()
        try:
            stopping = False
            while True:
                runnable = any(not s.paused for s in engine.streams.values())
                # Idle (nothing, or only streams paused for their readers), block on the queue; in
                # lockstep only briefly: the others wait on our next step.
                idle = max(engine.hold_backoff_s, _LOCKSTEP_WAIT_S) if engine.lockstep else _IDLE_WAIT_S
                wait = 0.0 if runnable else idle
                stopping |= self._drain(wait)
                self._check_deadline()
                done = stopping and not self._live and not self.accepting
                if engine.lockstep:  # a pod stops as one: a process gone would leave the others' steps
                    done = not engine.busy_anywhere(not done)
                if done:
                    return  # (`finally` flushes the last answers)
                busy = any(not s.paused for s in engine.streams.values())
                if engine.lockstep:  # every process steps while any has work (lockstep.py)
                    busy = engine.busy_anywhere(busy)
                latencies: list[float] = []
                # Paused streams too (the engine offloads idle ones), but in lockstep only on the agreed
                # `busy`: a step enters collectives every process must enter alike.
                if busy or (engine.streams and not engine.lockstep):
                    ran = self._step(latencies)
                    self._settle()
                    self._offload_paused()
                    self._flush()
                    if busy and not ran:  # held for room: wait the backoff, on the queue
                        stopping |= self._drain(engine.hold_backoff_s)
                self._flush()
                self._observer.stepped(self, latencies)  # also when idle: gauges follow cancellations
        except BaseException as error:  # the thread must not die silently: every client is told
            self.failure = error
            self.accepting = False
            failure = StepFailedError(f"the engine thread stopped: {error!r}")
            for handle in list(self._live.values()):
                self._finish(handle, failure, "failed")
            while True:  # requests queued before `accepting` fell: nobody would ever answer them
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, Submit):
                    self._unwait()
                    command.handle._end(failure, "failed")
            self._flush()
            raise
        finally:
            self._flush()
            engine.driver = None

    def _flush(self) -> None:
        """Hand the outbox to the event loops: one callback per loop, the items in order."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, item in items:
            by_loop.setdefault(handle._loop, []).append((handle, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read
                loop.call_soon_threadsafe(receive_all, batch)

    def _drain(self, wait: float) -> bool:
        """Run queued commands, waiting up to `wait` seconds for the first; True once `close` asked."""
        stop = False
        try:
            command = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if command is _STOP:
                stop = True
            else:
                self._command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return stop

    def _command(self, command: Any) -> None:
        handle = command.handle
        if isinstance(command, Submit):
            self._submit(handle)
        elif isinstance(command, Cancel):
            if handle.request_id in self._live:
                handle._cancelled_as = command.outcome
                # Only a live stream: the engine refuses to cancel one that ended (`_settle` answers it),
                # and a refusal here would stop the thread every client is served by.
                if handle.request_id in self.engine.streams:
                    self.engine.cancel(handle.request_id)
                self._settle()
        elif isinstance(command, Resume):
            with handle._lock:
                handle.paused = False
            self._park(handle, False)
            if handle.request_id in self.engine.streams:
                self.engine.resume(handle.request_id)

    def _submit(self, handle: RequestHandle) -> None:
        if handle._cancelled:  # its client left before the engine saw it
            self._unwait()
            handle._end(None, "cancelled")
            return
        if not self.accepting and self._deadline is not None and time.monotonic() >= self._deadline:
            self._unwait()
            handle._end(
                ServerShuttingDownError("the server shut down before the request started"), "shutdown"
            )
            return
        try:
            handle.stream = self.engine.submit(handle.request, on_output=handle._deliver)
        except (TypeError, ValueError) as error:  # the model's own checks, past the server's
            self._unwait()
            handle._end(BadRequestError(str(error)), "invalid")
            return
        self._live[handle.request_id] = handle
        self._unstarted.add(handle)

    def _unwait(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _park(self, handle: RequestHandle, paused: bool) -> None:
        """Count a stream paused for its reader among the waiting (or no longer)."""
        if paused != handle._parked:
            handle._parked = paused
            with self._lock:
                self._waiting += 1 if paused else -1

    def _step(self, latencies: list[float]) -> bool:
        """One engine step; the latencies of the steps it recorded are appended to `latencies`."""
        ran = self.engine.step()
        records = self.engine.records
        for record in reversed(records):
            if record is self._seen_record:
                break
            latencies.append(record.latency)
        if records:
            self._seen_record = records[-1]
        while len(records) > self.history:  # in place: the engine's parts append to this deque
            records.popleft()
        return ran

    def _settle(self) -> None:
        """Answer the handles whose streams ended; count those that ran their first step."""
        for handle in [h for h in self._unstarted if h.stream.phase is not Phase.WAITING]:
            self._unstarted.discard(handle)
            self._unwait()
        for handle in [h for h in self._live.values() if h.stream.phase.finished]:
            stream = handle.stream
            outcome = {Phase.DONE: "done", Phase.CANCELLED: handle._cancelled_as}.get(stream.phase, "failed")
            self._finish(handle, stream.failure, outcome)

    def _finish(self, handle: RequestHandle, failure: RequestError | None, outcome: str) -> None:
        self._live.pop(handle.request_id, None)
        self._park(handle, False)
        outputs = getattr(handle.stream, "chunks", None)
        if outputs is not None:  # every chunk went to the client: the engine's record keeps no audio
            outputs.clear()
        if handle in self._unstarted:
            self._unstarted.discard(handle)
            self._unwait()
        handle._end(failure, outcome)

    def _offload_paused(self) -> None:
        """Offload the streams paused for their readers for `offload_paused_after_s` (module doc)."""
        after, engine = self.offload_paused_after_s, self.engine
        if after is None:  # in lockstep too: a process offloads its own streams alone (lockstep.py)
            return
        now = engine.clock()
        for rid, stream in engine.streams.items():
            if stream.paused and now - stream.last_step_at >= after and not engine.is_offloaded(rid):
                engine.offload(rid)

    def _check_deadline(self) -> None:
        if self._deadline is None or time.monotonic() < self._deadline or not self._live:
            return
        for handle in list(self._live.values()):
            if handle.request_id in self.engine.streams:  # one that ended is answered as shut down too
                self.engine.cancel(handle.request_id)
            self._finish(
                handle,
                ServerShuttingDownError(
                    f"request {handle.request_id!r} cancelled: the server is shutting down and its "
                    "grace period ended; retry it elsewhere"
                ),
                "shutdown",
            )
