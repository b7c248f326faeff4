"""Models built on the resources, and the registry a deployment names them through.

A deployment's `model.name` picks an entry of `MODELS`; `model.config` holds the keyword arguments
of that model's frozen config class, whose `resource_specs()` declares what the engine builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from mstar_jax.models.gemma3.deployment import Gemma3DeploymentConfig
from mstar_jax.models.streaming_tts import StreamingTTSConfig

__all__ = ["MODELS", "Gemma3DeploymentConfig", "StreamingTTSConfig", "model_config"]

MODELS: Mapping[str, type] = MappingProxyType(
    {"streaming_tts": StreamingTTSConfig, "gemma3": Gemma3DeploymentConfig}
)
"""Model name -> its frozen config class (a kw_only dataclass with `resource_specs()`)."""


def model_config(name: str, settings: Mapping[str, Any] | None = None) -> Any:
    """Build the config of the model called `name` from its settings.

    Args:
      name: a key of `MODELS`.
      settings: keyword arguments of that model's config class; absent ones take their defaults.

    Returns:
      The frozen, validated config.

    Raises:
      ValueError: for an unknown model (listing the known ones), a setting the config does not have
        (listing those it has), or a value the config refuses.
    """
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}")
    settings = {} if settings is None else settings
    if not isinstance(settings, Mapping):
        raise ValueError(f"settings={settings!r} for model {name!r} must be a mapping of setting to value")
    cls = MODELS[name]
    accepted = [field.name for field in dataclasses.fields(cls) if field.init]
    unknown = sorted(set(settings) - set(accepted), key=str)
    if unknown:
        raise ValueError(f"model {name!r} has no setting(s) {unknown}; it accepts {accepted}")
    return cls(**settings)
