"""The step envelope: what each engine step declares per resource, and how admission answers.

A step is declared once per batch: for every resource, the `Segment`s each request adds to its
stream. Resources admit it (`AdmitOutcome`), plan it and commit it. Steps are frozen dataclasses
registered as pytrees whose leaves are the per-step numbers (spans, positions): they pass through
`jax.jit` as data, so a new position or span does not retrace. Request ids and labels are part of
the tree's structure (a new set of requests retraces), which is why compiled serving code takes the
plans resources make (arrays) rather than steps.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, KeysView, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from mstar_jax.checks import check_int

__all__ = [
    "ADMIT_OK",
    "FULL_ADMIT_NOT_READY",
    "FULL_ADMIT_OK",
    "PAD",
    "AdmitFailedReason",
    "AdmitOutcome",
    "AdmitRuntimeError",
    "AllocationFailed",
    "BucketKey",
    "FullAdmitOutcome",
    "RequestOffloading",
    "ResourceStep",
    "Segment",
    "SlotLease",
    "StepContext",
    "StepNotAdmittedError",
    "SubmoduleStep",
    "UnknownRequestError",
]

PAD = "\x00pad"
"""Prefix of the ids of padding rows (which fill a bucket and read and write nothing); no request id may
start with it."""


@dataclasses.dataclass(frozen=True)
class AdmitFailedReason:
    """Why a resource refused a step."""

    message: str


@dataclasses.dataclass(frozen=True)
class AllocationFailed(AdmitFailedReason):
    """Capacity ran out. The caller evicts or waits, then retries."""

    pages_short: int
    label: str
    request_id: str


@dataclasses.dataclass(frozen=True)
class RequestOffloading(AdmitFailedReason):
    """The request's state is moving to host memory; retry once it is back.

    Distinct from `AllocationFailed` because the answer is different: nothing needs evicting, the
    caller just re-drives the step once `reload` has run.
    """

    label: str
    request_id: str


@dataclasses.dataclass(frozen=True)
class AdmitRuntimeError(AdmitFailedReason):
    """A resource cannot serve this request at all.

    Terminal, unlike the two above: no eviction and no reload makes it go away, so the caller's
    answer is to fail the request, not to retry it.
    """


class StepNotAdmittedError(ValueError):
    """`plan` or `commit` of a step no successful `admit` accepted (or one that differs from it).

    Refused because such a commit would advance a request over entries it never wrote, and its next
    step would read what a slot's previous owner left there.
    """


class UnknownRequestError(ValueError):
    """A call names a request that was never ingested or submitted (or has already left)."""


class AdmitOutcome(NamedTuple):
    """A resource's answer to `admit`: refused (`ok=False`), waiting (`ready=False`) or go."""

    ok: bool
    ready: bool = True
    reason: AdmitFailedReason | None = None


ADMIT_OK = AdmitOutcome(True, True, None)


class FullAdmitOutcome(NamedTuple):
    """What the runner answers with: one resource's outcome, plus which resource gave it.

    A resource doesn't know the key it is registered under, so the runner, which does, names it on
    the way out. The caller needs it to scope an eviction to the resource that actually ran out.
    """

    outcome: AdmitOutcome
    failed_resource: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome.ok

    @property
    def ready(self) -> bool:
        return self.outcome.ready

    @property
    def reason(self) -> AdmitFailedReason | None:
        return self.outcome.reason


FULL_ADMIT_OK = FullAdmitOutcome(ADMIT_OK)
FULL_ADMIT_NOT_READY = FullAdmitOutcome(AdmitOutcome(True, False, None))


