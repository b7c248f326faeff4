"""Admission in the engine loop: declaring a step of rows padded to a bucket (`Admission.declare`), and what a
step does when a resource refuses some of its rows.

- `AllocationFailed` (no free slot): offload an idle stream (paused by its client, or live and between
  turns) from the resource that ran out and retry; with none to offload, hold for `hold_backoff_s` the
  refused request and every other row's that no free slot is left for, and run the others.
- `RequestOffloading` (the request's state is on the host): reload it and retry; if it does not fit
  yet, treat it as `AllocationFailed`.
- `AdmitRuntimeError` (terminal), or an admit that raises: find the request(s) it is about by admitting
  each row alone, fail them with the resource's message, and run the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from mstar_jax.engine import batch
from mstar_jax.resources.step import (
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    FullAdmitOutcome,
    RequestOffloading,
    SubmoduleStep,
)
from mstar_jax.serving.model import Node, ServedModel
from mstar_jax.serving.stream import Phase, RequestError, Stream

__all__ = ["Admission"]


class Admission:
    """Admits a step's rows and answers refusals (module doc).

    Args:
      served: the model (its buckets, bucket choice and stream positions).
      nodes: the engine's nodes, by name.
      streams: the engine's live streams (read; holds and offloads are written to them).
      clock: the engine's time source.
      hold_backoff_s: how long a refused request waits before it is retried.
      fail: ends a stream with a failure (the engine's).

    Attributes:
      holds, allocation_failed, offloads, reloads: what it counted (`EngineStats`).
    """

    def __init__(
        self,
        *,
        served: ServedModel,
        nodes: Mapping[str, Node],
        streams: MutableMapping[str, Stream],
        clock: Callable[[], float],
        hold_backoff_s: float,
        fail: Callable[[Stream, RequestError], None],
    ):
        self._served, self._nodes, self._streams = served, nodes, streams
        self.holds = self.allocation_failed = self.offloads = self.reloads = 0
        self._clock, self._hold_backoff_s, self._fail = clock, hold_backoff_s, fail
        self._buckets, self._mesh = served.programs.buckets, served.mesh

    def admit(self, node: Node, rows: list, bucket: BucketKey | None = None) -> tuple[Any, list] | None:
        """Admit the largest part of `rows` the resources accept, handling each refusal (module doc);
        in `bucket` when one is given (the bucket every process agreed on), else the tightest. Returns
        the declared step and its rows in bucket order, or None when no row could be admitted."""
        while rows:
            declared, rows = self.declare(node, rows, bucket)
            full = self._try_admit(node, declared.sub)
            if full.ok and full.ready:
                return declared, rows
            reason, rids = full.reason, {r.stream.request_id for r in rows}
            if not full.ok and isinstance(reason, AllocationFailed):
                self.allocation_failed += 1
                if self._evict(node, full.failed_resource, exclude=rids):
                    continue
                rows = self.hold(rows, self._left_out(node, full.failed_resource, rows, reason.request_id))
            elif not full.ok and isinstance(reason, RequestOffloading):
                if node.runner.reload(reason.request_id) or (
                    self._evict(node, full.failed_resource, exclude=rids)
                    and node.runner.reload(reason.request_id)
                ):
                    self.reloads += 1
                    continue
                rows = self.hold(rows, {reason.request_id})
            elif not full.ok and isinstance(reason, AdmitRuntimeError):
                culprits = self._terminal_rows(node, rows)
                if not culprits:  # the batch alone is refused: give up on it rather than loop
                    culprits = dict.fromkeys(rids, reason.message)
                for rid, message in culprits.items():
                    if rid in self._streams:  # a request that ended meanwhile is refused, not failed
                        self._fail(self._streams[rid], RequestError(
                            f"resource {full.failed_resource!r} rejected the request: {message}"
                        ))  # fmt: skip
                rows = [r for r in rows if r.stream.request_id not in culprits]
            else:  # admitted but not ready (or an unknown refusal): everyone waits
                rows = self.hold(rows, rids)
        return None

    def declare(self, node: Node, rows: Sequence, bucket: BucketKey | None = None) -> tuple[Any, list]:
        """The step of `rows` padded to its tightest bucket (or to `bucket`), its rows in the bucket's
        order.

        On a mesh a bucket's rows are per data shard: the tightest holds the most rows any shard gets
        (`placement`), and the caches pad each shard to it themselves.
        """
        width = None
        if self._mesh is not None:  # a shard's rows beyond the bucket (or of another walk) wait
            largest = min(self._buckets.max_batch(walk) for walk in self._buckets.walks)
            most = largest if bucket is None else bucket.bs
            rows, width, _ = batch.fit_placed(node.manager, rows, most, bucket, node.row_walks)
        if bucket is None:
            bucket = self._served.choose_bucket(node, rows, rows_per_shard=width)
        return batch.declare(
            bucket,
            rows,
            keys=node.keys,
            positions=lambda streams: self._served.positions(node, streams),
            pad=self._mesh is None,
            steps=self._served.block_steps(bucket),
        )

    def _terminal_rows(self, node: Node, rows: list) -> dict[str, str]:
        """Admit each row alone (then abort it) to find those refused for good, with their messages."""
        culprits = {}
        for row in rows:
            declared, _ = self.declare(node, [row])
            full = self._try_admit(node, declared.sub)
            if full.ok:
                node.runner.abort_step(declared.sub)
            elif isinstance(full.reason, AdmitRuntimeError):
                culprits[row.stream.request_id] = full.reason.message
        return culprits

    @staticmethod
    def _try_admit(node: Node, sub: SubmoduleStep) -> FullAdmitOutcome:
        """`admit`, with an exception read as a terminal refusal: one malformed request must not wedge
        the engine (the refusal is then pinned on the rows that raise alone)."""
        try:
            return node.runner.admit(sub)
        except Exception as err:
            return FullAdmitOutcome(
                AdmitOutcome(False, False, AdmitRuntimeError(f"admit raised {err!r}")), node.key
            )

    @staticmethod
    def _left_out(node: Node, key: str | None, rows: list, refused: str) -> set[str]:
        """`refused` and the requests of `rows` (in bucket order) that would need a slot of cache `key`
        past its free ones. The cache claims first slots in row order, all or none, naming the first
        request left out: holding those past it together is where refusing them one by one, a declare
        and an admit each, ends (a crowd of new streams at a full cache cost one retry, not one each)."""
        manager = node.runner[key or node.key]
        need = [
            rid for rid in (r.stream.request_id for r in rows)
            if manager.slot_of(rid) is None and not manager.is_offloaded(rid)
        ]  # fmt: skip
        return {refused, *need[manager.free_slots :]}

    def hold(self, rows: list, rids: set[str]) -> list:
        """Hold the requests `rids` for `hold_backoff_s`; return the other rows."""
        until = self._clock() + self._hold_backoff_s
        for rid in rids:
            self._streams[rid].hold_until = until
            self.holds += 1
        return [r for r in rows if r.stream.request_id not in rids]

    def _evict(self, node: Node, key: str | None, *, exclude: set[str]) -> bool:
        """Offload, from every cache of the node, the least recently stepped stream holding a slot of `key`
        that is paused or live and idle; True if one was. A stream holds a slot in each of its node's caches:
        offloading it from one alone would leave it half on the device, which no step can run."""
        manager = node.runner[key or node.key]
        victims = [
            s for s in self._streams.values()
            if (s.paused or s.phase is Phase.IDLE) and s.request_id not in exclude
            and manager.slot_of(s.request_id) is not None
        ]  # fmt: skip
        if not victims:
            return False
        victim = min(victims, key=lambda s: s.last_step_at)
        node.runner.offload(victim.request_id, keys=node.keys)
        self.offloads += 1
        return True

    def offload_idle(self, now: float, idle_after_s: float) -> None:
        """Offload every stream no step has touched for `idle_after_s`."""
        for stream in self._streams.values():
            if now - stream.last_step_at >= idle_after_s:
                for node in self._nodes.values():
                    if node.holds(stream.request_id):
                        node.runner.offload(stream.request_id)
                        self.offloads += 1
