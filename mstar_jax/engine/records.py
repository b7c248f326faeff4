"""What the engine keeps per step (`StepRecord`, for reports; `InFlight`, until its outputs are read) and
per graph node (`Node`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey

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


@dataclasses.dataclass(frozen=True)
class Node:
    """One graph node: its runner and the one bounded cache it uses."""

    name: str
    key: str
    runner: ResourceRunner
    manager: BoundedKVManager


@dataclasses.dataclass(eq=False)
class InFlight:
    """A step dispatched to the device whose outputs are not read back yet.

    Attributes:
      node: its graph node.
      serial: the engine's count of dispatched steps when it was dispatched (`Stream.feed`).
      bucket: the bucket it replayed.
      rows: its real rows, in bucket order.
      indices: each row's place in the per-row outputs.
      outputs: the program's outputs, on the device (a talker's codes, a flow's mel and samples).
      started: clock time when its rows were formed.
      positions, compilations: as `StepRecord` has them.
      coded: the talker rows that generate a code (set at dispatch).
    """

    node: Node
    serial: int
    bucket: BucketKey
    rows: list
    indices: list[int]
    outputs: Any
    started: float
    positions: tuple[int, ...]
    compilations: int
    coded: tuple[bool, ...] = ()
