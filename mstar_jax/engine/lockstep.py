"""One engine in many processes: every process runs the same programs, in the same order, on its own
requests (docs/design.md §10).

In a multi-process deployment (a TPU pod's hosts) every process runs a `ServingEngine` over the one
global mesh, and a compiled step is a program all of them must enter together. Each process admits its
own requests into its own data shards; before each of a round's programs (e.g. a decoder's decode and
prefill, then a chunk node's) the processes agree, over `distributed.most_of_all`, on its bucket: the
most rows any data shard of any process brings (where the rows say their walk, `Node.row_walks`, also
the most prefill rows, and whether any decode rows, so all pick the same walk). A process with nothing
to run enters the program with every row of its shards empty. The loop's end is agreed the same way: a
process keeps stepping while any process has work. A pipelined engine agrees the same way: what a
process brings is known at dispatch (`ServedModel.dispatched`), and reading a step back touches only its
own rows, so no read waits on another process.

Snapshots are taken by every process at once (the engine agrees, with `anywhere`, on which steps ran
and whether any cache is lost, so every process copies its caches at the same steps), each of its own
shards and requests; after a fault each process restores its own shards from its last one and
replays its own requests. A process offloads and reloads its own streams through its own shards of the
cache (`resources/kv/bounded/host.py`), running no program the others would have to enter.
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

    def check(self) -> None:
        """Refuse managers admitting into another process's data shards.

        Raises:
          MultiProcessError: naming the manager.
        """
        if not self.enabled:
            return
        local = distributed.local_data_shards(self._mesh)
        for node in self._nodes.values():
            for name, manager in zip(node.keys, node.managers, strict=True):
                if manager.local_data_shards != local:
                    raise MultiProcessError(
                        f"the {name} manager admits into data shards {list(manager.local_data_shards)}, but "
                        f"process {jax.process_index()} holds {list(local)}; build it with "
                        "local_data_shards=mstar_jax.distributed.local_data_shards(mesh)"
                    )

    def agreed_bucket(self, node: Node, rows: list, walk: str | None) -> BucketKey | None:
        """The bucket every process runs `walk` in next (None: no process has rows for it).

        `walk` None: the rows say their walk (`node.row_walks`: decode and prefill rows, on the combined
        walk where any process has both kinds): the processes agree on the most rows, the most prefill
        rows and whether any decode rows any data shard brings, so all pick the same walk and bucket.
        """
        buckets = self._buckets
        largest = buckets.max_batch(walk) if walk is not None else min(map(buckets.max_batch, buckets.walks))
        kept, width = [], 0
        if rows:
            kept, width, placed = batch.fit_placed(node.manager, rows, largest, walks=node.row_walks)
        most = distributed.most_of_all(width)
        if not most:
            return None
        if walk is not None:
            return buckets.bucket_for(walk, most, buckets.max_tokens(walk))
        prefill = [r for r in kept if not r.decode]
        _, prefill_width = batch.fit_shards(prefill, placed, largest) if prefill else (None, 0)
        prefill_most = distributed.most_of_all(prefill_width)
        decode_anywhere = bool(distributed.most_of_all(int(len(prefill) < len(kept))))
        return batch.agreed_rows_bucket(buckets, node.row_walks, most, prefill_most, decode=decode_anywhere)

    def anywhere(self, flag: bool) -> bool:
        """Whether any process says `flag` (`flag` itself in one process): that it has work (loops that
        drive the engine end on it, so every process steps as often), that a step ran, that a cache is
        lost."""
        return bool(distributed.most_of_all(int(flag))) if self.enabled else flag
