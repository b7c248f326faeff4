"""The streaming TTS model's entry in the registry (`mstar_jax.registry`), and what it checks of a
deployment beyond the generic checks."""

from __future__ import annotations

from typing import Any

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.registry import ModelEntry

__all__ = ["ENTRY", "check_deployment", "check_serving"]


def check_deployment(deployment: Any) -> None:
    """Refuse token buckets too small for a flow chunk: no flow step could run.

    Raises:
      ValueError: naming the key the file set (derived buckets end at `compile.max_tokens`).
    """
    chunk = deployment.model_config.flow_chunk
    if max(deployment.token_counts) >= chunk:
        return
    listed = deployment.compile.token_counts is not None
    counts = list(deployment.token_counts)
    given = (
        f"compile.token_counts={counts}"
        if listed
        else f"compile.max_tokens={deployment.compile.max_tokens} (token counts {counts})"
    )
    fix = f"add {chunk} to compile.token_counts" if listed else f"raise compile.max_tokens to {chunk}"
    raise ValueError(
        f"{given} has no bucket of >= model.config.flow_chunk={chunk} frames, so no flow chunk "
        f"could run; {fix}"
    )


def check_serving(deployment: Any) -> None:
    """Refuse a text vocabulary the server cannot speak: it sends UTF-8 bytes, one text token each.

    Raises:
      ValueError: naming `model.config.text_vocab_size`.
    """
    vocab = deployment.model_config.text_vocab_size
    if vocab < 256:
        raise ValueError(
            f"model.config.text_vocab_size={vocab} must be >= 256: the server speaks UTF-8 bytes, one text "
            "token each"
        )


ENTRY = ModelEntry(
    name="streaming_tts",
    config=StreamingTTSConfig,
    run="mstar_jax.models.streaming_tts.run:run_deployment",
    build="mstar_jax.models.streaming_tts.run:serve_engine",
    memory="mstar_jax.models.streaming_tts.memory:memory_budget",
    check="mstar_jax.models.streaming_tts.entry:check_deployment",
    serve_check="mstar_jax.models.streaming_tts.entry:check_serving",
)
