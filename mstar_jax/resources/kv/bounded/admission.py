"""Admission checks of the bounded KV cache: every field of one row, before anything is claimed.

`check_segment` answers whether a row may run, from the manager's records, config and source lengths,
and changes nothing; `claim_slots` then claims the slots of the step's first-time requests, all or none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mstar_jax.checks import is_int
from mstar_jax.resources.kv.bounded.columns import MAX_POSITION, pending
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVStep, StreamPosition
from mstar_jax.resources.step import (
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    RequestOffloading,
    Segment,
    StepContext,
    StepNotAdmittedError,
    UnknownRequestError,
)

__all__ = [
    "admitted_segments", "check_rows", "check_segment", "claim_slots", "real_segments", "refuse",
    "step_tokens_of",
]  # fmt: skip


def refuse(reason) -> AdmitOutcome:
    """The outcome of a refusal: terminal for an `AdmitRuntimeError`, retryable otherwise."""
    return (
        AdmitOutcome(False, False, reason)
        if isinstance(reason, AdmitRuntimeError)
        else AdmitOutcome(False, True, reason)
    )


def claim_slots(
    need_slot: Sequence[str],
    step: BoundedKVStep,
    *,
    slots: Any,
    requests: Mapping[str, Any],
    readers: Counter,
    config: BoundedKVConfig,
    sources: tuple[Sequence[int], Sequence[int]] | None = None,
) -> AdmitOutcome | None:
    """Claim a slot for each request of `need_slot` (first-time requests of an admissible `step`), with
    its source and retention, and count it among its source's readers; or, when the free slots are too
    few, claim nothing and return the refusal (`AllocationFailed`, naming the first request left out).

    Args:
      slots: the manager's `SlotPools` (each claim takes from the least loaded data shard).
      requests, readers: the manager's request records and each source's reader count, updated in place.
      sources: each of `need_slot`'s `(source_len, source)` as two lists of ints, where the caller holds
        them as columns already; default: read from `step.positions`.
    """
    free = len(slots)
    if len(need_slot) > free:
        rid = need_slot[free]
        label = next(seg.label for seg in step.segments if seg.request_id == rid)
        return refuse(AllocationFailed(
            f"bounded KV is full: {config.max_slots} slots, {free} free, {len(need_slot)} needed",
            pages_short=len(need_slot) - free, label=label, request_id=rid,
        ))  # fmt: skip
    if sources is None:
        positions = [step.positions[rid] for rid in need_slot]
        sources = [int(p.source_len) for p in positions], [int(p.source) for p in positions]
    lengths, indices = sources
    # One policy per distinct source length: a crowd of first steps shares a few voices.
    policies = {length: config.retention_for(length) for length in set(lengths)}
    # Nothing below can fail: every claim is made, or (above) none is.
    for rid, source_len, source in zip(need_slot, lengths, indices, strict=True):
        request = requests[rid]
        request.slot = slots.take()
        request.source, request.source_len, request.policy = source, source_len, policies[source_len]
        if source_len > 0:  # a request with no source prefix holds no claim on the bank
            readers[source] += 1
    return None


def step_tokens_of(step: BoundedKVStep, seg: Segment) -> int:
    """The tokens the row brings: its declared `step_tokens`, else `max(span, 1)` (a span that is not an
    int is itself, for `check_segment` to refuse)."""
    span = seg.span
    return step.step_tokens.get(seg.request_id, max(span, 1) if is_int(span, numpy=True) else span)


def check_segment(
    seg: Segment,
    pos: StreamPosition | None,
    step_tokens: int,
    ctx: StepContext,
    *,
    config: BoundedKVConfig,
    requests: Mapping[str, Any],
    num_sources: int,
    source_lengths: Mapping[int, int],
    steps: int = 1,
) -> AdmitRuntimeError | RequestOffloading | None:
    """Why one row of a step may not run (None: it may), as `BoundedKVManager.admit` checks it.

    Args:
      seg, pos, step_tokens, ctx: the row, its declared position and tokens, the step's context.
      config: the cache's config.
      requests: the manager's request records.
      num_sources: sources the bank holds.
      source_lengths: the registered sources' lengths.
      steps: the step's `BoundedKVStep.steps` (a block of that many one-token steps: a row takes at
        most one token a step).
    """
    rid, cfg = seg.request_id, config
    request = requests.get(rid)
    if request is None:
        return AdmitRuntimeError(
            f"bounded KV: request {rid!r} was never ingested (call ingest_request first)"
        )
    if request.host_copy is not None:
        return RequestOffloading(f"bounded KV: {rid!r} is offloaded to host memory", seg.label, rid)
    if pos is None:
        return AdmitRuntimeError(f"bounded KV step declares no position for {rid!r}")
    for field, value in zip(StreamPosition._fields, pos, strict=True):
        if not is_int(value, numpy=True) or value < 0:
            return AdmitRuntimeError(f"{rid!r} declares {field}={value!r}; it must be an int >= 0")
    for field, value in (("span", seg.span), ("step tokens", step_tokens)):
        if not is_int(value, numpy=True):
            return AdmitRuntimeError(f"{rid!r} declares {field}={value!r}; it must be an int")
    if not cfg.min_source_len <= pos.source_len <= cfg.max_source_len:
        return AdmitRuntimeError(
            f"{rid!r} has a {pos.source_len}-token source; the slots hold sources of "
            f"[{cfg.min_source_len}, {cfg.max_source_len}] tokens"
        )
    if not 0 <= pos.source < num_sources:
        return AdmitRuntimeError(
            f"{rid!r} declares source={pos.source!r}; sources are indexed [0, {num_sources})"
        )
    if pos.source_len > 0:
        length = source_lengths.get(pos.source)
        if length is None:
            return AdmitRuntimeError(
                f"{rid!r} reads source {pos.source}, which is not registered; "
                f"registered: {sorted(source_lengths)}"
            )
        if pos.source_len > length:
            return AdmitRuntimeError(
                f"{rid!r} reads {pos.source_len} tokens of source {pos.source}, which holds {length}"
            )
    if request.source_len is not None and (pos.source, pos.source_len) != (
        request.source,
        request.source_len,
    ):
        return AdmitRuntimeError(
            f"{rid!r} declares source {pos.source} of length {pos.source_len}, but its stream started on "
            f"source {request.source} of length {request.source_len}"
        )
    if pos.written != request.written:
        return AdmitRuntimeError(
            f"{rid!r} declares {pos.written} written tokens; {request.written} were committed "
            "(positions must continue from the last committed step)"
        )
    if step_tokens < 1:
        return AdmitRuntimeError(f"{rid!r}: step tokens={step_tokens} must be >= 1")
    if not 0 <= seg.span <= step_tokens:
        return AdmitRuntimeError(f"{rid!r}: span={seg.span} must be in [0, step tokens={step_tokens}]")
    if steps > 1 and seg.span > steps:
        return AdmitRuntimeError(
            f"{rid!r}: span={seg.span} must be <= steps={steps}: a block's row writes one token a step"
        )
    if int(pos.source_len) + int(pos.written) + int(step_tokens) > MAX_POSITION:  # NumPy ints wrap
        return AdmitRuntimeError(
            f"{rid!r}: source_len={pos.source_len} + written={pos.written} + step tokens={step_tokens} "
            f"must be <= {MAX_POSITION}: the plan's positions are int32"
        )
    lease = ctx.slot_lease
    if lease is not None and lease.bucket is not None and step_tokens > lease.bucket.num_tokens:
        return AdmitRuntimeError(
            f"{rid!r} brings {step_tokens} tokens; bucket {lease.bucket} holds "
            f"{lease.bucket.num_tokens} per row"
        )
    return None


def check_rows(
    step: BoundedKVStep,
    ctx: StepContext,
    *,
    padding: Callable[[str, StepContext], bool],
    config: BoundedKVConfig,
    requests: Mapping[str, Any],
    num_sources: int,
    source_lengths: Mapping[int, int],
) -> tuple[AdmitOutcome | None, list[str]]:
    """`check_segment` row by row over the step's real rows (those `padding` leaves): the refusal of the
    first row refused (None: none is), and the rows whose requests need a slot."""
    need_slot: list[str] = []
    seen: set[str] = set()
    for seg in step.segments or ():
        if padding(seg.request_id, ctx):
            continue
        if seg.request_id in seen:  # two rows would share one slot and one write range
            return refuse(AdmitRuntimeError(
                f"bounded KV step declares {seg.request_id!r} twice; a request adds one segment per step"
            )), need_slot  # fmt: skip
        reason = check_segment(
            seg, step.positions.get(seg.request_id), step_tokens_of(step, seg), ctx, config=config,
            requests=requests, num_sources=num_sources, source_lengths=source_lengths, steps=step.steps,
        )  # fmt: skip
        if reason is not None:
            return refuse(reason), need_slot
        seen.add(seg.request_id)
        if requests[seg.request_id].slot is None:
            need_slot.append(seg.request_id)
    return None, need_slot


def real_segments(
    step: BoundedKVStep,
    ctx: StepContext,
    call: str,
    *,
    requests: Mapping[str, Any],
    padding: Callable[[str, StepContext], bool],
) -> list[Segment]:
    """The step's real segments (those `padding` leaves) for a `call` after admit (plan or commit);
    raises unless each request was ingested and holds a slot."""
    real = [seg for seg in step.segments or () if not padding(seg.request_id, ctx)]
    for seg in real:
        request = requests.get(seg.request_id)
        if request is None:
            raise UnknownRequestError(
                f"bounded KV {call}: request {seg.request_id!r} was never ingested (or was removed)"
            )
        if request.slot is None or seg.request_id not in step.positions:
            raise StepNotAdmittedError(
                f"bounded KV {call}: {seg.request_id!r} holds no slot or declares no position; "
                f"{call} only a step admit accepted"
            )
    return real


def admitted_segments(
    step: BoundedKVStep,
    ctx: StepContext,
    call: str,
    *,
    requests: Mapping[str, Any],
    padding: Callable[[str, StepContext], bool],
) -> list[Segment]:
    """The step's real segments for a `call` after admit (plan or commit), each matching its request's
    pending admission; raises otherwise (a plan of a step admit never accepted could read entries its
    request did not write)."""
    real = real_segments(step, ctx, call, requests=requests, padding=padding)
    for seg in real:
        pos, accepted = step.positions[seg.request_id], pending(seg.request_id, requests[seg.request_id])
        if accepted is None or (tuple(pos), seg.span) != (tuple(accepted[0]), accepted[1]):
            admitted = "no step" if accepted is None else _describe(*accepted)
            raise StepNotAdmittedError(
                f"bounded KV {call}: {seg.request_id!r} declares {_describe(pos, seg.span)}, but "
                f"admit accepted {admitted} (or it was committed or aborted since); {call} only the "
                "step admit accepted"
            )
    return real


def _describe(pos: StreamPosition, span: int) -> str:
    return f"(source={pos.source}, source_len={pos.source_len}, written={pos.written}, span={span})"
