"""The serving layer models plug into: the step transaction every model's steps run through, the
attention its layers call on a bounded cache, and the abstract arguments it is captured from."""

from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.attention import LayerAttention, layer_attention
from mstar_jax.serving.transaction import Declared, Resources, abort, admit, declare, run_admitted

__all__ = [
    "Declared",
    "LayerAttention",
    "Resources",
    "abort",
    "abstract",
    "admit",
    "declare",
    "layer_attention",
    "run_admitted",
    "shaped",
]
