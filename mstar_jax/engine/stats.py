"""What an engine counted: one typed record (`EngineStats`), read from the parts that count.

Each part of the engine keeps its own counts as its own attributes, which it alone writes (admission:
holds, allocation failures, offloads and reloads; recovery: faults, lost and restored requests;
dispatch: what a pipelined engine overlapped); `ServingEngine.stats` reads them into one frozen record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["EngineStats"]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """An engine's counts since it was built (a snapshot: `ServingEngine.stats` makes a new one).

    Attributes:
      done, failed, cancelled: streams that ended so.
      holds: requests held after a refusal, to be retried after `hold_backoff_s`.
      allocation_failed: admissions refused for lack of a slot.
      offloads: streams offloaded to the host (evicted for room, idle, or asked for).
      reloads: offloaded streams reloaded to the device.
      faults: steps that raised.
      requests_lost: streams a lost cache held (failed, or restored from a snapshot).
      requests_restored: of those, streams restored from a snapshot and replayed.
      snapshots: snapshots taken.
      lockstep_empty_steps: programs this process ran with no row of its own, in lockstep with others.
      rows_fed_on_device: decode rows whose input token stayed on the device (a pipelined engine).
      steps_read_behind: node name -> its steps read back only after the next was dispatched.
    """

    done: int = 0
    failed: int = 0
    cancelled: int = 0
    holds: int = 0
    allocation_failed: int = 0
    offloads: int = 0
    reloads: int = 0
    faults: int = 0
    requests_lost: int = 0
    requests_restored: int = 0
    snapshots: int = 0
    lockstep_empty_steps: int = 0
    rows_fed_on_device: int = 0
    steps_read_behind: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def admission(self) -> dict[str, int]:
        """The counts of requests and their admission, by name (a report's `admission`)."""
        skip = {"rows_fed_on_device", "steps_read_behind"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    def pipeline(self) -> dict[str, Any]:
        """What a pipelined engine overlapped, by name (a report's `pipeline`)."""
        behind = {f"{node}_steps_read_behind": n for node, n in sorted(self.steps_read_behind.items())}
        return {"rows_fed_on_device": self.rows_fed_on_device, **behind}
