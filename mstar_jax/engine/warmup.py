"""Voices and warm-up: registering voice prompts in both caches' source banks, and compiling, before
serving, everything serving calls besides the captured steps."""

from __future__ import annotations

from mstar_jax.compile import count_compilations
from mstar_jax.engine import batch
from mstar_jax.engine.voices import Voice
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.step import Segment, StepContext, SubmoduleStep

__all__ = ["VoicesAndWarmUp"]


class VoicesAndWarmUp:
    """The part of `Engine` that registers voices and warms up (it reads the engine's nodes and voices)."""

    def add_voice(self, index: int, *, frames: int, seed: int) -> Voice:
        """Register a random voice prompt (see `VoiceBank.add`); after warm-up this compiles nothing.

        Raises:
          ValueError: when a live request names voice `index`, admitted or still queued (it would
            otherwise start speaking with the replacement).
        """
        waiting = sorted(rid for rid, s in self.streams.items() if s.request.voice.index == index)
        if waiting:
            raise ValueError(
                f"voice {index} is named by live request(s) {waiting}; replace it once they finish"
            )
        with count_compilations() as counter:
            voice = self.voices.add(index, frames=frames, seed=seed)
        if self.warmed_up:
            self.compilations += counter.count
        return voice

    def warm_up(self) -> int:
        """Compile what serving calls besides the captured steps: voice registration, offload, reload,
        snapshots, the agreement between processes.

        Runs on an idle engine (it borrows a slot of each cache). Returns the compilations it caused;
        from here on `compilations` counts any compilation a step causes.
        """
        if self.streams:
            raise RuntimeError("warm_up() runs on an idle engine; call it before submitting requests")
        with count_compilations() as counter:
            temporary = None
            voice = next(iter(self.voices.voices.values()), None)
            if voice is None:
                temporary = self.voices.capacity - 1
                voice = self.add_voice(temporary, frames=self.model.config.min_voice_frames, seed=0)
            rid = f"{batch.PAD}warmup"
            for node in self.nodes.values():
                node.runner.ingest_request(rid)
                step = BoundedKVStep((Segment(rid, "main", 0),), {rid: voice.position(0)}, {rid: 1})
                sub = SubmoduleStep({node.key: step})
                sub.set_ctx(StepContext([rid], "warmup", 0, capture=False))
                if not node.runner.admit(sub).ok:
                    raise RuntimeError(f"warm_up could not borrow a {node.key} slot; is the engine idle?")
                node.runner.commit(sub)
                if not self.lockstep:  # a multi-process engine never offloads (lockstep.py)
                    node.runner.offload(rid)
                    node.runner.reload(rid)
                node.runner.remove_request(rid)
            if temporary is not None:
                self.voices.remove(temporary)
            self.busy_anywhere(False)  # compiles the processes' agreement (lockstep.py)
            if self.snapshot_every is not None:
                self.snapshot()  # compiles the cache copies a snapshot reads through
                self.last_snapshot, self.counters["snapshots"] = None, 0
        for node in self.nodes.values():
            node.manager.placed = [0] * node.manager.data_shards  # the borrowed slots were no request's
        self.warmed_up = True
        self.compilations = 0
        self.warmup_compilations = counter.count
        return counter.count