class Segment(NamedTuple):
    """One step's addition to a request's cache stream.

    A request contributes one segment per label active for it in a step; the batch's ordered segment
    list defines the layout of per-token arrays. `span` may be 0: a zero-span segment reads its
    stream without extending it (admission reserves nothing, commit is a no-op).

    A NamedTuple, not a frozen dataclass: one is built per request per step, and the frozen
    dataclass's `object.__setattr__`-per-field `__init__` is the expensive way to do that.
    """

    request_id: str
    label: str
    span: int


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Names one compiled program: a graph walk at a padded batch size and token count."""

    graph_walk: str
    bs: int
    num_tokens: int
    cg_key_info: Any | None = None

    def __post_init__(self):
        for name in ("bs", "num_tokens"):
            check_int(f"BucketKey.{name}", getattr(self, name), minimum=1)
        try:
            hash(self.cg_key_info)  # a key that cannot be hashed cannot name a compiled program
        except TypeError:
            raise TypeError(f"BucketKey.cg_key_info={self.cg_key_info!r} must be hashable") from None

    def __str__(self) -> str:
        key = "" if self.cg_key_info is None else f",key={self.cg_key_info}"
        return f"{self.graph_walk}[bs={self.bs},tokens={self.num_tokens}{key}]"


@dataclasses.dataclass(frozen=True)
class SlotLease:
    """The double-buffer slot and the compiled bucket a step plans into and replays (None: eager)."""

    slot: int
    bucket: BucketKey | None


@dataclasses.dataclass(frozen=True)
class ResourceStep:
    """One resource's work for one step: the segments it admits, plans and commits."""

    segments: tuple[Segment, ...] | None = None

    def __post_init__(self):
        if self.segments is None:
            return
        if isinstance(self.segments, str) or not isinstance(self.segments, Iterable):
            raise TypeError(
                f"segments={self.segments!r} must be a sequence of Segment(request_id, label, span)"
            )
        if not isinstance(self.segments, tuple):
            object.__setattr__(self, "segments", tuple(self.segments))
        if not all(map(isinstance, self.segments, itertools.repeat(Segment))):
            i, seg = next((i, s) for i, s in enumerate(self.segments) if not isinstance(s, Segment))
            # A plain tuple has no `request_id` for admit to read.
            raise TypeError(f"segments[{i}]={seg!r} must be a Segment(request_id, label, span)")

    def request_ids(self) -> tuple[str, ...]:
        """Request ids of the segments, in batch order (empty when none are set)."""
        return tuple(seg.request_id for seg in self.segments or ())


def _flatten_segments(segments: tuple[Segment, ...] | None):
    if segments is None:
        return (), None
    return tuple(seg.span for seg in segments), tuple((seg.request_id, seg.label) for seg in segments)


def _unflatten_segments(names, spans) -> tuple[Segment, ...] | None:
    if names is None:
        return None
    return tuple(Segment(rid, label, span) for (rid, label), span in zip(names, spans, strict=True))


