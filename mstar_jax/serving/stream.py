"""What every served request has, whatever its model: where it stands, how it ended, and the engine's
bookkeeping of its steps. A model's stream subclasses `Stream` with its own progress and outputs.

Errors a request can end with are here too, so models and the engine share them without importing each
other.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "Phase",
    "ReplayMismatchError",
    "RequestCancelledError",
    "RequestError",
    "StateLostError",
    "StepFailedError",
    "Stream",
]


class RequestError(RuntimeError):
    """A request ended without all its outputs. `retryable`: submitting it again may well succeed."""

    retryable = False


class RequestCancelledError(RequestError):
    """The client cancelled the request."""


class StateLostError(RequestError):
    """A device fault lost the request's cache state (and no snapshot could restore it)."""

    retryable = True


class StepFailedError(RequestError):
    """The request's steps kept failing while the device state survived them."""


class ReplayMismatchError(RequestError):
    """A replay after a fault did not reproduce what the request had already delivered."""


class Phase(enum.Enum):
    """Where a request stands."""

    WAITING = "waiting"  # submitted, no step admitted yet
    PREFILL = "prefill"  # its first node is reading its prompt
    DECODE = "decode"  # its first node is generating, one token a step (later nodes follow behind)
    FLUSH = "flush"  # its first node is done; later nodes finish what is left
    IDLE = "idle"  # a live stream between turns: it holds its slots (or their offloaded copy), runs no rows
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __init__(self, value: str):
        # `finished`: whether the request ended. A member's attribute, not a property: the engine asks it
        # of every row at every step, and a property is a Python call each time.
        self.finished = value in ("done", "failed", "cancelled")


# The members the engine's loops test and set per row per step, as module names: a member looked up on
# its Enum class goes through the class's __getattr__ (Python 3.11), a global does not.
PREFILL, DECODE, FLUSH, IDLE = Phase.PREFILL, Phase.DECODE, Phase.FLUSH, Phase.IDLE


@dataclasses.dataclass(eq=False)
class Stream:
    """A request's state, owned by the engine; clients read it.

    Attributes:
      request: what was asked (the model's request type; it has a `request_id`).
      phase: where it stands.
      error: why it failed or was cancelled (the refusing resource's message, say), else None.
      failure: the same as a typed `RequestError`, else None.
      submitted_at, finished_at: clock stamps (None until they happen).
      paused: the client is not reading; the engine schedules nothing for it.
      live: it takes more input after each turn (`ServingEngine.append`): a turn's end leaves it
        `Phase.IDLE`, in its slots, until input comes or `ServingEngine.close` ends it.
      closing: a live stream closed mid-turn: it ends (done) once its turns are read.
      last_step_at: when a step last ran for it (for idle offloading).
      hold_until: the engine retries its admission from then on (after a refusal for lack of room).
      faults: failed steps in a row it was in whose device state survived (it fails after a few); the
        engine counts them and clears them when one of its steps comes back.
    """

    request: Any
    phase: Phase = Phase.WAITING
    error: str | None = None
    failure: RequestError | None = None
    submitted_at: float = 0.0
    finished_at: float | None = None
    paused: bool = False
    live: bool = False
    closing: bool = False
    last_step_at: float = 0.0
    hold_until: float = 0.0
    faults: int = 0
    request_id: str = dataclasses.field(init=False, repr=False)
    """The request's id (`request.request_id`): an attribute, which the engine reads per row per step."""

    def __post_init__(self):
        self.request_id = self.request.request_id

    def written_in(self, node: str) -> int:
        """Entries committed to the caches of `node`."""
        raise NotImplementedError
