"""The engine: requests in, batches per graph node through the resources and captured programs, outputs
out. `ServingEngine` serves any `mstar_jax.serving.ServedModel`; models live in `mstar_jax.models`, and
nothing here imports them."""

from mstar_jax.engine.engine import ServingEngine, StepRecord
from mstar_jax.engine.stats import EngineStats
from mstar_jax.serving.stream import Phase

__all__ = ["EngineStats", "Phase", "ServingEngine", "StepRecord"]
