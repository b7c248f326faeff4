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
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from mstar_jax.server.errors import wire_error
from mstar_jax.server.handle import RequestHandle

__all__ = ["ClientGoneError", "error_response", "first_output", "sse", "sse_error"]


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


async def first_output(request: Request, handle: RequestHandle) -> tuple[bool, Any]:
    """`(True, output)`: the request's first output; `(False, None)`: it ended with none.

    Raises:
      ClientGoneError: the client left first (its request is cancelled).
      ClientError, RequestError: how the request failed before any output.
    """
    first = asyncio.ensure_future(handle.next())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
            handle.cancel()
    if not first.done() or first.cancelled():
        raise ClientGoneError
    try:
        return True, first.result()
    except StopAsyncIteration:
        return False, None
