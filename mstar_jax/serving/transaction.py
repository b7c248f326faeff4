"""One step transaction, the same for every model.

A step of real rows is declared on the bounded caches of one graph node, padded to its bucket
(`declare`), admitted by the node's `ResourceRunner`, planned, its captured program replayed on the
donated caches, and committed (`run_admitted`). An error anywhere after admission aborts the step, so
nothing it claimed is left behind; the caches are installed and the step committed only once the program
returned them:

    declared = declare(keys, step, bucket)                # pad_step, one SubmoduleStep for every key
    outcome = admit(runner, declared)                     # refused: nothing claimed
    outputs = run_admitted(runner, declared, replay)      # plan -> replay -> install caches -> commit

`replay(Resources) -> (caches, outputs)` is the model's part: it runs the bucket's program on the
resources' caches (in `keys` order, donated), banks and plans and returns the new caches in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.kv.bounded.padding import PaddedStep, pad_step
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey, FullAdmitOutcome, SubmoduleStep

__all__ = ["Declared", "Resources", "abort", "admit", "declare", "run_admitted"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Declared:
    """A step declared on a node's bounded caches, padded to its bucket.

    Attributes:
      keys: the resource keys the step runs on, in the order `Resources` holds them.
      padded: the padded step (`pad_step`): its rows, bucket and where each request's row is.
      sub: the runner's step, one `BoundedKVStep` per key, with the padded step's context.
    """

    keys: tuple[str, ...]
    padded: PaddedStep
    sub: SubmoduleStep

    @property
    def bucket(self) -> BucketKey:
        return self.padded.bucket


@dataclasses.dataclass(frozen=True, slots=True)
class Resources:
    """What a replay reads, one entry per key of the step in `Declared.keys` order: each cache (to be
    donated), its source bank, and the plan the cache made of the step (`BoundedKVPlan`)."""

    caches: tuple[Any, ...]
    banks: tuple[Any, ...]
    plans: tuple[Any, ...]


def declare(
    keys: Sequence[str],
    step: BoundedKVStep,
    bucket: BucketKey,
    *,
    groups: Sequence[tuple[int, int]] | None = None,
    pad: bool = True,
) -> Declared:
    """`step` (its real rows only) padded to `bucket` and declared on every cache of `keys`.

    Args:
      keys: the caches the step runs on (a model with several caches, e.g. local and global layers,
        declares the same rows on each).
      step: the real rows, in the order the caller's arrays hold them.
      bucket: the bucket the step runs in.
      groups, pad: as `pad_step` takes them.

    Raises:
      ValueError: no keys, or as `pad_step` raises.
    """
    keys = tuple(keys)
    if not keys:
        raise ValueError("keys=() must name at least one cache the step runs on")
    padded = pad_step(step, bucket, groups=groups, pad=pad)
    sub = SubmoduleStep(dict.fromkeys(keys, padded.step))
    sub.set_ctx(padded.ctx)
    return Declared(keys=keys, padded=padded, sub=sub)


def admit(runner: ResourceRunner, declared: Declared) -> FullAdmitOutcome:
    """Admit the step; when it is admitted but not ready, abort it again, so a step that will not run
    holds nothing. Run it (`run_admitted`) only when the outcome is `ok` and `ready`."""
    outcome = runner.admit(declared.sub)
    if outcome.ok and not outcome.ready:
        runner.abort_step(declared.sub)
    return outcome


def run_admitted(
    runner: ResourceRunner,
    declared: Declared,
    replay: Callable[[Resources], tuple[Sequence[Any], Any]],
) -> Any:
    """Plan an admitted step, replay it, install the caches it returns and commit; return its outputs.

    Raises:
      whatever planning or `replay` raises, after aborting the step's admission (the donated caches are
      then gone with the error: the caller's recovery rebuilds them).
    """
    sub = declared.sub
    try:
        plans = runner.plan(sub)
        managers = [runner[key] for key in declared.keys]
        resources = Resources(
            caches=tuple(m.cache for m in managers),
            banks=tuple(m.bank for m in managers),
            plans=tuple(plans[key] for key in declared.keys),
        )
        caches, outputs = replay(resources)
        if len(caches) != len(managers):
            raise ValueError(
                f"replay returned {len(caches)} caches; the step runs on {len(managers)} ({declared.keys})"
            )
    except BaseException as err:
        abort(runner, sub, err)
        raise
    for manager, cache in zip(managers, caches, strict=True):
        manager.cache = cache
    runner.commit(sub)
    return outputs


def abort(runner: ResourceRunner, sub: SubmoduleStep, err: BaseException) -> None:
    """Abort `sub`'s admission after the step raised `err`; should aborting raise too, `err` stays the
    error (what a recovery, and the requests' messages, are about) with the other noted on it."""
    try:
        runner.abort_step(sub)
    except Exception as abort_error:
        err.add_note(f"aborting the step's admission raised too: {abort_error!r}")
