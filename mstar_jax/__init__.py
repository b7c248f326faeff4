"""mstar-jax: the resource layer of a streaming inference engine, in JAX.

Models declare resources in frozen specs (`mstar_jax.resources.spec`); each engine step declares what
every request adds (`mstar_jax.resources.step`); resources admit, plan and commit steps. The centre is a
bounded KV cache (`mstar_jax.resources.kv.bounded`): a shared read-only source prefix plus the tokens a
request writes, of which only the first `sink` and last `window` entries are kept.

The names a user starts from are here, each imported on first use (PEP 562), so `import mstar_jax` loads
neither JAX nor the engine: the engine (`ServingEngine`, `EngineSettings`), the protocol a served model
implements (`ServedModel`, its `Node`s, the `Stream` of each request), the cache (`BoundedKVManager`,
`BoundedKVSpec`, `BoundedKVConfig`, `SinkWindow`, `attend`, `pad_step`), capture (`capture`, `Buckets`)
and deployments (`load_deployment`, `Deployment`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from mstar_jax.compile.buckets import Buckets
    from mstar_jax.compile.capture import capture
    from mstar_jax.deployment import Deployment, load_deployment
    from mstar_jax.engine.engine import ServingEngine
    from mstar_jax.resources.kv.bounded.attention import attend
    from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, SinkWindow
    from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
    from mstar_jax.resources.kv.bounded.padding import pad_step
    from mstar_jax.serving.model import Node, ServedModel
    from mstar_jax.serving.stream import Stream
    from mstar_jax.settings import EngineSettings

__version__ = "0.1.0"

__all__ = [
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedKVSpec",
    "Buckets",
    "Deployment",
    "EngineSettings",
    "Node",
    "ServedModel",
    "ServingEngine",
    "SinkWindow",
    "Stream",
    "attend",
    "capture",
    "load_deployment",
    "pad_step",
]


def __getattr__(name: str) -> Any:
    """Import the exported `name` from its module on first use, and keep it here for the next.

    Each module is named in an import statement of its own, so the import graph (and
    tests/test_import_graph.py, which reads it) sees every edge.
    """
    if name == "ServingEngine":
        from mstar_jax.engine import engine as module
    elif name == "EngineSettings":
        from mstar_jax import settings as module
    elif name in ("Node", "ServedModel"):
        from mstar_jax.serving import model as module
    elif name == "Stream":
        from mstar_jax.serving import stream as module
    elif name in ("BoundedKVConfig", "BoundedKVSpec", "SinkWindow"):
        from mstar_jax.resources.kv.bounded import config as module
    elif name == "BoundedKVManager":
        from mstar_jax.resources.kv.bounded import manager as module
    elif name == "attend":
        from mstar_jax.resources.kv.bounded import attention as module
    elif name == "pad_step":
        from mstar_jax.resources.kv.bounded import padding as module
    elif name in ("Buckets", "capture"):
        from mstar_jax import compile as module  # its `capture` attribute is the function, not the module
    elif name in ("Deployment", "load_deployment"):
        from mstar_jax import deployment as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The exports belong in dir() before first use: autodoc and tab completion list members from it.
    return sorted(set(globals()) | set(__all__))
