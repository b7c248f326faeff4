"""The step envelope: the seed's public names, admission outcomes and reasons, BucketKey, Segment,
SlotLease, StepContext, SubmoduleStep, and steps as pytrees under `jax.jit`."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from mstar_jax.resources import step as step_module
from mstar_jax.resources.step import (
    ADMIT_OK,
    FULL_ADMIT_NOT_READY,
    FULL_ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    FullAdmitOutcome,
    RequestOffloading,
    ResourceStep,
    Segment,
    SlotLease,
    StepContext,
    SubmoduleStep,
)
from tests.resources.seed_api import fields_and_defaults

MISSING = dataclasses.MISSING

# --- every public name on the seed page ---------------------------------------------------------------------

SEED_CLASSES = [
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
    "SubmoduleStep",
]

# (class, positional fields with their defaults as the seed lists them; MISSING: required, dict: a factory)
SEED_FIELDS = [
    ("AdmitFailedReason", [("message", MISSING)]),
    ("AdmitOutcome", [("ok", MISSING), ("ready", True), ("reason", None)]),
    ("AdmitRuntimeError", [("message", MISSING)]),
    (
        "AllocationFailed",
        [("message", MISSING), ("pages_short", MISSING), ("label", MISSING), ("request_id", MISSING)],
    ),
    ("BucketKey", [("graph_walk", MISSING), ("bs", MISSING), ("num_tokens", MISSING), ("cg_key_info", None)]),
    ("FullAdmitOutcome", [("outcome", MISSING), ("failed_resource", None)]),
    ("RequestOffloading", [("message", MISSING), ("label", MISSING), ("request_id", MISSING)]),
    ("ResourceStep", [("segments", None)]),
    ("Segment", [("request_id", MISSING), ("label", MISSING), ("span", MISSING)]),
    ("SlotLease", [("slot", MISSING), ("bucket", MISSING)]),
    (
        "StepContext",
        [
            ("request_ids", MISSING),
            ("graph_walk", MISSING),
            ("slot", MISSING),
            ("capture", MISSING),
            ("is_preplan", False),
            ("plan_results", dict),
            ("slot_lease", None),
            ("piecewise_leases", dict),
            ("_padded_request_ids", None),
        ],
    ),
    ("SubmoduleStep", [("steps", MISSING), ("segments", None), ("cg_key_info", None), ("_ctx", None)]),
]

SEED_MEMBERS = [
    ("FullAdmitOutcome", "ok", "property"),
    ("FullAdmitOutcome", "ready", "property"),
    ("FullAdmitOutcome", "reason", "property"),
    ("StepContext", "padded_request_ids", "property"),
    ("StepContext", "set_padded_rids", "method"),
    ("StepContext", "set_piecewise_leases", "method"),
    ("SubmoduleStep", "ctx", "property"),
    ("SubmoduleStep", "get", "method"),
    ("SubmoduleStep", "keys", "method"),
    ("SubmoduleStep", "set_ctx", "method"),
]


@pytest.mark.parametrize("name", SEED_CLASSES)
def test_seed_classes_import(name):
    assert name in step_module.__all__
    assert isinstance(getattr(step_module, name), type)


@pytest.mark.parametrize(("name", "fields"), SEED_FIELDS, ids=[name for name, _ in SEED_FIELDS])
def test_seed_fields_in_order_with_defaults(name, fields):
    got = fields_and_defaults(getattr(step_module, name))
    assert got[: len(fields)] == fields


@pytest.mark.parametrize(("name", "member", "kind"), SEED_MEMBERS)
def test_seed_members(name, member, kind):
    attr = getattr(getattr(step_module, name), member)
    assert isinstance(attr, property) == (kind == "property")
    assert callable(attr) or kind == "property"


# --- admission outcomes and reasons -------------------------------------------------------------------------


def test_admit_outcome_defaults_and_constants():
    assert AdmitOutcome(True) == (True, True, None)
    assert AdmitOutcome(False, reason=AdmitRuntimeError("no")).ready is True
    assert AdmitOutcome(True, True, None) == ADMIT_OK
    assert FullAdmitOutcome(ADMIT_OK, None) == FULL_ADMIT_OK
    not_ready = FULL_ADMIT_NOT_READY
    assert (not_ready.ok, not_ready.ready, not_ready.reason) == (True, False, None)
    assert not_ready.failed_resource is None


@pytest.mark.parametrize(
    "outcome",
    [
        AdmitOutcome(True, True, None),
        AdmitOutcome(True, False, None),
        AdmitOutcome(False, True, AllocationFailed("full", 1, "main", "r1")),
        AdmitOutcome(False, False, AdmitRuntimeError("never")),
    ],
)
def test_full_admit_outcome_delegates_to_its_outcome(outcome):
    full = FullAdmitOutcome(outcome, "kv")
    assert (full.ok, full.ready) == (outcome.ok, outcome.ready)
    assert full.reason is outcome.reason
    assert full.failed_resource == "kv"
    assert full.outcome is outcome
    assert FullAdmitOutcome(outcome).failed_resource is None


def test_reasons_fields_and_subclassing():
    alloc = AllocationFailed("no free slot", 3, "main", "r1")
    assert dataclasses.astuple(alloc) == ("no free slot", 3, "main", "r1")
    offload = RequestOffloading("on host", "main", "r2")
    assert (offload.message, offload.label, offload.request_id) == ("on host", "main", "r2")
    terminal = AdmitRuntimeError("source too long")
    assert terminal.message == "source too long"
    for reason in (alloc, offload, terminal):
        assert isinstance(reason, AdmitFailedReason)
    # Reasons are answers, not exceptions: a refused admit is returned, never raised.
    for cls in (AdmitFailedReason, AllocationFailed, RequestOffloading, AdmitRuntimeError):
        assert not issubclass(cls, BaseException)
    # The three kinds stay distinguishable: callers branch on the type.
    assert not isinstance(terminal, AllocationFailed | RequestOffloading)
    assert not isinstance(offload, AllocationFailed)
    assert AllocationFailed("m", 1, "l", "r") == AllocationFailed("m", 1, "l", "r")
    assert AllocationFailed("m", 1, "l", "r") != AllocationFailed("m", 2, "l", "r")
    with pytest.raises(dataclasses.FrozenInstanceError):
        alloc.pages_short = 0


# --- BucketKey ----------------------------------------------------------------------------------------------


def test_bucket_key_is_hashable_and_compares_by_value():
    key = BucketKey("decode", 4, 8)
    assert key.cg_key_info is None
    assert key == BucketKey("decode", 4, 8, None)
    assert hash(key) == hash(BucketKey("decode", 4, 8))
    keys = {key, BucketKey("decode", 4, 8), BucketKey("decode", 4, 8, "cfg"), BucketKey("decode", 8, 8)}
    assert len(keys) == 3
    assert {key: "program"}[BucketKey("decode", 4, 8)] == "program"
    assert key != BucketKey("prefill", 4, 8)
    assert key != BucketKey("decode", 4, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.bs = 8


def test_bucket_key_str():
    assert str(BucketKey("decode", 4, 8)) == "decode[bs=4,tokens=8]"
    assert str(BucketKey("decode", 4, 8, "requires_cfg")) == "decode[bs=4,tokens=8,key=requires_cfg]"


@pytest.mark.parametrize("field", ["bs", "num_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", None])
def test_bucket_key_refuses_bad_sizes(field, value):
    sizes = {"bs": 2, "num_tokens": 2, field: value}
    with pytest.raises(ValueError, match=re.escape(f"BucketKey.{field}={value!r} must be an int >= 1")):
        BucketKey("decode", **sizes)


def test_bucket_key_refuses_an_unhashable_cg_key_info_by_name():
    with pytest.raises(TypeError, match=r"cg_key_info=\['cfg'\].*hashable"):
        BucketKey("decode", 1, 1, ["cfg"])


# --- Segment, SlotLease, ResourceStep -----------------------------------------------------------------------


def test_segment_is_a_named_tuple():
    seg = Segment("r1", "main", 0)  # span 0: reads without writing
    assert seg == ("r1", "main", 0)
    assert (seg.request_id, seg.label, seg.span) == ("r1", "main", 0)
    assert Segment._fields == ("request_id", "label", "span")
    assert isinstance(seg, tuple)


def test_slot_lease():
    bucket = BucketKey("decode", 2, 1)
    lease = SlotLease(1, bucket)
    assert (lease.slot, lease.bucket) == (1, bucket)
    assert SlotLease(0, None).bucket is None  # eager
    assert hash(lease) == hash(SlotLease(1, BucketKey("decode", 2, 1)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.slot = 0


def test_resource_step_segments():
    assert ResourceStep().segments is None
    assert ResourceStep().request_ids() == ()
    step = ResourceStep([Segment("a", "main", 1), Segment("b", "main", 0)])
    assert step.segments == (Segment("a", "main", 1), Segment("b", "main", 0))  # stored as a tuple
    assert step.request_ids() == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.segments = None


# --- StepContext --------------------------------------------------------------------------------------------


def _ctx(rids=("a", "b"), **kwargs) -> StepContext:
    return StepContext(list(rids), "decode", 0, False, **kwargs)


def test_step_context_defaults():
    ctx, other = _ctx(), _ctx()
    assert ctx.is_preplan is False
    assert ctx.plan_results == {}
    assert ctx.slot_lease is None
    assert ctx.piecewise_leases == {}
    ctx.plan_results["kv"] = "plan"
    assert other.plan_results == {}  # a fresh dict per context


@pytest.mark.parametrize("padded", [None, ("a", "b", "\x00pad0")])
def test_a_leased_context_is_the_one_built_field_by_field(padded):
    bucket = BucketKey("decode", 4, 1)
    fast = StepContext.leased(["a", "b"], bucket, padded=padded, row_groups=((2, 4),))
    slow = StepContext(["a", "b"], "decode", 0, capture=False, slot_lease=SlotLease(0, bucket))
    if padded is not None:
        slow.set_padded_rids(list(padded))
    slow.row_groups = ((2, 4),)
    slow.padding_rows(), fast.padding_rows()  # each caches its padding set the same way
    assert vars(fast) == vars(slow)
    assert fast.padding_rows() == (set() if padded is None else {"\x00pad0"})
    fast.request_ids = ["c"]  # still a context whose ids drop a stale padded list
    assert list(fast.padded_request_ids) == ["c"]


def test_a_leased_context_refuses_a_padded_list_not_starting_with_its_rows():
    with pytest.raises(
        ValueError, match=r"padded=\['b', 'a'\] must start with the real request_ids \['a', 'b'\]"
    ):
        StepContext.leased(["a", "b"], BucketKey("decode", 4, 1), padded=["b", "a"])


def test_padded_request_ids_default_to_request_ids():
    ctx = _ctx()
    assert list(ctx.padded_request_ids) == ["a", "b"]
    ctx.request_ids = ["c"]
    assert list(ctx.padded_request_ids) == ["c"]


def test_set_padded_rids_keeps_it_until_reset():
    ctx = _ctx()
    ctx.set_padded_rids(["a", "b", "pad0", "pad1"])
    assert list(ctx.padded_request_ids) == ["a", "b", "pad0", "pad1"]
    ctx.plan_results["kv"] = 1  # unrelated writes keep it
    ctx.slot = 1
    assert list(ctx.padded_request_ids) == ["a", "b", "pad0", "pad1"]
    ctx.set_padded_rids(None)
    assert list(ctx.padded_request_ids) == ["a", "b"]


def test_dropping_a_rid_invalidates_the_padded_list():
    ctx = _ctx()
    ctx.set_padded_rids(["a", "b", "pad0"])
    ctx.request_ids = ["a"]
    assert list(ctx.padded_request_ids) == ["a"]
    assert not ctx.is_padding_row("b")


def test_reassigning_the_same_rids_keeps_the_padded_list():
    ctx = _ctx()
    ctx.set_padded_rids(["a", "b", "pad0"])
    ctx.request_ids = ("a", "b")  # another sequence type, same ids
    assert list(ctx.padded_request_ids) == ["a", "b", "pad0"]


@pytest.mark.parametrize("padded", [["b", "a", "pad"], ["a"], ["a", "x", "pad"]])
def test_padded_rids_must_start_with_the_real_ones(padded):
    ctx = _ctx()
    with pytest.raises(ValueError, match=r"padded_rids=.*must start with the real request_ids \['a', 'b'\]"):
        ctx.set_padded_rids(padded)
    assert list(ctx.padded_request_ids) == ["a", "b"]


def test_is_padding_row():
    ctx = _ctx()
    assert not ctx.is_padding_row("a")
    assert not ctx.is_padding_row("pad0")  # unpadded: nothing is padding
    ctx.set_padded_rids(["a", "b", "pad0"])
    assert ctx.is_padding_row("pad0")
    assert not ctx.is_padding_row("a")
    assert not ctx.is_padding_row("unknown")


def test_set_piecewise_leases_copies_the_mapping():
    ctx = _ctx()
    leases = {"region": SlotLease(1, BucketKey("decode", 2, 1))}
    ctx.set_piecewise_leases(leases)
    assert ctx.piecewise_leases == leases
    leases["other"] = SlotLease(0, None)
    assert "other" not in ctx.piecewise_leases


# --- SubmoduleStep ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaggedStep(ResourceStep):
    """A step subclass with an extra field, to check inheritance keeps the type and the field."""

    tag: str = "t"


def test_submodule_step_segments_are_inherited_only_where_missing():
    shared = [Segment("a", "main", 1), Segment("b", "main", 2)]
    own = (Segment("a", "cfg", 1),)
    steps = {"kv": ResourceStep(), "attn": ResourceStep(own), "tagged": TaggedStep(tag="x")}
    sub = SubmoduleStep(steps, shared)
    assert sub.steps["kv"].segments == tuple(shared)
    assert sub.steps["attn"].segments == own
    assert sub.steps["tagged"] == TaggedStep(tuple(shared), tag="x")
    # Without shared segments nothing changes.
    bare = SubmoduleStep({"kv": ResourceStep()})
    assert bare.steps["kv"].segments is None
    assert bare.segments is None
    assert bare.cg_key_info is None


def test_submodule_step_lookup():
    kv = ResourceStep()
    sub = SubmoduleStep({"kv": kv})
    assert sub.get("kv") is kv
    assert sub.get("missing") is None
    assert list(sub.keys()) == ["kv"]
    assert "kv" in sub
    assert "missing" not in sub


def test_submodule_step_ctx():
    sub = SubmoduleStep({"kv": ResourceStep()}, cg_key_info="cfg")
    with pytest.raises(RuntimeError, match=r"no StepContext yet.*set_ctx"):
        _ = sub.ctx
    ctx = _ctx()
    sub.set_ctx(ctx)  # the one mutation a frozen SubmoduleStep allows
    assert sub.ctx is ctx
    with pytest.raises(dataclasses.FrozenInstanceError):
        sub.cg_key_info = None


# --- steps as pytrees under jit -----------------------------------------------------------------------------


def test_resource_step_flattens_to_its_spans():
    step = ResourceStep((Segment("a", "main", 3), Segment("b", "main", 0)))
    leaves, treedef = jax.tree_util.tree_flatten(step)
    assert leaves == [3, 0]
    assert jax.tree_util.tree_unflatten(treedef, leaves) == step
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, step)
    assert doubled == ResourceStep((Segment("a", "main", 6), Segment("b", "main", 0)))
    assert jax.tree_util.tree_leaves(ResourceStep()) == []
    leaves, treedef = jax.tree_util.tree_flatten(ResourceStep())
    assert jax.tree_util.tree_unflatten(treedef, leaves) == ResourceStep()


def test_jitted_step_function_sees_spans_as_data_and_does_not_retrace():
    traces = []

    @jax.jit
    def total(step):
        spans = [seg.span for seg in step.segments]
        traces.append(spans)
        return functools.reduce(jnp.add, spans)

    assert total(ResourceStep((Segment("a", "main", 3), Segment("b", "main", 4)))) == 7
    assert total(ResourceStep((Segment("a", "main", 1), Segment("b", "main", 0)))) == 1
    assert len(traces) == 1
    assert all(isinstance(span, jax.Array) and not isinstance(span, int) for span in traces[0])
    # Request ids and labels are static: a different batch is a different program.
    assert total(ResourceStep((Segment("c", "main", 1), Segment("b", "main", 0)))) == 1
    assert len(traces) == 2


def test_a_jitted_function_can_return_a_step():
    step = ResourceStep((Segment("a", "main", 3),))
    out = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x + 1, s))(step)
    assert out.request_ids() == ("a",)
    assert int(out.segments[0].span) == 4


def test_submodule_step_is_a_pytree_of_its_steps():
    inner = ResourceStep((Segment("a", "main", 3),))
    sub = SubmoduleStep({"kv": inner}, cg_key_info="cfg")
    leaves, treedef = jax.tree_util.tree_flatten(sub)
    assert leaves == [3]
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.steps == sub.steps
    assert rebuilt.cg_key_info == "cfg"
