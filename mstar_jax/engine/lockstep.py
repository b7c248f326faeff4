"""One engine in many processes: every process runs the same programs, in the same order, on its own
requests (docs/design.md §10).

In a multi-process deployment (a TPU pod's hosts) every process runs a `ServingEngine` over the one global
mesh, and a compiled step is a program all of them must enter together. Each process admits its own
requests into its own data shards; before each of a round's programs (e.g. the TTS model's talker
decode, talker prefill, flow) the processes agree, over `distributed.most_of_all`, on its bucket: the
most rows any data shard of any process brings. A process with nothing to run enters the program with
every row of its shards empty. The loop's end is agreed the same way: a process keeps stepping while
any process has work. A pipelined engine agrees the same way: what a process brings is known at
dispatch (`ServedModel.dispatched`), and reading a step back touches only its own rows, so no read waits
on another process.

What needs one process alone to touch the whole cache is refused up front: offloading a stream, idle
offload, and snapshots (each would read a slot through a program only its owner would enter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from mstar_jax import distributed
from mstar_jax.compile import Buckets
from mstar_jax.engine import batch
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.model import Node

__all__ = ["Lockstep", "MultiProcessError"]


class MultiProcessError(ValueError):
    """An engine setting or call that a multi-process deployment cannot honour."""


class Lockstep:
    """Keeps a multi-process deployment's processes in step (module doc); in one process it agrees with
    itself at no cost.

    Args:
      mesh: the engine's mesh (None: one device, no other process).
      nodes: the engine's nodes (their caches must admit into this process's data shards).
      buckets: the buckets every process captured.

    Attributes:
      enabled: the mesh spans processes; everything here is then called by every process alike.
    """

    def __init__(self, mesh: Any, nodes: Mapping[str, Node], buckets: Buckets):
        self.enabled = mesh is not None and distributed.spans_processes(mesh)
        self._mesh, self._nodes, self._buckets = mesh, nodes, buckets

    def check(self, offload_idle_after_s: float | None, snapshot_every: int | None) -> None:
        """Refuse what a multi-process engine cannot do, and managers admitting into others' shards.

        Raises:
          MultiProcessError: naming the setting or the manager.
        """
        if not self.enabled:
            return
        settings = {"offload_idle_after_s": offload_idle_after_s, "snapshot_every": snapshot_every}
        for name, value in settings.items():
            if value is not None:
                raise MultiProcessError(
                    f"engine.{name}={value!r}: a multi-process deployment keeps every stream on its devices "
                    "(offloads and snapshots read slots through programs only their owner would run); "
                    f"set {name}: null"
                )
        local = distributed.local_data_shards(self._mesh)
        for node in self._nodes.values():
            for name, manager in zip(node.keys, node.managers, strict=True):
                if manager.local_data_shards != local:
                    raise MultiProcessError(
                        f"the {name} manager admits into data shards {list(manager.local_data_shards)}, but "
                        f"process {jax.process_index()} holds {list(local)}; build it with "
                        "local_data_shards=mstar_jax.distributed.local_data_shards(mesh)"
                    )

    def agreed_bucket(self, node: Node, rows: list, walk: str) -> BucketKey | None:
        """The bucket every process runs `walk` in next (None: no process has rows for it)."""
        buckets = self._buckets
        width = 0
        if rows:
            placed = node.manager.placement([r.stream.request_id for r in rows])
            _, width = batch.fit_shards(rows, placed, buckets.max_batch(walk))
        most = distributed.most_of_all(width)
        return buckets.bucket_for(walk, most, buckets.max_tokens(walk)) if most else None

    def busy_anywhere(self, busy: bool) -> bool:
        """Whether any process says it has work (`busy` itself in one process); loops that drive the
        engine end on it, so every process steps as often."""
        return bool(distributed.most_of_all(int(busy))) if self.enabled else busy
