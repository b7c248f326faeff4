"""Injected device faults, for testing what a serving stack does when a step fails (docs/design.md §11).

`inject_faults(engine, node, schedule)` wraps the captured programs of one of the engine's nodes (by
its `Node.name`): before each of its steps it asks `schedule(n)` (n
counts that node's steps from 1) what to do:

- `None`: run normally;
- `"before"`: raise without running, as a failure before the program started would (the cache survives);
- `"after"`: run, consuming the donated cache, then raise, as a failure after launch would;
- `"poison"`: delete the cache's first buffer, then run (the program refuses a deleted buffer);
- `"unreadable"`: run, then lose the outputs, so reading them back raises, as a failure on the device
  after dispatch would (a pipelined engine learns of it a step later).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax

__all__ = ["FAULT_KINDS", "InjectedFaultError", "inject_faults"]

Fault = Literal["before", "after", "poison", "unreadable"]
FAULT_KINDS: tuple[Fault, ...] = ("before", "after", "poison", "unreadable")


class InjectedFaultError(RuntimeError):
    """The failure an injected fault raises."""


@dataclasses.dataclass
class _FaultyStep:
    step: Any
    node: str
    schedule: Callable[[int], Fault | None]
    calls: list[int]  # shared by every walk of the node

    @property
    def frozen_argnums(self) -> tuple[int, ...]:
        return self.step.frozen_argnums

    def replay(self, bucket, params, cache, *args):
        self.calls[0] += 1
        fault = self.schedule(self.calls[0])
        if fault not in (None, *FAULT_KINDS):
            raise ValueError(f"schedule({self.calls[0]})={fault!r} must be None or one of {FAULT_KINDS}")
        if fault == "before":
            raise InjectedFaultError(f"injected before {self.node} step {self.calls[0]}")
        if fault == "poison":
            jax.tree.leaves(cache)[0].delete()
        out = self.step.replay(bucket, params, cache, *args)
        if fault == "after":
            raise InjectedFaultError(f"injected after {self.node} step {self.calls[0]}")
        if fault == "unreadable":
            for array in jax.tree.leaves(out[1]):
                array.delete()
        return out


def inject_faults(engine: Any, node: str, schedule: Callable[[int], Fault | None]) -> list[int]:
    """Make `engine`'s `node` steps fail as `schedule` says (module doc); returns the step counter [n].

    Raises:
      ValueError: for a node the engine does not have.
    """
    if node not in engine.nodes:
        raise ValueError(f"node={node!r} must be one of the engine's nodes {list(engine.nodes)}")
    calls, served = [0], engine.served
    steps = dict(served.programs.steps)
    for walk in engine.nodes[node].walks:
        steps[walk] = _FaultyStep(steps[walk], node, schedule, calls)
    served.programs = dataclasses.replace(served.programs, steps=steps)  # the model's, which it replays
    return calls
