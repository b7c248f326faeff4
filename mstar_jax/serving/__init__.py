"""The serving layer models plug into: the protocol a model implements to be served by the engine
(`ServedModel`, its `Node`s, the `Stream` every request has), the step transaction every model's steps
run through, the attention its layers call on a bounded cache, a decoder step that feeds on the device,
the abstract arguments it is captured from, reproducible sampling, and the bookkeeping every one-node
decoder shares (`GreedyDecoder`)."""

from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.attention import LayerAttention, layer_attention
from mstar_jax.serving.decoder import DecodeRow, DecoderStream, GreedyDecoder
from mstar_jax.serving.decoder_programs import DecoderPrograms, capture_decoder, fed_width
from mstar_jax.serving.feed import fed
from mstar_jax.serving.model import InFlight, Node, ServedModel, StreamOps
from mstar_jax.serving.sampling import gumbel_noise, sample, sample_or
from mstar_jax.serving.stream import (
    Phase,
    ReplayMismatchError,
    RequestCancelledError,
    RequestError,
    StateLostError,
    StepFailedError,
    Stream,
)
from mstar_jax.serving.transaction import Declared, Resources, abort, admit, declare, run_admitted

__all__ = [
    "Declared",
    "DecodeRow",
    "DecoderPrograms",
    "DecoderStream",
    "GreedyDecoder",
    "InFlight",
    "LayerAttention",
    "Node",
    "Phase",
    "ReplayMismatchError",
    "RequestCancelledError",
    "RequestError",
    "Resources",
    "ServedModel",
    "StateLostError",
    "StepFailedError",
    "Stream",
    "StreamOps",
    "abort",
    "abstract",
    "admit",
    "capture_decoder",
    "declare",
    "fed",
    "fed_width",
    "gumbel_noise",
    "layer_attention",
    "run_admitted",
    "sample",
    "sample_or",
    "shaped",
]
