"""Gemma 3's entry in the registry (`mstar_jax.registry`)."""

from mstar_jax.models.gemma3.command import GENERATE
from mstar_jax.models.gemma3.deployment import Gemma3DeploymentConfig
from mstar_jax.registry import ModelEntry

__all__ = ["ENTRY"]

ENTRY = ModelEntry(
    name="gemma3",
    config=Gemma3DeploymentConfig,
    run="mstar_jax.models.gemma3.run:run_text_deployment",
    build="mstar_jax.models.gemma3.run:serve_engine",
    memory="mstar_jax.models.gemma3.deployment:memory_budget",
    commands=(GENERATE,),
)
