"""The front door: `mstar-jax serve`, the engine behind OpenAI-compatible HTTP and WebSocket endpoints.

`EngineHost` (`host.py`) runs a `ServingEngine` on a thread of its own; `create_app` (`app.py`) puts the
model's endpoints (`ModelRoutes`, `routes.py`: its own, or `stream_routes` for any model), health,
readiness and metrics in front of it. Names are re-exported lazily: importing the package loads neither
FastAPI nor the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EngineHost",
    "ModelRoutes",
    "RequestHandle",
    "ServerSettings",
    "StreamCodec",
    "create_app",
    "stream_routes",
]

_HOMES = {
    "EngineHost": "mstar_jax.server.host",
    "RequestHandle": "mstar_jax.server.handle",
    "ServerSettings": "mstar_jax.server.settings",
    "create_app": "mstar_jax.server.app",
    "ModelRoutes": "mstar_jax.server.routes",
    "StreamCodec": "mstar_jax.server.routes",
    "stream_routes": "mstar_jax.server.routes",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'mstar_jax.server' has no attribute {name!r}")
