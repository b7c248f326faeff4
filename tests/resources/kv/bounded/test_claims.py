"""What the manager must refuse, and give back, on paths a review found open: a plan of a step admit did
not accept, a reload that fails, an abort of one of two admitted steps, arguments of the wrong kind, and
positions past int32. Each refusal leaves the bookkeeping as it was (`state`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mstar_jax.resources.kv.bounded.config import BoundedKVSpec, BoundedKVStep, PositionColumns
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import PAD, AdmitRuntimeError, Segment, StepContext, StepNotAdmittedError
from tests.resources.kv.bounded.test_manager import (
    CFG,
    _random_cache,
    admit_ok,
    declare,
    ingest,
    state,
)
from tests.resources.kv.bounded.test_manager import manager as manager  # the fixture


def test_plan_refuses_a_step_admit_did_not_accept_so_no_request_reads_a_previous_occupant(manager):
    """`new` wrote 1 entry into the slot `old` filled with 3; a plan at written=3 would read 2 of old's."""
    ingest(manager, "old", "new")
    old, ctx = declare([("old", Pos(3, 0, 0), 2)], tokens={"old": 2})
    admit_ok(manager, old, ctx)
    manager.commit(old, ctx)
    manager.remove_request("old")
    first, ctx = declare([("new", Pos(3, 0, 0), 1)])
    admit_ok(manager, first, ctx)
    manager.commit(first, ctx)
    assert manager.slot_of("new") == 0
    before = state(manager)
    for ahead in (Pos(3, 3, 0), Pos(3, 1, 0)):  # ahead of what it wrote; its next step, never admitted
        with pytest.raises(StepNotAdmittedError, match=r"KV plan: 'new' declares .* admit accepted no"):
            manager.plan(*declare([("new", ahead, 1)]))
    assert state(manager) == before
    step, ctx = declare([("new", Pos(3, 1, 0), 1)])
    admit_ok(manager, step, ctx)
    with pytest.raises(StepNotAdmittedError, match=r"accepted \(source=0, source_len=3, written=1, span=1"):
        manager.plan(*declare([("new", Pos(3, 3, 0), 1)]))
    manager.plan(*declare([("new", Pos(3, 1, 0), 1)]))  # the step admit accepted, declared again
    manager.commit(step, ctx)
    with pytest.raises(StepNotAdmittedError, match="admit accepted no step"):
        manager.plan(step, ctx)  # committed: no longer admitted


def test_a_reload_that_fails_gives_its_slot_back_and_keeps_the_request_offloaded(manager):
    ingest(manager, "a")
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1)]))
    manager.cache = _random_cache(0)
    saved = jax.device_get(manager.cache)
    manager.offload("a")
    held = manager.take_cache()  # the caller holds the cache: a reload has none to store into
    before = state(manager)
    for _ in range(2):  # each failed try used to lose one more slot
        with pytest.raises(RuntimeError, match="take_cache"):
            manager.reload("a")
        assert state(manager) == before
    assert manager.free_slots == CFG.max_slots
    assert manager.is_offloaded("a")
    manager.cache = held
    assert manager.reload("a")
    slot = manager.slot_of("a")
    for old, new in zip(saved.k + saved.v, jax.device_get(manager.cache).k + jax.device_get(manager.cache).v,
                        strict=True):  # fmt: skip
        np.testing.assert_array_equal(new[slot].view(np.uint32), old[0].view(np.uint32))
    manager.remove_request("a")
    assert manager.free_slots == CFG.max_slots


def test_aborting_one_of_two_admitted_steps_returns_its_claims_only(manager):
    ingest(manager, "x", "y")
    a, ctx_a = declare([("x", Pos(3, 0, 0), 1)])
    b, ctx_b = declare([("y", Pos(4, 0, 1), 1)])
    admit_ok(manager, a, ctx_a)
    admit_ok(manager, b, ctx_b)
    assert (manager.slot_of("x"), manager.slot_of("y")) == (0, 1)
    manager.abort_step(a, ctx_a)
    assert (manager.slot_of("x"), manager.slot_of("y")) == (None, 1)
    assert (manager.readers(0), manager.readers(1)) == (0, 1)
    manager.plan(b, ctx_b)
    manager.commit(b, ctx_b)
    manager.abort_step(b, ctx_b)  # committed: nothing of it is left to return
    assert (manager.slot_of("y"), manager.written("y")) == (1, 1)
    admit_ok(manager, a, ctx_a)  # the aborted step, admitted again from scratch
    manager.commit(a, ctx_a)
    manager.abort_step(a, ctx_a)
    assert (manager.slot_of("x"), manager.written("x")) == (0, 1)


