"""The bounded KV cache: sink + sliding-window retention over a shared source prefix.

`BoundedKVManager` is the resource (slots, admission, plans, the source bank, offload); `attend` is the
per-layer entry point a model calls with the cache, the manager's bank and its plan; `pad_step` pads a
step to a compiled bucket.
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
from mstar_jax.resources.kv.bounded.padding import PaddedStep, pad_step

__all__ = [
    "BoundedKVCache",
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedKVPlan",
    "BoundedKVSpec",
    "BoundedKVStep",
    "PaddedStep",
    "SinkWindow",
    "SourceBank",
    "StreamPosition",
    "attend",
    "pad_step",
]
