"""What the engine keeps per step for reports (`StepRecord`); the step in flight and the graph node are
the serving layer's (`mstar_jax.serving.model.InFlight`, `Node`), re-exported here."""

from __future__ import annotations

import dataclasses

from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.model import InFlight, Node

__all__ = ["InFlight", "Node", "StepRecord"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step, for reports.

    Attributes:
      walk: the graph walk.
      bucket: the bucket it replayed.
      rows: real rows.
      started: clock time at its start.
      latency: seconds from forming the batch to its outputs on the host.
      positions: each real row's stream length (entries written) when the step started.
      compilations: programs compiled during it (0 after warm-up).
      request_ids: the real rows' requests.
    """

    walk: str
    bucket: BucketKey
    rows: int
    started: float
    latency: float
    positions: tuple[int, ...]
    compilations: int
    request_ids: tuple[str, ...] = ()