def test_aborting_a_capture_step_returns_nothing_another_step_claimed(manager):
    """A capture step only traces shapes: its admit claims nothing, so its abort may give nothing back,
    not even the claim of a real step naming the same request."""
    ingest(manager, "a")
    real, ctx = declare([("a", Pos(3, 0, 0), 1)])
    admit_ok(manager, real, ctx)
    before = state(manager)
    capture = StepContext(["a"], "walk", 0, capture=True)
    admit_ok(manager, real, capture)
    manager.abort_step(real, capture)
    assert state(manager) == before
    assert manager.slot_of("a") == 0
    manager.plan(real, ctx)  # still the step admit accepted
    manager.commit(real, ctx)
    assert manager.written("a") == 1


@pytest.mark.parametrize("span", [None, "1", 1.5, float("nan"), True])
def test_a_span_that_is_not_an_int_is_refused_not_raised(manager, span):
    ingest(manager, "a")
    before = state(manager)
    outcome = manager.admit(*declare([("a", Pos(3, 0, 0), span)]))
    assert type(outcome.reason) is AdmitRuntimeError
    assert f"'a' declares span={span!r}; it must be an int" in outcome.reason.message
    assert state(manager) == before


@pytest.mark.parametrize("columns", [False, True], ids=["dict", "PositionColumns"])
def test_a_step_past_int32_positions_is_refused_at_admission_and_claims_nothing(manager, columns):
    ingest(manager, "a")
    positions = PositionColumns(["a"], [[3, 0, 0]]) if columns else {"a": Pos(3, 0, 0)}
    step = BoundedKVStep((Segment("a", "main", 2**31 - 3),), positions)
    before = state(manager)
    outcome = manager.admit(step)
    assert type(outcome.reason) is AdmitRuntimeError
    assert "source_len=3 + written=0 + step tokens=2147483645 must be <= 2147483647" in outcome.reason.message
    assert state(manager) == before
    last = BoundedKVStep((Segment("a", "main", 2**31 - 4),), positions)  # the longest that fits
    assert manager.admit(last).ok


def test_numpy_int32_positions_near_int32_are_refused_not_wrapped(manager):
    """Row by row, NumPy int32 terms once summed past int32 to a negative end, which passed."""
    ingest(manager, "a")
    first = BoundedKVStep((Segment("a", "main", 2**31 - 8),), {"a": Pos(3, 0, 0)})
    assert manager.admit(first).ok
    manager.commit(first)
    before = state(manager)
    position = Pos(np.int32(3), np.int32(2**31 - 8), np.int32(0))
    outcome = manager.admit(BoundedKVStep((Segment("a", "main", np.int32(5)),), {"a": position}))
    assert type(outcome.reason) is AdmitRuntimeError
    assert "must be <= 2147483647" in outcome.reason.message
    assert state(manager) == before
    assert manager.admit(BoundedKVStep((Segment("a", "main", np.int32(4)),), {"a": position})).ok


def test_a_request_id_with_the_padding_prefix_is_refused(manager):
    before = state(manager)
    with pytest.raises(ValueError, match=r"request_id='\\x00pad-7' must not start with '\\x00pad'"):
        manager.ingest_request(f"{PAD}-7")
    assert state(manager) == before
    assert manager.request_ids == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"model_shards": 0}, ValueError, "model_shards=0 must be an int >= 1"),
        ({"model_shards": True}, ValueError, "model_shards=True must be an int >= 1"),
        ({"data_shards": 3, "local_data_shards": [True]}, ValueError, r"local_data_shards=\[True\] must be"),
        ({"spec": CFG}, TypeError, r"spec=BoundedKVConfig\(.* must be a BoundedKVSpec"),
    ],
)
def test_the_manager_refuses_arguments_of_the_wrong_kind(kwargs, error, says):
    spec = kwargs.pop("spec", BoundedKVSpec("kv", {"node"}, CFG))
    for make in (BoundedKVManager, BoundedKVManager.build):
        with pytest.raises(error, match=says):
            make(spec, **kwargs)


def test_reset_request_refuses_a_free_that_is_not_a_bool(manager):
    ingest(manager, "a")
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1)]))
    before = state(manager)
    with pytest.raises(ValueError, match="free='no' must be a bool"):
        manager.reset_request("a", free="no")  # was read as True: the request removed
    assert state(manager) == before
