"""The bounded KV cache: sink + sliding-window retention over a shared source prefix.

`BoundedKVManager` is the resource (slots, admission, plans, the source bank, offload); `attend` is the
per-layer entry point a model calls with the manager's cache, bank and plan.
"""

from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

__all__ = [
    "BoundedKVCache",
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedKVPlan",
    "BoundedKVSpec",
    "BoundedKVStep",
    "SinkWindow",
    "SourceBank",
    "StreamPosition",
    "attend",
]
