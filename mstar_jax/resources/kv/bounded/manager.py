"""`BoundedKVManager`: slots, the source bank, admission, plans and commits of the bounded KV cache.

Host state is plain Python (a free list, one record per request); device state is the functional
`BoundedKVCache` and `SourceBank`. A caller either takes the cache and holds it itself (`take_cache()`,
then each step's `attend` returns the next one) or lets the manager hold it (`manager.cache`, which the
engine replaces by each step's returned cache, since the old one was donated).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable, Sequence

import jax
import numpy as np

from mstar_jax.checks import brief, check_bool, check_int
from mstar_jax.resources.base import Resource
from mstar_jax.resources.kv.bounded import columns as cols
from mstar_jax.resources.kv.bounded import planning
from mstar_jax.resources.kv.bounded.admission import (
    admitted_segments,
    check_rows,
    claim_slots,
)
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVSpec, BoundedKVStep, StreamPosition
from mstar_jax.resources.kv.bounded.host import BoundedKVSnapshot, HostCopies, RequestRecord
from mstar_jax.resources.kv.bounded.sharding import stored_heads
from mstar_jax.resources.kv.bounded.slots import SlotPools
from mstar_jax.resources.kv.bounded.sources import Sources
from mstar_jax.resources.spec import NodeResourceSpec, ResourceReqConfig
from mstar_jax.resources.step import (
    ADMIT_OK,
    PAD,
    AdmitOutcome,
    ResourceStep,
    StepContext,
    UnknownRequestError,
)

__all__ = ["DEFAULT_NUM_SOURCES", "BoundedKVManager"]

DEFAULT_NUM_SOURCES = 8


class BoundedKVManager(Resource):
    """Serves a `BoundedKVSpec`: one slot per live request, sources read in place.

    Admission is atomic: a refused `admit` claims nothing. `plan` is a pure function of the step and
    the committed state; `commit` advances each request's `written` by its span. On a mesh
    (docs/design.md §10) `data_shards` slot pools split the slots and `model_shards` the KV heads, the
    store holding `stored_heads` of them (copies where the heads are fewer than the model shards). In a
    multi-process deployment a process admits only into its `local_data_shards`
    (`mstar_jax.distributed.local_data_shards`); None admits into every shard.

    `admit`, `plan`, `commit` and `abort_step` take `ctx=None` for a step driven without an engine
    (`StepContext.for_step`).

    Attributes:
      cache: the device cache the manager holds (offload, reload, snapshots and recovery work on it); the
        engine replaces it with each step's result. After `take_cache()` the caller holds it instead,
        and reading this raises until it is assigned back.
    """

    supports_eviction = True

    def __init__(
        self,
        spec: BoundedKVSpec,
        *,
        num_sources: int = DEFAULT_NUM_SOURCES,
        data_shards: int = 1,
        model_shards: int = 1,
        local_data_shards: Collection[int] | None = None,
    ):
        if not isinstance(spec, BoundedKVSpec):
            raise TypeError(f"spec={brief(spec)} must be a BoundedKVSpec")
        check_int("num_sources", num_sources, minimum=1)
        check_int("model_shards", model_shards, minimum=1)
        self.spec = spec
        self.config = spec.config
        self._slots = SlotPools(self.config.max_slots, data_shards, local_data_shards)
        self.placed = [0] * data_shards  # requests whose first step ran on each data shard (reports)
        # With fewer KV heads than model shards every shard stores a copy of its head (docs/design.md §10).
        self.stored_heads = stored_heads(self.config.num_heads, model_shards)
        self._storage = self.config
        if self.stored_heads != self.config.num_heads:
            self._storage = dataclasses.replace(self.config, num_heads=self.stored_heads)
        self._cache: BoundedKVCache | None = BoundedKVCache.create(self._storage, data_shards=data_shards)
        self._requests: dict[str, RequestRecord] = {}
        self._source_lengths: dict[int, int] = {}
        self._readers: Counter[int] = Counter()
        self._claims: list[str] = []  # requests a step admitted not yet committed or aborted gave a slot
        # The last admitted step's rows as columns: its plan and commit read them, until a record changes.
        self._columns: cols.StepColumns | None = None
        # The persistent batch (`columns.CommittedRows`): the last columns step's rows after its commit,
        # dropped wherever a record may change otherwise; and the plan fields of the admitted columns.
        self._committed: cols.CommittedRows | None = None
        self._fields: tuple[cols.StepColumns, dict] | None = None
        # Its parts share its records, slots and counters (the same objects, updated in place).
        bank = SourceBank.create(self._storage, num_sources)
        self._sources = Sources(
            config=self.config, stored_heads=self.stored_heads, bank=bank, lengths=self._source_lengths,
            readers=self._readers,
        )  # fmt: skip
        self._host = HostCopies(
            config=self._storage, requests=self._requests, slots=self._slots, readers=self._readers,
            get_cache=lambda: self.cache, set_cache=lambda cache: setattr(self, "cache", cache),
        )  # fmt: skip

    @classmethod
    def build(cls, spec: NodeResourceSpec, dependencies=None, **kwargs) -> BoundedKVManager:
        return cls(spec, **kwargs)  # which refuses a spec that is not a BoundedKVSpec

    # Device state.
    def abstract_cache(self) -> BoundedKVCache:
        """The cache as `jax.ShapeDtypeStruct` specs (allocates nothing), for ahead-of-time compilation."""
        return BoundedKVCache.abstract(self._storage, self._slots.shards)

    def take_cache(self) -> BoundedKVCache:
        """Hand the device cache to the caller, who threads it through the steps from now on.

        `attend` returns each step's next cache (donate the old one); the manager keeps only host
        bookkeeping, and `manager.cache` raises until the caller assigns it back (offload, reload,
        snapshots and recovery work on `manager.cache`).

        Raises:
          RuntimeError: the cache was taken already and not given back.
        """
        cache = self.cache
        self._cache = None
        return cache

    @property
    def cache(self) -> BoundedKVCache:
        if self._cache is None:
            raise RuntimeError(
                "manager.cache: the caller holds the device cache (take_cache() handed it out); pass the "
                "cache you hold, or give it back with manager.cache = cache first"
            )
        return self._cache

    @cache.setter
    def cache(self, cache: BoundedKVCache) -> None:
        self._cache = cache

    @property
    def bank(self) -> SourceBank:
        """The source bank (`register_source` replaces it with the updated one)."""
        return self._sources.bank

    @bank.setter
    def bank(self, bank: SourceBank) -> None:
        self._sources.bank = bank

    # Sources.
    def register_source(self, index: int, k: Sequence[jax.Array], v: Sequence[jax.Array]) -> None:
        """Register (or replace) source `index` (`Sources.register`)."""
        self._sources.register(index, k, v)

    def remove_source(self, index: int) -> None:
        """Forget source `index` (`Sources.remove`)."""
        self._sources.remove(index)

    def source_length(self, index: int) -> int | None:
        return self._source_lengths.get(index)

    def readers(self, index: int) -> int:
        """Live requests reading source `index` (offloaded ones included)."""
        return self._readers[index]

    # Host copies.
    def is_offloaded(self, request_id: str) -> bool:
        return self._host.is_offloaded(request_id)

    def offload(self, request_id: str) -> int:
        """Copy the request's slot to host memory and free the slot; return the device bytes reclaimed."""
        self._columns = self._committed = None
        return self._host.offload(request_id)

    def reload(self, request_id: str) -> bool:
        """Bring an offloaded request back into a free slot, bit-exactly; False while none is free."""
        self._columns = self._committed = None
        return self._host.reload(request_id)

    def cache_lost(self) -> bool:
        """True when a buffer of the device cache is gone (donated to a step that then failed)."""
        return self._host.cache_lost()

    def snapshot(self) -> BoundedKVSnapshot:
        """Copy the cache and every request's record to host memory (between steps)."""
        return self._host.snapshot()

    def recover(self, snapshot: BoundedKVSnapshot | None = None, restore: Collection[str] = ()) -> list[str]:
        """Rebuild the device cache after a fault lost it; return the requests it lost (`HostCopies`)."""
        self._claims, self._columns, self._committed = [], None, None
        return self._host.recover(snapshot, restore)

    # Introspection.
    @property
    def padding_slot(self) -> int:
        """The slot padding rows name: each data shard's last local slot (`max_slots` on one shard)."""
        return self._slots.per_shard

    @property
    def free_slots(self) -> int:
        return len(self._slots)

    @property
    def data_shards(self) -> int:
        return self._slots.shards

    @property
    def local_data_shards(self) -> tuple[int, ...]:
        """The data shards this manager admits into (every one, unless a process serves only some)."""
        return self._slots.local_shards

    def shard_of(self, request_id: str) -> int | None:
        """The data shard holding the request's slot (None while it holds none)."""
        slot = self.slot_of(request_id)
        return None if slot is None else self._slots.shard_of(slot)

    def placement(self, request_ids: Sequence[str]) -> dict[str, int]:
        """The data shard each request would run on if a step of them were admitted now: its slot's,
        or, for those without one (new or offloaded), where admission would place them, in order.
        Requests beyond the free slots are left out (admission would refuse them)."""
        placed = {rid: self.shard_of(rid) for rid in request_ids}
        waiting = [rid for rid, shard in placed.items() if shard is None]
        placed.update(zip(waiting, self._slots.preview(len(waiting)), strict=False))
        return {rid: shard for rid, shard in placed.items() if shard is not None}

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Every request the manager holds a record of (ingested and not removed)."""
        return tuple(self._requests)

    def slot_of(self, request_id: str) -> int | None:
        request = self._requests.get(request_id)
        return None if request is None else request.slot

    def written(self, request_id: str) -> int:
        """Entries the request has committed."""
        return self._requests[request_id].written

    def truncate(self, request_id: str, written: int) -> None:
        """Count `written` entries for a request whose steps committed more than they wrote: a decode
        block masks what a row writes after its stop token (`serving/steps.py`), which the host learns
        when it reads the block back. Its next step writes at `written`; nothing it wrote before is
        touched.

        Raises:
          UnknownRequestError: `request_id` was never ingested (or was removed).
          ValueError: `written` is not an int in [0, entries committed], or a step of it is admitted.
        """
        request = self._requests.get(request_id)
        if request is None:
            key = self.spec.resource_key
            raise UnknownRequestError(f"request_id={request_id!r} is not a request of cache {key!r}")
        check_int("written", written, minimum=0, maximum=request.written)
        if request.admitted is not None:
            raise ValueError(f"request {request_id!r} has a step admitted; truncate it between steps")
        self._columns = self._committed = None  # the persistent batch holds its old position
        request.written = written

    # Request lifecycle.
    def ingest_request(self, request_id: str, req_config: ResourceReqConfig | None = None) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id={request_id!r} must be a str")
        if request_id.startswith(PAD):  # a padding row's: its steps would plan empty and write nothing
            raise ValueError(f"request_id={request_id!r} must not start with {PAD!r}, padding rows' prefix")
        if req_config is not None:
            if not isinstance(req_config, ResourceReqConfig):
                raise TypeError(f"req_config={req_config!r} must be a ResourceReqConfig or None")
            req_config.validate(self.spec)
        self._requests.setdefault(request_id, RequestRecord())

    def remove_request(self, request_id: str) -> None:
        self._columns = self._committed = None
        self._settle((request_id,))
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.slot is not None:
            self._slots.give(request.slot)
        if request.source_len:
            self._readers[request.source] -= 1

    def reset_request(self, request_id: str, free: bool = False) -> None:
        check_bool("free", free)
        self._columns = self._committed = None
        if free:
            self.remove_request(request_id)
        elif request_id in self._requests:
            self._requests[request_id].written = 0
            self._requests[request_id].admitted = None

    # Step lifecycle.
    @staticmethod
    def _is_padding(request_id: str, ctx: StepContext) -> bool:
        # A capture step only traces shapes: it claims nothing, so every row plans as bucket filler.
        return ctx.capture or ctx.is_padding_row(request_id)

    def admit(self, step: ResourceStep, ctx: StepContext | None = None) -> AdmitOutcome:
        """Check every segment, then claim slots for first-time requests, all or nothing.

        Every check runs before anything is claimed, so a refusal (or a bad step type) changes nothing.
        """
        step = _as_bounded_step(step)
        ctx = ctx or StepContext.for_step(step)
        if ctx.capture:
            return ADMIT_OK
        self._columns = None
        columns = cols.gather(step, ctx, self._requests, self._committed)
        if columns is not None and cols.admissible(
            columns, ctx, config=self.config, num_sources=self.bank.num_sources,
            source_lengths=self._source_lengths,
        ):  # fmt: skip
            need_slot, sources = cols.unclaimed(columns)
        else:  # row by row: the first row refused says why
            columns, sources, (refusal, need_slot) = None, None, check_rows(
                step, ctx, padding=self._is_padding, config=self.config, requests=self._requests,
                num_sources=self.bank.num_sources, source_lengths=self._source_lengths,
            )  # fmt: skip
            if refusal is not None:
                return refusal
        refusal = planning.shard_overflow(
            step, ctx, need_slot, slots=self._slots, requests=self._requests, padding=self._is_padding
        ) or claim_slots(
            need_slot, step, slots=self._slots, requests=self._requests, readers=self._readers,
            config=self.config, sources=sources,
        )  # fmt: skip
        if refusal is not None:
            return refusal
        if columns is None:  # admitted row by row: each request's values as ints
            for seg in step.segments or ():
                if not self._is_padding(seg.request_id, ctx):
                    pos = StreamPosition(*map(int, step.positions[seg.request_id]))
                    self._requests[seg.request_id].admitted = (pos, int(seg.span))
        else:  # each row's admission is its row of the columns (`StepColumns.admitted`)
            for record in columns.records:
                record.admitted = columns
        self._claims, self._columns = [*self._claims, *need_slot], columns
        return ADMIT_OK

    def plan_rows(self, step: ResourceStep, ctx: StepContext | None = None) -> tuple[int, dict[str, int]]:
        """The plan table's row count and each real request's row.

        On one data shard, row `i` is segment `i`, padded to the bucket's rows. Over several, the table is
        shard-major: shard `d` owns rows `[d * b, (d + 1) * b)`, `b` the bucket's rows per shard (or the
        most any shard has), its requests in segment order, then its padding rows.

        Raises:
          ValueError: a data shard has more of the step's requests than the bucket's rows per shard.
        """
        step = _as_bounded_step(step)
        ctx = ctx or StepContext.for_step(step)
        real = [seg.request_id for seg in step.segments or () if not self._is_padding(seg.request_id, ctx)]
        return self._table_rows(step, ctx, real)

    def _table_rows(self, step: BoundedKVStep, ctx: StepContext, real: list[str]) -> tuple[int, dict]:
        lease = ctx.slot_lease
        bucket_rows = lease.bucket.bs if lease is not None and lease.bucket is not None else None
        return planning.table_rows(
            step.segments or (), real, bucket_rows, slots=self._slots, requests=self._requests,
            groups=ctx.row_groups,
        )  # fmt: skip

    def plan(self, step: ResourceStep, ctx: StepContext | None = None) -> BoundedKVPlan:
        """The plan table for `step`'s requests, laid out by `plan_rows` (padding rows plan empty, on
        each shard's padding slot); slots are local to each request's data shard. Its `num_tokens` is
        the width `attend` requires of the step's arrays (`planning.plan`)."""
        step = _as_bounded_step(step)
        ctx = ctx or StepContext.for_step(step)
        columns = self._columns_of(step)
        bucket = None if ctx.slot_lease is None else ctx.slot_lease.bucket
        if columns is None:
            real = admitted_segments(step, ctx, "plan", requests=self._requests, padding=self._is_padding)
            rows, row_of = self._table_rows(step, ctx, [seg.request_id for seg in real])
            return planning.plan(
                step, real, rows, row_of, bucket, requests=self._requests, slots=self._slots,
                padding_slot=self.padding_slot, config=self.config,
            )  # fmt: skip
        # Admitted as columns, nothing changed since: every row holds its slot.
        return planning.plan_columns(
            step, columns, self._fields_of(columns), bucket, groups=ctx.row_groups, requests=self._requests,
            slots=self._slots, padding_slot=self.padding_slot, config=self.config,
        )  # fmt: skip

    def _fields_of(self, columns: cols.StepColumns) -> dict[str, np.ndarray]:
        """The admitted columns' plan fields that stay while a request holds its slot (`CommittedRows`)."""
        if columns.committed is not None:
            return columns.committed.fields
        if self._fields is None or self._fields[0] is not columns:
            self._fields = columns, planning.slot_fields(columns.records, self._slots)
        return self._fields[1]

    def _columns_of(self, step: BoundedKVStep) -> cols.StepColumns | None:
        """The columns admit read of `step` itself, while no record changed since (else None)."""
        columns = self._columns
        return columns if columns is not None and columns.step is step else None

    def commit(self, step: ResourceStep, ctx: StepContext | None = None) -> None:
        """Record that the step ran: each request's `written` becomes its declared position plus span.

        Raises:
          StepNotAdmittedError: a row does not match its request's admitted step; nothing is committed.
          UnknownRequestError: a row names a request that was never ingested.
        """
        step = _as_bounded_step(step)
        ctx = ctx or StepContext.for_step(step)
        if ctx.capture:
            return
        columns = self._columns_of(step)
        if columns is not None:  # the step admit accepted: every row's admission is its own
            self._commit_columns(columns)
            return
        segments = admitted_segments(step, ctx, "commit", requests=self._requests, padding=self._is_padding)
        for seg in segments:
            request = self._requests[seg.request_id]
            position, span = cols.pending(seg.request_id, request)
            if position.written == 0:  # its first step: count where it runs
                self.placed[self._slots.shard_of(request.slot)] += 1
            request.written = position.written + span
            request.admitted = None
        self._settle(seg.request_id for seg in segments)
        self._columns, self._committed = None, None

    def _commit_columns(self, columns: cols.StepColumns) -> None:
        """Commit a step admitted as columns; its rows become the persistent batch."""
        for shard in cols.first_steps(columns, self._slots):  # count where first steps run
            self.placed[shard] += 1
        self._committed = cols.commit(columns, self._fields_of(columns))
        self._settle(seg.request_id for seg in columns.segments)
        self._columns, self._fields = None, None

    def abort_step(self, step: ResourceStep, ctx: StepContext | None = None) -> None:
        """Forget the step's admission; return the slots it (not another step) claimed for requests
        that have written nothing. A capture step's abort changes nothing (its admit claimed nothing)."""
        if ctx is not None and ctx.capture:
            return
        self._columns = self._committed = None
        rids = {seg.request_id for seg in step.segments or ()}
        for rid in rids & self._requests.keys():
            self._requests[rid].admitted = None
        for rid in [rid for rid in self._claims if rid in rids]:  # in claim order: slots' order
            request = self._requests.get(rid)
            if request is not None and request.slot is not None and request.written == 0:
                self.remove_request(rid)  # its slot and its source's reader back
                self._requests[rid] = RequestRecord()
        self._settle(rids)

    def _settle(self, request_ids: Iterable[str]) -> None:
        """Forget the claims of `request_ids` (their steps ended, or they did), not another step's."""
        if self._claims:
            settled = set(request_ids)
            self._claims = [rid for rid in self._claims if rid not in settled]

    def cleanup(self) -> None:
        self._claims, self._columns, self._committed = [], None, None
        self._requests.clear()
        self._readers.clear()
        self._slots.reset()


def _as_bounded_step(step: ResourceStep) -> BoundedKVStep:
    if not isinstance(step, BoundedKVStep):
        raise TypeError(f"the bounded KV cache takes a BoundedKVStep, got {type(step).__name__}")
    return step