def register_step_pytree(cls: type, data_mappings: Sequence[str] = ()) -> type:
    """Register a `ResourceStep` subclass as a pytree whose leaves are numbers.

    Spans become leaves; request ids and labels are static. Each field named in `data_mappings` is a
    `Mapping[str, int | NamedTuple-of-ints]` whose values become leaves under static keys. Any other field is
    static and must be hashable. Unflattening skips `__post_init__`: under `jit` the leaves are tracers.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    static = [n for n in names if n != "segments" and n not in data_mappings]

    def flatten(step):
        spans, seg_names = _flatten_segments(step.segments)
        children, mapping_meta = [spans], []
        for name in data_mappings:
            mapping = getattr(step, name)
            keys = tuple(sorted(mapping))  # one treedef whatever the insertion order
            values = tuple(mapping[key] for key in keys)
            children.append(values)
            value_type = type(values[0]) if values and isinstance(values[0], tuple) else None
            mapping_meta.append((keys, value_type))
        aux = (seg_names, tuple(mapping_meta), tuple(getattr(step, n) for n in static))
        return children, aux

    def unflatten(aux, children):
        seg_names, mapping_meta, static_values = aux
        step = object.__new__(cls)
        object.__setattr__(step, "segments", _unflatten_segments(seg_names, children[0]))
        for name, (keys, value_type), values in zip(data_mappings, mapping_meta, children[1:], strict=True):
            values = [value_type(*v) if value_type else v for v in values]
            object.__setattr__(step, name, dict(zip(keys, values, strict=True)))
        for name, value in zip(static, static_values, strict=True):
            object.__setattr__(step, name, value)
        return step

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


register_step_pytree(ResourceStep)


_NO_PADDING: frozenset[str] = frozenset()


@dataclasses.dataclass(eq=False)
class StepContext:
    """Engine-owned state of one step, shared by every resource's admit, plan and commit.

    Only the engine writes it. `plan_results` carries each resource's plan to its dependents.
    Reassigning `request_ids` to different ids drops the padded list (a stale padding would name a
    request that left); reassigning the same ids keeps it.
    """

    request_ids: Sequence[str]
    graph_walk: str
    slot: int
    capture: bool
    is_preplan: bool = False
    plan_results: dict[str, Any] = dataclasses.field(default_factory=dict)
    slot_lease: SlotLease | None = None
    piecewise_leases: Mapping[str, SlotLease] = dataclasses.field(default_factory=dict)
    _padded_request_ids: Sequence[str] | None = None
    row_groups: tuple[tuple[int, int], ...] | None = None
    """The bucket's row groups in order, each (the step's rows in it, the bucket's rows for it), e.g. a
    combined bucket's decode rows then its prefill rows (`pad_step`); None: one group."""

    def __setattr__(self, name, value):
        if name == "request_ids":
            value = tuple(value)  # a tuple, so the ids cannot change behind the padded list's back
            if value != getattr(self, "request_ids", value):
                object.__setattr__(self, "_padded_request_ids", None)
        if name in ("request_ids", "_padded_request_ids"):
            object.__setattr__(self, "_padding", None)
        object.__setattr__(self, name, value)

    @classmethod
    def leased(
        cls,
        request_ids: Sequence[str],
        bucket: BucketKey,
        *,
        padded: Sequence[str] | None = None,
        row_groups: tuple[tuple[int, int], ...] | None = None,
    ) -> StepContext:
        """The context of a step of the real rows `request_ids` leased to `bucket` (its walk, double-buffer
        slot 0), with its padded row list (the real rows, then the padding) and row groups: what
        `pad_step` makes every step. Equal to constructing it field by field, without running
        `__setattr__` for each field (the ids are a tuple and the padded list starts with them here)."""
        request_ids = tuple(request_ids)
        if padded is not None and tuple(padded[: len(request_ids)]) != request_ids:
            raise ValueError(
                f"padded={list(padded)!r} must start with the real request_ids {list(request_ids)!r}"
            )
        ctx = object.__new__(cls)
        ctx.__dict__.update(
            request_ids=request_ids, graph_walk=bucket.graph_walk, slot=0, capture=False, is_preplan=False,
            plan_results={}, slot_lease=SlotLease(0, bucket), piecewise_leases={},
            _padded_request_ids=None if padded is None else tuple(padded), row_groups=row_groups,
            _padding=None,
        )  # fmt: skip
        return ctx

    @classmethod
    def for_step(cls, step: ResourceStep, bucket: BucketKey | None = None) -> StepContext:
        """The context of a step driven without an engine: the step's rows, padding told apart by id.

        Rows whose ids start with `PAD` are padding, the others real; with a `bucket` the step is leased
        to it (its walk, double-buffer slot 0), else it runs eagerly. Resources that take `ctx=None` use
        this.
        """
        ids = step.request_ids()
        real = [rid for rid in ids if not rid.startswith(PAD)]
        walk = "eager" if bucket is None else bucket.graph_walk
        lease = None if bucket is None else SlotLease(0, bucket)
        ctx = cls(real, walk, 0, capture=False, slot_lease=lease)
        if len(real) < len(ids):
            ctx.set_padded_rids(real + [rid for rid in ids if rid.startswith(PAD)])
        return ctx

    @property
    def padded_request_ids(self) -> Sequence[str]:
        """The rows a bucketed step runs: the real ones, then padding (the real ones when unpadded)."""
        return self.request_ids if self._padded_request_ids is None else self._padded_request_ids

    def set_padded_rids(self, padded_rids: Sequence[str] | None) -> None:
        """Set the padded row list (None resets it to the real rows)."""
        if padded_rids is not None and tuple(padded_rids[: len(self.request_ids)]) != tuple(self.request_ids):
            raise ValueError(
                f"padded_rids={list(padded_rids)!r} must start with the real request_ids "
                f"{list(self.request_ids)!r}"
            )
        self._padded_request_ids = None if padded_rids is None else tuple(padded_rids)

    def set_piecewise_leases(self, leases: Mapping[str, SlotLease]) -> None:
        self.piecewise_leases = dict(leases)

    def is_padding_row(self, request_id: str) -> bool:
        """True for a row added to fill a bucket: in the padded list but not a real request."""
        return request_id in self.padding_rows()

    def padding_rows(self) -> frozenset[str]:
        """The ids of the rows added to fill a bucket (`is_padding_row` of each)."""
        # Resources ask once per row and call: a set keeps a step's checks linear in its rows.
        padding = self._padding
        if padding is None:
            padded = self._padded_request_ids
            padding = _NO_PADDING if padded is None else frozenset(padded).difference(self.request_ids)
            object.__setattr__(self, "_padding", padding)
        return padding


