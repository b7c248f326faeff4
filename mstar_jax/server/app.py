"""`create_app`: the ASGI app in front of one engine, for a speech or a text deployment.

The app owns an `EngineHost` over the engine: its lifespan starts the host thread, and at shutdown
(after `SIGTERM`, once uvicorn has stopped accepting) closes it: streams still running get until
`ServerSettings.shutdown_grace_s` to finish and are then cancelled with a typed, retryable error. The
routes are the model's (`speech.py` or `text.py`), `GET /v1/models`, and the operations ones:

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
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mstar_jax.engine.engine import ServingEngine
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.server.errors import ClientError
from mstar_jax.server.host import EngineHost
from mstar_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from mstar_jax.server.settings import ServerSettings

__all__ = ["create_app"]


def create_app(
    engine: ServingEngine,
    settings: ServerSettings | None = None,
    *,
    model_name: str,
    voices: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> FastAPI:
    """The server of `engine` (module doc); the host thread starts with the app's lifespan.

    Args:
      engine: a warmed-up engine: the TTS `Engine` (then `voices` names its registered voices) or a
        text model's `ServingEngine` (then `tokenizer` is its `TextTokenizer`).
      settings: the limits (default `ServerSettings()`).
      model_name: the name clients give as `model` and `GET /v1/models` lists.
      voices: voice name -> registered `Voice`, for a speech engine.
      tokenizer: a `TextTokenizer`, for a text engine.

    Raises:
      TypeError, ValueError: for an engine, settings, voices or tokenizer of the wrong kind.
    """
    settings = ServerSettings() if settings is None else settings
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings={settings!r} must be a ServerSettings")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name={model_name!r} must be a non-empty str")
    speech = isinstance(engine, Engine)
    metrics = ServerMetrics("audio" if speech else "token")
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

    if speech:
        from mstar_jax.server.speech import SpeechService, speech_router
        from mstar_jax.server.tokenizer import ByteTokenizer

        if not voices:
            raise ValueError("voices must name at least one registered voice for a speech engine")
        bytes_ = ByteTokenizer(
            engine.model.config.text_vocab_size, frames_per_byte=settings.frames_per_byte,
            max_frames=settings.max_frames,
        )  # fmt: skip
        service = SpeechService(host, settings, model_name, dict(voices), bytes_, metrics)
        app.include_router(speech_router(service))
    else:
        from mstar_jax.models.gemma3.chat import TextTokenizer
        from mstar_jax.server.text import TextService, text_router

        if not isinstance(tokenizer, TextTokenizer):
            raise TypeError(f"tokenizer={tokenizer!r} must be a TextTokenizer for a text engine")
        app.include_router(text_router(TextService(host, settings, model_name, tokenizer, metrics)))

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
