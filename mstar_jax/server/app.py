"""`create_app`: the ASGI app in front of one engine, serving its model's endpoints.

The app owns an `EngineHost` over the engine: its lifespan starts the host thread, and at shutdown
(after `SIGTERM`, once uvicorn has stopped accepting) closes it: streams still running get until
`ServerSettings.shutdown_grace_s` to finish and are then cancelled with a typed, retryable error. The
routes are the model's (`ModelRoutes`, `server/routes.py`), `GET /v1/models`, and the operations ones:

- `GET /health`: 200 while the engine thread runs (alive), else 503;
- `GET /ready`: 200 once the engine is captured and warmed up and the server accepts requests, else 503;
- `GET /metrics`: Prometheus text (`metrics.py`).

Every error body is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, unknown paths
and methods included.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mstar_jax.engine.engine import ServingEngine
from mstar_jax.server.errors import ClientError
from mstar_jax.server.host import EngineHost
from mstar_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from mstar_jax.server.routes import ModelRoutes, ServerContext
from mstar_jax.server.settings import ServerSettings

__all__ = ["create_app"]


def create_app(
    engine: ServingEngine,
    settings: ServerSettings | None = None,
    *,
    model_name: str,
    routes: ModelRoutes,
) -> FastAPI:
    """The server of `engine` (module doc); the host thread starts with the app's lifespan.

    Args:
      engine: a warmed-up engine.
      settings: the limits (default `ServerSettings()`).
      model_name: the name clients give as `model` and `GET /v1/models` lists.
      routes: the model's endpoints (its registry entry's `build` gives them).

    Raises:
      TypeError, ValueError: for settings or routes of the wrong kind, or routes that cannot serve the
        engine.
    """
    settings = ServerSettings() if settings is None else settings
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings={settings!r} must be a ServerSettings")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name={model_name!r} must be a non-empty str")
    if not isinstance(routes, ModelRoutes):
        raise TypeError(f"routes={routes!r} must be a ModelRoutes (mstar_jax.server.routes)")
    metrics = ServerMetrics(routes.unit)
    host = EngineHost(
        engine, max_waiting=settings.max_waiting, stream_buffer=settings.stream_buffer,
        retry_after_s=settings.retry_after_s, offload_paused_after_s=settings.offload_paused_after_s,
        history=settings.history, observer=metrics,
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        host.start()
        try:
            yield
        finally:
            await asyncio.to_thread(host.close, settings.shutdown_grace_s)

    app = FastAPI(title="mstar-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.host, app.state.metrics, app.state.settings = host, metrics, settings
    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        model = {"id": model_name, "object": "model", "created": created, "owned_by": "mstar-jax"}
        return JSONResponse({"object": "list", "data": [model]})

    app.include_router(routes.router(ServerContext(host, settings, model_name, metrics)))

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = host.alive
        return JSONResponse(
            {"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503
        )

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state = {"alive": host.alive, "warmed_up": engine.warmed_up, "accepting": host.accepting}
        return JSONResponse(
            {"ready": all(state.values()), **state}, status_code=200 if all(state.values()) else 503
        )

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        wired = ClientError(
            f"{request.method} {request.url.path}: {error.detail}", code=str(error.status_code)
        )
        wired.kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(wired.body(), status_code=error.status_code)

    return app
