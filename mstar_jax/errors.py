"""The errors a refused deployment raises, in a leaf module.

`mstar_jax.deployment` raises them while loading a file, `mstar_jax.devices` and `mstar_jax.memory` while
checking it against the hardware; defined here, below all three, none of those needs to import another
for its errors. `mstar_jax.deployment` re-exports both: catch them from there.
"""

from __future__ import annotations

__all__ = ["DeploymentError", "DeploymentTypeError"]


class DeploymentError(ValueError):
    """A deployment the loader refuses; the message names the file, the section and the key."""


class DeploymentTypeError(DeploymentError, TypeError):
    """An unknown key in a resource's block: a `TypeError` as the resource raised it, and a
    `DeploymentError` so one `except` catches every refused deployment."""
