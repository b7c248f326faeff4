"""mstar-jax: the resource layer of a streaming inference engine, in JAX.

Models declare resources in frozen specs (`mstar_jax.resources.spec`); each engine step declares what
every request adds (`mstar_jax.resources.step`); resources admit, plan and commit steps. The centre is a
bounded KV cache (`mstar_jax.resources.kv.bounded`): a shared read-only source prefix plus the tokens a
request writes, of which only the first `sink` and last `window` entries are kept.
"""

__version__ = "0.1.0"
