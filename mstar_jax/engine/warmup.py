"""Warm-up: compiling, before serving, everything serving calls besides the captured steps."""

from __future__ import annotations

from mstar_jax.compile import count_compilations
from mstar_jax.engine import batch
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.step import Segment, StepContext, SubmoduleStep

__all__ = ["WarmUp"]


class WarmUp:
    """The part of the engine that warms up (it borrows a slot of every cache of every node)."""

    def warm_up(self) -> int:
        """Compile what serving calls besides the captured steps: what the model registers for it
        (`ServedModel.warming_up`: the TTS model's voices), offload, reload, snapshots, the agreement
        between processes.

        Runs on an idle engine (it borrows a slot of each cache). Returns the compilations it caused;
        from here on `compilations` counts any compilation a step causes.
        """
        if self.streams:
            raise RuntimeError("warm_up() runs on an idle engine; call it before submitting requests")
        with count_compilations() as counter, self.served.warming_up():
            rid = f"{batch.PAD}warmup"
            for node in self.nodes.values():
                node.runner.ingest_request(rid)
                position = self.served.warm_up_position(node)
                step = BoundedKVStep((Segment(rid, "main", 0),), {rid: position}, {rid: 1})
                sub = SubmoduleStep(dict.fromkeys(node.keys, step))
                sub.set_ctx(StepContext([rid], "warmup", 0, capture=False))
                if not node.runner.admit(sub).ok:
                    raise RuntimeError(f"warm_up could not borrow a {node.key} slot; is the engine idle?")
                node.runner.commit(sub)
                if not self.lockstep:  # a multi-process engine never offloads (lockstep.py)
                    node.runner.offload(rid)
                    node.runner.reload(rid)
                node.runner.remove_request(rid)
            self.busy_anywhere(False)  # compiles the processes' agreement (lockstep.py)
            if self.snapshot_every is not None:
                self.snapshot()  # compiles the cache copies a snapshot reads through
                self.last_snapshot, self.counters["snapshots"] = None, 0
        for manager in (m for node in self.nodes.values() for m in node.managers):
            manager.placed = [0] * manager.data_shards  # the borrowed slots were no request's
        self.warmed_up = True
        self.compilations = 0
        self.warmup_compilations = counter.count
        return counter.count
