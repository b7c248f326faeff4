"""Warm-up: compiling, before serving, everything serving calls besides the captured steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mstar_jax.compile import count_compilations
from mstar_jax.engine.lockstep import Lockstep
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.step import Segment, StepContext, SubmoduleStep
from mstar_jax.serving.model import Node, ServedModel

__all__ = ["WARM_UP_ID", "warm_up"]

WARM_UP_ID = "\x00warmup"
"""The request warm-up borrows slots for: no client's (warm-up ends before the engine takes requests),
and not a padding row's (`PAD`), which the caches never admit as a request."""


def warm_up(
    *,
    served: ServedModel,
    nodes: Mapping[str, Node],
    lockstep: Lockstep,
    snapshot: Callable[[], Any] | None,
) -> int:
    """Compile what serving calls besides the captured steps: what the model registers for it
    (`ServedModel.warming_up`: e.g. a voice a speech model's requests read), offload, reload, snapshots
    (`snapshot`, when the engine takes them), the agreement between processes. Borrows a slot of every
    cache of every node and gives it back; returns the compilations it caused.
    """
    with count_compilations() as counter, served.warming_up():
        rid = WARM_UP_ID
        for node in nodes.values():
            node.runner.ingest_request(rid)
            position = served.warm_up_position(node)
            step = BoundedKVStep((Segment(rid, "main", 0),), {rid: position}, {rid: 1})
            sub = SubmoduleStep(dict.fromkeys(node.keys, step))
            sub.set_ctx(StepContext([rid], "warmup", 0, capture=False))
            if not node.runner.admit(sub).ok:
                raise RuntimeError(f"warm_up could not borrow a {node.key} slot; is the engine idle?")
            node.runner.commit(sub)
            node.runner.offload(rid)  # in a multi-process engine, through this process's own shards
            node.runner.reload(rid)
            node.runner.remove_request(rid)
        lockstep.anywhere(False)  # compiles the processes' agreement (lockstep.py)
        if snapshot is not None:
            snapshot()  # compiles the cache copies a snapshot reads through
    for manager in (m for node in nodes.values() for m in node.managers):
        manager.placed = [0] * manager.data_shards  # the borrowed slots were no request's
    return counter.count