@dataclasses.dataclass(frozen=True)
class SubmoduleStep:
    """Every resource's step for one node's batch, keyed by resource key.

    A `ResourceStep` whose `segments` is None inherits `segments`. `set_ctx` is the only mutation:
    the engine attaches the step's `StepContext` once it has one.
    As a pytree its leaves are the inner steps' leaves; the context is not part of the tree, so a
    step rebuilt by a tree operation has none until `set_ctx` is called again.
    """

    steps: dict[str, ResourceStep]
    segments: list[Segment] | None = None
    cg_key_info: Any | None = None
    _ctx: StepContext | None = None

    def __post_init__(self):
        if self.segments is not None:
            inherited = tuple(self.segments)
            steps = {
                key: step if step.segments is not None else dataclasses.replace(step, segments=inherited)
                for key, step in self.steps.items()
            }
            object.__setattr__(self, "steps", steps)

    @property
    def ctx(self) -> StepContext:
        if self._ctx is None:
            raise RuntimeError(
                "this SubmoduleStep has no StepContext yet; the engine calls set_ctx(ctx) first"
            )
        return self._ctx

    def set_ctx(self, ctx: StepContext) -> None:
        object.__setattr__(self, "_ctx", ctx)

    def get(self, key: str) -> ResourceStep | None:
        return self.steps.get(key)

    def keys(self) -> KeysView[str]:
        return self.steps.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.steps


def _flatten_submodule_step(step: SubmoduleStep):
    # The context is engine bookkeeping, not part of the step's structure: it stays out of the treedef.
    keys = tuple(step.steps)
    segments = None if step.segments is None else tuple(step.segments)
    return tuple(step.steps[key] for key in keys), (keys, segments, step.cg_key_info)


def _unflatten_submodule_step(aux, children) -> SubmoduleStep:
    keys, segments, cg_key_info = aux
    ctx = None
    step = object.__new__(SubmoduleStep)
    for name, value in (
        ("steps", dict(zip(keys, children, strict=True))),
        ("segments", segments),
        ("cg_key_info", cg_key_info),
        ("_ctx", ctx),
    ):
        object.__setattr__(step, name, value)
    return step


jax.tree_util.register_pytree_node(SubmoduleStep, _flatten_submodule_step, _unflatten_submodule_step)
