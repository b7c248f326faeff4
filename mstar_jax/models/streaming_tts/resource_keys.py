"""The streaming TTS model's resource keys: the one place they are spelled.

The model declares its caches under these keys (`StreamingTTSConfig.resource_specs`), a deployment's
`resources:` block tunes them by these keys, and the engine and the memory budget look the caches up by
them. A leaf module, so each of those imports the keys without importing the others.
"""

__all__ = ["FLOW_KV", "TALKER_KV"]

TALKER_KV = "talker_kv"
"""The talker's bounded KV cache, used by node "talker"."""

FLOW_KV = "flow_kv"
"""The flow decoder's bounded KV cache, used by node "flow"."""
