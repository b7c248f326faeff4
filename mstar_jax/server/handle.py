"""`RequestHandle`: one request's crossing from the host thread to the coroutine serving its client,
and the commands a handle posts to its host (`host.EngineHost`).

Outputs arrive from the host thread in batches, one `loop.call_soon_threadsafe` per host loop and event
loop (`receive_all`); the handle buffers them and counts what its reader has not taken, which is how the
host knows to pause a stream whose client stopped reading and to resume it once half is read.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Any

__all__ = ["Cancel", "RequestHandle", "Resume", "Submit", "receive_all"]


class RequestHandle:
    """One request's crossing from the host thread to the coroutine that serves its client.

    Read it with `async for output in handle` (or `await handle.next()`); iteration ends when the
    request is done, and raises its failure (a `RequestError`, or a `BadRequestError` the engine's own
    checks raised at submit). `cancel()` is idempotent and thread-safe.

    Attributes:
      request: what was submitted.
      paused: whether the engine holds the stream paused because this handle's buffer is full.
      most_buffered: the most outputs this handle ever held unread.
      pauses: times the stream was paused for its reader.
    """

    def __init__(self, host: Any, request: Any, loop: asyncio.AbstractEventLoop):
        self.request, self._host, self._loop = request, host, loop
        self.request_id: str = request.request_id
        self.submitted_at = time.perf_counter()
        self._items: collections.deque[tuple[bool, Any]] = collections.deque()  # (is_end, value)
        self._wake = asyncio.Event()
        self._lock = threading.Lock()  # guards the counts below, shared by both threads
        self._buffered = 0
        self._resume_posted = False
        self.paused = False
        self.most_buffered = 0
        self.pauses = 0
        self.stream: Any = None  # the engine's stream, once submitted (host thread)
        self.first_output_at: float | None = None
        self._parked = False  # counted among the waiting while paused (host thread)
        self.outcome: str | None = None
        self._cancelled_as = "cancelled"  # what a cancel asked for counts as (host thread)
        self._ended = False
        self._cancelled = False

    # -- the host thread ----------------------------------------------------------------------------

    def _deliver(self, output: Any) -> None:
        """The engine's `on_output`: buffer `output` for the client; pause the stream when it is full."""
        if self.first_output_at is None:
            self.first_output_at = time.perf_counter()
            self._host._observer.first_output(self.first_output_at - self.submitted_at)
        with self._lock:
            self._buffered += 1
            self.most_buffered = max(self.most_buffered, self._buffered)
            pause = not self.paused and self._buffered >= self._host.stream_buffer
            if pause:
                self.paused, self._resume_posted = True, False
                self.pauses += 1
        if pause and self.request_id in self._host.engine.streams:
            self._host.engine.pause(self.request_id)
            self._host._park(self, True)
        self._post((False, output))

    def _end(self, failure: BaseException | None, outcome: str) -> None:
        if self._ended:
            return
        self._ended, self.outcome = True, outcome
        self._host._observer.ended(outcome)
        self._post((True, failure))

    def _post(self, item: tuple[bool, Any]) -> None:
        self._host._outbox.append((self, item))  # handed to the loop once per host loop (`_flush`)

    # -- the event loop -----------------------------------------------------------------------------

    def _receive(self, item: tuple[bool, Any]) -> None:
        self._items.append(item)
        self._wake.set()

    async def next(self) -> Any:
        """The next output; `StopAsyncIteration` at the end, or the request's failure."""
        while not self._items:
            self._wake.clear()
            await self._wake.wait()
        is_end, value = self._items[0]
        if is_end:  # left in place: every later call answers the same
            if value is None:
                raise StopAsyncIteration
            raise value
        self._items.popleft()
        with self._lock:
            self._buffered -= 1
            resume = (
                self.paused and not self._resume_posted and self._buffered <= self._host.stream_buffer // 2
            )
            if resume:
                self._resume_posted = True
        if resume:
            self._host._post(Resume(self))
        return value

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Any:
        return await self.next()

    @property
    def buffered(self) -> int:
        """Outputs delivered and not read yet."""
        return self._buffered

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self, *, outcome: str = "cancelled") -> None:
        """Cancel the request (its client went away, or has all it wants: `outcome="done"`, a stop
        string met); its slots are freed before the engine's next step."""
        if not self._cancelled and not self._ended:
            self._cancelled = True
            self._host._post(Cancel(self, outcome))


def receive_all(items: list[tuple[RequestHandle, tuple[bool, Any]]]) -> None:
    """On the event loop: hand each handle its items, in order."""
    for handle, item in items:
        handle._receive(item)


@dataclasses.dataclass(frozen=True)
class Submit:
    """Submit the handle's request to the engine."""

    handle: RequestHandle


@dataclasses.dataclass(frozen=True)
class Cancel:
    """Cancel the handle's request; `outcome` is what its end counts as."""

    handle: RequestHandle
    outcome: str = "cancelled"


@dataclasses.dataclass(frozen=True)
class Resume:
    """Resume the handle's stream, paused for its reader."""

    handle: RequestHandle
