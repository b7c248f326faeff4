"""What the engine keeps per step (`StepRecord`, for reports) and per graph node (`Node`)."""

from __future__ import annotations

import dataclasses

from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey

__all__ = ["Node", "StepRecord"]


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


@dataclasses.dataclass(frozen=True)
class Node:
    """One graph node: its runner and the one bounded cache it uses."""

    name: str
    key: str
    runner: ResourceRunner
    manager: BoundedKVManager
