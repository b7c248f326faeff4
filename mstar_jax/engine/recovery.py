"""Surviving a device fault (docs/design.md §11).

A step donates its node's cache; if it fails after that, every request holding a slot of that cache
lost its entries. Without snapshots those requests fail with `StateLostError` (retryable) and the
engine serves on with an empty cache. With snapshots (`EngineSettings(snapshot_every=N)`), the engine copies
both caches and every stream's progress to host memory every N steps; after a fault it restores the
lost requests' entries from the last snapshot and rewinds their progress on that node to it (or to
their start, for requests that began since). Replaying is exact because sampling is keyed by (seed,
position) and a request's outputs do not depend on its batch: the talker must generate the codes it
generated before (`Stream.replay_codes` checks), and the flow's replayed chunks, already delivered,
are compared with what was delivered rather than delivered again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from mstar_jax.engine.request import Phase, StateLostError, StepFailedError, Stream
from mstar_jax.resources.kv.bounded.host import BoundedKVSnapshot
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

if TYPE_CHECKING:
    from mstar_jax.engine.records import Node

__all__ = ["EngineSnapshot", "Mark", "Recovery", "rewind", "take_snapshot"]

MAX_STEP_FAULTS = 3  # failed steps (device state intact) a request rides out before it fails alone


@dataclasses.dataclass(frozen=True)
class Mark:
    """A stream's progress when a snapshot was taken (`stream` tells a reused request id apart)."""

    stream: Stream
    phase: Phase
    prefilled: int
    talker_written: int
    codes: int
    flow_written: int


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Both caches and every live stream's progress, in host memory, taken between steps.

    Attributes:
      steps: engine steps run when it was taken.
      caches: each node's cache snapshot, by node name ("talker", "flow").
      marks: each live stream's progress, by request id.
    """

    steps: int
    caches: Mapping[str, BoundedKVSnapshot]
    marks: Mapping[str, Mark]

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches.values())


def take_snapshot(
    steps: int, managers: Mapping[str, BoundedKVManager], streams: Iterable[Stream]
) -> EngineSnapshot:
    marks = {
        s.request_id: Mark(s, s.phase, s.prefilled, s.talker_written, len(s.codes), s.flow_written)
        for s in streams
    }
    return EngineSnapshot(steps, {name: m.snapshot() for name, m in managers.items()}, marks)


def rewind(stream: Stream, node: str, mark: Mark | None) -> None:
    """Roll `stream`'s progress on `node` back to `mark`, or to its start without one."""
    if node == "flow":
        stream.flow_written = mark.flow_written if mark else 0
        return
    if len(stream.codes) > len(stream.replay_codes):  # an earlier replay may still be catching up
        stream.replay_codes = tuple(stream.codes)
    del stream.codes[mark.codes if mark else 0 :]
    stream.codes_in_flight, stream.feed = 0, None  # an engine rewinds only with nothing in flight
    stream.phase = mark.phase if mark else Phase.WAITING
    stream.prefilled = mark.prefilled if mark else 0
    stream.talker_written = mark.talker_written if mark else 0


class Recovery:
    """The part of `Engine` that serves on after a step raised (module doc)."""

    def _recover(self, node: Node, rows: list, err: Exception, *, lost: bool = False) -> None:
        """Serve on after `node`'s step raised `err` (module doc; docs/design.md §11); `lost`: its cache
        is to be treated as lost even where its buffers survive."""
        self.counters["faults"] += 1
        manager = node.manager
        if not lost and not manager.cache_lost():
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
        holders = [s for s in self.streams.values() if manager.slot_of(s.request_id) is not None]
        self.counters["requests_lost"] += len(holders)
        if self.snapshot_every is None:
            manager.recover()
            for stream in holders:
                self._fail(stream, StateLostError(
                    f"a device fault in a {node.name} step ({err!r}) lost request {stream.request_id!r}'s "
                    "cache state; submit it again"
                ))  # fmt: skip
            return
        snapshot = self.last_snapshot
        marks = {
            rid: mark for rid, mark in (snapshot.marks.items() if snapshot else ())
            if self.streams.get(rid) is mark.stream
        }  # fmt: skip
        manager.recover(snapshot.caches[node.name] if snapshot else None, restore=marks.keys())
        for stream in holders:
            node.runner.ingest_request(stream.request_id)  # those not restored start over
            rewind(stream, node.name, marks.get(stream.request_id))
        self.counters["requests_restored"] += len(holders)
