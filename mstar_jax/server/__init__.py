"""The front door: `mstar-jax serve`, the engine behind OpenAI-compatible HTTP and WebSocket endpoints.

`EngineHost` (`host.py`) runs a `ServingEngine` on a thread of its own; `create_app` (`app.py`) puts the
speech (`speech.py`) or text (`text.py`) endpoints, health, readiness and metrics in front of it. Names
are re-exported lazily: importing the package loads neither FastAPI nor the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EngineHost", "RequestHandle", "ServerSettings", "create_app"]

_HOMES = {
    "EngineHost": "mstar_jax.server.host",
    "RequestHandle": "mstar_jax.server.handle",
    "ServerSettings": "mstar_jax.server.settings",
    "create_app": "mstar_jax.server.app",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'mstar_jax.server' has no attribute {name!r}")
