"""Surviving a device fault (docs/design.md §11).

A step donates its node's caches; if it fails after that, every request holding a slot of them lost
its entries. Without snapshots those requests fail with `StateLostError` (retryable) and the engine
serves on with empty caches. With snapshots (`EngineSettings(snapshot_every=N)`), the engine copies every
cache and every stream's progress (the model's `mark`) to host memory every N steps; after a fault it
restores the lost requests' entries from the last snapshot and rewinds their progress on that node to it
(or to their start, for requests that began since; the model's `rewind`). Replaying is exact because
sampling is keyed by (seed, position) and a request's outputs do not depend on its batch: a model
checks that the replay generates what was generated before, and compares outputs already delivered
rather than delivering them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from mstar_jax.resources.kv.bounded.host import BoundedKVSnapshot
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.serving.model import Node, ServedModel
from mstar_jax.serving.stream import RequestError, StateLostError, StepFailedError, Stream

__all__ = ["EngineSnapshot", "Recovery", "take_snapshot"]

MAX_STEP_FAULTS = 3  # failed steps (device state intact) a request rides out before it fails alone


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Every cache and every live stream's progress, in host memory, taken between steps.

    Attributes:
      steps: engine steps run when it was taken.
      caches: each cache's snapshot, by resource key.
      marks: each live stream and its progress (the model's `mark`), by request id.
    """

    steps: int
    caches: Mapping[str, BoundedKVSnapshot]
    marks: Mapping[str, tuple[Stream, Any]]

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches.values())


def take_snapshot(
    steps: int, managers: Mapping[str, BoundedKVManager], marks: Mapping[str, tuple[Stream, Any]]
) -> EngineSnapshot:
    return EngineSnapshot(steps, {key: m.snapshot() for key, m in managers.items()}, dict(marks))


class Recovery:
    """Serves on after a step raised (module doc).

    Args:
      served: the model (it rewinds its streams).
      streams: the engine's live streams.
      snapshot_every: whether snapshots are taken (None: a lost cache fails its requests).
      fail: ends a stream with a failure (the engine's).
      hold: holds rows for a while, returning the others (`Admission.hold`).

    Attributes:
      last_snapshot: what a lost cache is restored from (the engine takes it every `snapshot_every`
        steps).
      faults, requests_lost, requests_restored: what it counted (`EngineStats`).
    """

    def __init__(
        self,
        *,
        served: ServedModel,
        streams: Mapping[str, Stream],
        snapshot_every: int | None,
        fail: Callable[[Stream, RequestError], None],
        hold: Callable[[list, set[str]], list],
    ):
        self._served, self._streams = served, streams
        self.faults = self.requests_lost = self.requests_restored = 0
        self._snapshot_every, self._fail, self._hold = snapshot_every, fail, hold
        self.last_snapshot: EngineSnapshot | None = None

    def recover(self, node: Node, rows: list, err: Exception, *, lost: bool = False) -> None:
        """Serve on after `node`'s step raised `err` (module doc; docs/design.md §11); `lost`: its caches
        are to be treated as lost even where their buffers survive."""
        self.faults += 1
        if not lost and not any(m.cache_lost() for m in node.managers):
            for row in rows:
                row.stream.faults += 1
                if row.stream.faults >= MAX_STEP_FAULTS:
                    self._fail(row.stream, StepFailedError(
                        f"{row.stream.faults} {node.name} steps with request {row.stream.request_id!r} "
                        f"failed; the last raised {err!r}"
                    ))  # fmt: skip
            self._hold(
                [r for r in rows if not r.stream.phase.finished],
                {r.stream.request_id for r in rows if not r.stream.phase.finished},
            )
            return
        holders = [s for s in self._streams.values() if node.holds(s.request_id)]
        self.requests_lost += len(holders)
        if self._snapshot_every is None:
            for m in node.managers:
                m.recover()
            for stream in holders:
                self._fail(stream, StateLostError(
                    f"a device fault in a {node.name} step ({err!r}) lost request {stream.request_id!r}'s "
                    "cache state; submit it again"
                ))  # fmt: skip
            return
        snapshot = self.last_snapshot
        marks = {
            rid: mark for rid, (stream, mark) in (snapshot.marks.items() if snapshot else ())
            if self._streams.get(rid) is stream
        }  # fmt: skip
        for key, m in zip(node.keys, node.managers, strict=True):
            m.recover(snapshot.caches[key] if snapshot else None, restore=marks.keys())
        for stream in holders:
            node.runner.ingest_request(stream.request_id)  # those not restored start over
            self._served.rewind(stream, node, marks.get(stream.request_id))
        self.requests_restored += len(holders)
