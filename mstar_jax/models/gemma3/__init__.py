"""Gemma 3 (270M): its config, weights read from a GGUF file, and its SentencePiece tokenizer."""

from mstar_jax.models.gemma3.gguf import (
    DTYPES,
    Gemma3Config,
    GGUFError,
    default_gguf_path,
    load_gguf,
    open_gguf,
    read_config,
)
from mstar_jax.models.gemma3.tokenizer import Gemma3Tokenizer

__all__ = [
    "DTYPES",
    "GGUFError",
    "Gemma3Config",
    "Gemma3Tokenizer",
    "default_gguf_path",
    "load_gguf",
    "open_gguf",
    "read_config",
]
