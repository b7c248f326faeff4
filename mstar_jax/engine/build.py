"""What building any model's engine from a `Deployment` shares: its mesh and its executable store's
folder."""

from __future__ import annotations

from typing import Any

from mstar_jax.resources.kv.bounded.sharding import make_mesh

__all__ = ["EXECUTABLES", "deployment_mesh"]

EXECUTABLES = "executables"
"""The executable store's folder inside a deployment's `persistent_cache_dir`."""


def deployment_mesh(deployment: Any) -> Any:
    """The deployment's mesh (docs/design.md §10), its devices checked; None for one device."""
    if deployment.mesh.devices == 1:
        return None
    deployment.check_devices()
    return make_mesh(deployment.mesh.data, deployment.mesh.model)
