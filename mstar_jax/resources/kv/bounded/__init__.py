"""The bounded KV cache: sink + sliding-window retention over a shared source prefix.

`BoundedKVManager` is the resource (slots, admission, plans, the source bank, offload); `attend` is the
per-layer entry point a model calls with the cache, the manager's bank and its plan; `pad_step` pads a
step to a compiled bucket.

The names below are imported on first use (PEP 562), so declaring a resource (`from
mstar_jax.resources.kv.bounded.config import BoundedKVSpec`, which runs this file first) stays free of the
manager and the kernels, as `NodeResourceSpec.resource_class` promises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from mstar_jax.resources.kv.bounded.attention import attend
    from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
    from mstar_jax.resources.kv.bounded.config import (
        BoundedKVConfig,
        BoundedKVSpec,
        BoundedKVStep,
        PositionColumns,
        SinkWindow,
        StreamPosition,
    )
    from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
    from mstar_jax.resources.kv.bounded.padding import PaddedStep, pad_step

__all__ = [
    "BoundedKVCache",
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedKVPlan",
    "BoundedKVSpec",
    "BoundedKVStep",
    "PaddedStep",
    "PositionColumns",
    "SinkWindow",
    "SourceBank",
    "StreamPosition",
    "attend",
    "pad_step",
]


def __getattr__(name: str) -> Any:
    """Import the exported `name` from its submodule on first use, and keep it here for the next.

    Each submodule is named in an import statement of its own, so the import graph (and
    tests/test_import_graph.py, which reads it) sees every edge this package has.
    """
    if name in (
        "BoundedKVConfig",
        "BoundedKVSpec",
        "BoundedKVStep",
        "PositionColumns",
        "SinkWindow",
        "StreamPosition",
    ):
        from mstar_jax.resources.kv.bounded import config as module
    elif name in ("BoundedKVCache", "BoundedKVPlan", "SourceBank"):
        from mstar_jax.resources.kv.bounded import cache as module
    elif name in ("PaddedStep", "pad_step"):
        from mstar_jax.resources.kv.bounded import padding as module
    elif name == "attend":
        from mstar_jax.resources.kv.bounded import attention as module
    elif name == "BoundedKVManager":
        from mstar_jax.resources.kv.bounded import manager as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The exports belong in dir() before first use: autodoc and tab completion list members from it.
    return sorted(set(globals()) | set(__all__))
