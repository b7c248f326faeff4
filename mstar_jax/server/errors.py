"""The errors the server answers with, and how each reaches a client: an HTTP status and an
OpenAI-shaped JSON body before the first byte, an SSE `error` event or a WebSocket close code after it.

A leaf module: the routers, the host and the command share it without importing each other. A request
that ends in the engine with a `RequestError` is answered by `wire_error`, which keeps its type's name
and whether it is retryable, so a client can tell a fault worth retrying (`StateLostError`) from one
that is not.
"""

from __future__ import annotations

from typing import Any

from mstar_jax.serving.stream import RequestCancelledError, RequestError, StateLostError, StepFailedError

__all__ = [
    "WS_CLOSE_BAD_INPUT",
    "WS_CLOSE_FAILED",
    "WS_CLOSE_RETRY",
    "BadRequestError",
    "ClientError",
    "HostNotStartedError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "ServerShuttingDownError",
    "wire_error",
]

WS_CLOSE_BAD_INPUT = 1007
"""WebSocket close code for a message the server refuses (RFC 6455: "invalid frame payload data")."""
WS_CLOSE_RETRY = 1013
"""WebSocket close code for a retryable failure: overload, a lost state, shutdown ("try again later")."""
WS_CLOSE_FAILED = 1011
"""WebSocket close code for a failure retrying will not fix ("internal error")."""


class ClientError(Exception):
    """An answer to a client, with its HTTP status and the OpenAI error body's fields.

    Attributes:
      status: the HTTP status.
      kind: the body's `type` (`invalid_request_error`, `overloaded_error`, ...).
      param: the request field at fault, or None.
      code: a short machine-readable code, or None.
      retryable: whether the same request may succeed later.
      headers: extra response headers (`Retry-After`).
    """

    status = 500
    kind = "server_error"
    retryable = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code", "retryable"}}`, as OpenAI's API shapes it."""
        return {
            "error": {
                "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
                "retryable": self.retryable,
            }
        }  # fmt: skip


class BadRequestError(ClientError):
    """A request refused before the engine saw it; the message names the field, its value and what is
    allowed (400)."""

    status, kind = 400, "invalid_request_error"


class NotFoundError(ClientError):
    """A path the server does not serve for this deployment (404)."""

    status, kind = 404, "not_found_error"


class PayloadTooLargeError(ClientError):
    """A body over `ServerSettings.max_body_bytes` (413)."""

    status, kind = 413, "invalid_request_error"


class OverloadedError(ClientError):
    """More requests wait than `ServerSettings.max_waiting` allows (429, with `Retry-After`)."""

    status, kind, retryable = 429, "overloaded_error", True

    def __init__(self, message: str, *, retry_after_s: int):
        super().__init__(message, code="overloaded")
        self.headers = {"Retry-After": str(retry_after_s)}


class ServerShuttingDownError(RequestError):
    """The server stopped accepting requests (`SIGTERM`), or cancelled one still running at its
    deadline. Retryable: another replica, or this one restarted, will serve it."""

    retryable = True


class HostNotStartedError(RuntimeError):
    """A request submitted to an `EngineHost` before its `start()`: the caller's mistake, not a fault a
    client could retry (a `ServerShuttingDownError` is one), so not retryable; `create_app` starts its
    host before it serves."""

    retryable = False


class _EngineFailureError(ClientError):
    status = 503

    def __init__(self, failure: RequestError):
        super().__init__(str(failure), code=type(failure).__name__)
        self.kind = _KINDS.get(type(failure), "request_failed")
        self.retryable = failure.retryable
        self.status = 503 if failure.retryable else 500


_KINDS = {
    StateLostError: "state_lost",
    StepFailedError: "step_failed",
    RequestCancelledError: "cancelled",
    ServerShuttingDownError: "shutting_down",
}


def wire_error(failure: BaseException) -> ClientError:
    """The client's view of how a request ended: a `ClientError` as it is, a `RequestError` of the engine
    as 503 (retryable: a lost device state, shutdown) or 500, anything else as a 500 naming its type."""
    if isinstance(failure, ClientError):
        return failure
    if isinstance(failure, RequestError):
        return _EngineFailureError(failure)
    error = ClientError(f"{type(failure).__name__}: {failure}", code=type(failure).__name__)
    return error
