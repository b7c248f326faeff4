"""What the routers share: error responses, SSE framing, and a request's first output awaited while
its client may leave.

A stream's status is decided by its first output: the routers wait for it before they send anything,
so a request that fails before its first byte (refused by the model, a device fault) is an HTTP error
with a JSON body, and one that fails after it gets an SSE `error` event (or, for raw audio, a response
cut short: no final chunk, which a client reads as a broken transfer rather than a short file).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mstar_jax.server.errors import BadRequestError, PayloadTooLargeError, wire_error
from mstar_jax.server.fields import Body, parse_json, read_body
from mstar_jax.server.handle import RequestHandle

__all__ = [
    "ClientGoneError",
    "HandleResponse",
    "error_response",
    "first_output",
    "open_stream",
    "sse",
    "sse_error",
    "until_gone",
]


class ClientGoneError(Exception):
    """The client disconnected before its request's first output (the request is cancelled)."""


def error_response(error: BaseException) -> JSONResponse:
    """`error` as an HTTP response: its status, headers and OpenAI-shaped body."""
    wired = wire_error(error)
    return JSONResponse(wired.body(), status_code=wired.status, headers=wired.headers)


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: `data` as JSON (or as it is, a str like `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def sse_error(error: BaseException) -> bytes:
    """The `error` event a stream ends with when its request fails after its first byte."""
    wired = wire_error(error)
    return sse({"type": "error", **wired.body()}, event="error")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_gone(request: Request, handle: RequestHandle, work: Any) -> Any:
    """`await work` (a coroutine), unless the client leaves first: the request is cancelled then.

    Raises:
      ClientGoneError: the client left first.
    """
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
            handle.cancel()
    if not done.done() or done.cancelled():
        raise ClientGoneError
    return done.result()


async def first_output(request: Request, handle: RequestHandle) -> tuple[bool, Any]:
    """`(True, output)`: the request's first output; `(False, None)`: it ended with none.

    Raises:
      ClientGoneError: the client left first (its request is cancelled).
      ClientError, RequestError: how the request failed before any output.
    """
    try:
        return True, await until_gone(request, handle, handle.next())
    except StopAsyncIteration:
        return False, None


async def open_stream(
    request: Request, service: Any, prepare: Callable[[Body], tuple[Any, Any]]
) -> Response | tuple[Any, RequestHandle, Any]:
    """Read the request's body, `prepare(body) -> (what the route keeps, the engine's request)`,
    submit it through `service` and wait for its first output: `(kept, handle, first output or None
    when it ended with none)`, or the response of whatever went wrong first (a 400 for a bad field,
    429, 503, or 499 when the client left; a refusal before the host saw the request is counted)."""
    handle = None
    try:
        body = parse_json(await read_body(request, service.settings.max_body_bytes))
        kept, engine_request = prepare(body)
        handle = service.submit(engine_request)
        started, first = await first_output(request, handle)
    except ClientGoneError:
        return Response(status_code=499)
    except Exception as error:
        refused = isinstance(error, BadRequestError | PayloadTooLargeError)
        if refused and handle is None:  # the host counts its own
            service.metrics.refused("invalid")
        return error_response(error)
    return kept, handle, first if started else None


class HandleResponse(StreamingResponse):
    """A streamed response that cancels its request however the response ends: a client that leaves
    before its body starts never runs the body's own cleanup, and its request would hold its slots."""

    def __init__(self, handle: RequestHandle, content: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.handle = handle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # nothing once the request has ended
