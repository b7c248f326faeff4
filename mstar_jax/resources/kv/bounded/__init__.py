"""The bounded KV cache: sink + sliding-window retention over a shared source prefix."""

from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)

__all__ = ["BoundedKVConfig", "BoundedKVSpec", "BoundedKVStep", "SinkWindow", "StreamPosition"]
