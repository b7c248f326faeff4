"""A model's endpoints as the server mounts them, and the endpoint every model gets without writing any.

A model hands `create_app` its `ModelRoutes` (its registry entry's `build` returns them): what its
metrics count, and a function that makes its router over the server's host. The speech model's are
`/v1/audio/speech` and its WebSocket (`models/streaming_tts/routes.py`), Gemma's the completions
(`models/gemma3/routes.py`). A model without endpoints of its own serves `stream_routes`: its codec says
how a JSON body becomes its request and how each output becomes JSON.

- `POST /v1/streams`: a JSON body the codec reads (and `stream`, default false). The answer is
  `{"id", "outputs": [...]}` once every output is there, or with `stream: true` Server-Sent Events, one
  `{"type": "output", "output"}` a output as it comes, then `{"type": "done", "outputs": n}`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from mstar_jax.server.admission import submit_counted
from mstar_jax.server.fields import Body
from mstar_jax.server.handle import RequestHandle
from mstar_jax.server.host import EngineHost
from mstar_jax.server.metrics import ServerMetrics
from mstar_jax.server.responses import HandleResponse, error_response, open_stream, sse, sse_error
from mstar_jax.server.settings import ServerSettings

__all__ = ["ModelRoutes", "ServerContext", "StreamCodec", "stream_routes"]


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """What a model's router is made over: the host, the limits, the served name and the metrics."""

    host: EngineHost
    settings: ServerSettings
    model_name: str
    metrics: ServerMetrics

    def submit(self, request: Any) -> RequestHandle:
        """Submit `request` through the host, counting a refusal (`open_stream`'s service)."""
        return submit_counted(self.host, self.metrics, request)


@dataclasses.dataclass(frozen=True)
class ModelRoutes:
    """A model's endpoints (module doc).

    Attributes:
      unit: what a first output is, for the metrics (`audio`, `token`, `output`).
      router: `router(context: ServerContext) -> APIRouter`; raises `TypeError` or `ValueError` for an
        engine it cannot serve.
    """

    unit: str
    router: Callable[[ServerContext], APIRouter]

    def __post_init__(self):
        if not isinstance(self.unit, str) or not self.unit:
            raise TypeError(f"unit={self.unit!r} must be a non-empty str")
        if not callable(self.router):
            raise TypeError(f"router={self.router!r} must be callable")


@dataclasses.dataclass(frozen=True)
class StreamCodec:
    """How `stream_routes` speaks for a model.

    Attributes:
      request: `request(body: Body, request_id: str) -> request`: the model's request of a JSON body,
        each field read through `Body` (a bad one is a 400 naming it).
      output: `output(value) -> JSON-able`: one of the model's outputs as the client gets it.
    """

    request: Callable[[Body, str], Any]
    output: Callable[[Any], Any]


def stream_routes(codec: StreamCodec) -> ModelRoutes:
    """`POST /v1/streams` (module doc) for a model served through `codec`."""

    def router(context: ServerContext) -> APIRouter:
        ids = itertools.count()
        routes = APIRouter()

        @routes.post("/v1/streams")
        async def streams(request: Request) -> Response:
            def prepare(body: Body) -> tuple:
                body.choice("model", [context.model_name], default=context.model_name)
                stream = body.boolean("stream", default=False)
                made = codec.request(body, f"stream-{next(ids)}")
                return (stream, made.request_id), made

            opened = await open_stream(request, context, prepare)
            if isinstance(opened, Response):
                return opened
            (stream, rid), handle, first = opened
            outputs = _outputs(handle, first, codec.output)
            if stream:
                events, headers = _events(outputs), {"Cache-Control": "no-cache"}
                return HandleResponse(handle, events, media_type="text/event-stream", headers=headers)
            try:
                gathered = [output async for output in outputs]
            except Exception as error:  # answered as every other failure is
                return error_response(error)
            return JSONResponse({"id": rid, "outputs": gathered})

        return routes

    return ModelRoutes("output", router)


async def _outputs(handle: RequestHandle, first: Any, encode: Callable[[Any], Any]) -> AsyncIterator[Any]:
    """The request's outputs, encoded, as they come; cancels it if its reader stops early."""
    try:
        if first is not None:
            yield encode(first)
            async for output in handle:
                yield encode(output)
    finally:
        handle.cancel()  # nothing once it ended; else its client left: free its slots


async def _events(outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    count = 0
    try:
        async for output in outputs:
            count += 1
            yield sse({"type": "output", "output": output})
    except Exception as error:
        yield sse_error(error)
        return
    yield sse({"type": "done", "outputs": count})
