"""ResourceRunner: dependency order, the admit sweep, plan/commit/abort sweeps, routing by key."""

from __future__ import annotations

import re

import pytest

from mstar_jax.resources.base import PublishedInfo, Resource
from mstar_jax.resources.runner import ResourceRunner, topo_sort
from mstar_jax.resources.spec import ResourceReqConfig
from mstar_jax.resources.step import (
    ADMIT_OK,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ResourceStep,
    Segment,
    StepContext,
    SubmoduleStep,
)


class Recorder(Resource):
    """A resource that logs every call into a shared journal and answers what it is told."""

    def __init__(self, key, journal, deps=(), outcome=ADMIT_OK, abort_error=None):
        self.key, self.journal, self.deps = key, journal, set(deps)
        self.outcome, self.abort_error = outcome, abort_error
        self.seen_plans = None
        self.ingested = {}

    @classmethod
    def build(cls, spec, dependencies=None):
        raise NotImplementedError

    def depends_on(self):
        return self.deps

    def ingest_request(self, request_id, req_config=None):
        self.journal.append(("ingest", self.key))
        self.ingested[request_id] = req_config

    def remove_request(self, request_id):
        self.journal.append(("remove", self.key))
        self.ingested.pop(request_id, None)

    def admit(self, step, ctx):
        self.journal.append(("admit", self.key))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def plan(self, step, ctx):
        self.journal.append(("plan", self.key))
        self.seen_plans = dict(ctx.plan_results)
        return f"plan-{self.key}"

    def commit(self, step, ctx):
        self.journal.append(("commit", self.key))

    def abort_step(self, step, ctx):
        self.journal.append(("abort", self.key))
        if self.abort_error is not None:
            raise self.abort_error


def make(specs, **kwargs):
    journal = []
    resources = {key: Recorder(key, journal, deps, **kwargs.get(key, {})) for key, deps in specs.items()}
    return ResourceRunner(resources), resources, journal


def step_for(keys, ctx=None):
    step = SubmoduleStep({key: ResourceStep() for key in keys}, segments=[Segment("r0", "main", 1)])
    step.set_ctx(ctx or StepContext(["r0"], "walk", 0, capture=False))
    return step


def test_topo_sort_puts_dependencies_first_and_breaks_ties_alphabetically():
    _, resources, _ = make({"c": (), "b": ("d",), "a": ("b",), "d": ()})
    # Layer 0: c, d (alphabetical); layer 1: b; layer 2: a (transitively after d).
    assert topo_sort(resources) == ("c", "d", "b", "a")  # a tuple, like ResourceRunner.order


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"a": ("zz",)}, r"'a' depends on unknown key\(s\) \['zz'\]; available: \['a'\]"),
        ({"a": ("a",)}, "'a' depends on itself"),
        (
            {"a": ("b",), "b": ("c",), "c": ("a",), "d": ()},
            r"dependency cycle among resources \['a', 'b', 'c'\]",
        ),
    ],
)
def test_topo_sort_rejects_bad_dependencies(specs, message):
    with pytest.raises(ValueError, match=message):
        make(specs)


def test_plan_runs_in_dependency_order_and_dependents_see_their_dependencies():
    runner, resources, journal = make({"kv": (), "attn": ("kv",)})
    step = step_for(["attn", "kv"])
    results = runner.plan(step)
    assert journal == [("plan", "kv"), ("plan", "attn")]
    assert resources["attn"].seen_plans == {"kv": "plan-kv"}
    assert results is step.ctx.plan_results
    assert results == {"kv": "plan-kv", "attn": "plan-attn"}


def test_plan_clears_stale_results_and_skips_undeclared_resources():
    runner, resources, journal = make({"kv": (), "other": ()})
    ctx = StepContext(["r0"], "walk", 0, capture=False)
    ctx.plan_results["stale"] = "from last step"
    results = runner.plan(step_for(["kv"], ctx))
    assert results == {"kv": "plan-kv"}
    assert journal == [("plan", "kv")]
    assert resources["kv"].seen_plans == {}


def test_admit_stops_at_first_refusal_preserving_the_reason_object():
    reason = AllocationFailed("full", pages_short=1, label="main", request_id="r0")
    runner, _, journal = make(
        {"a": (), "b": ("a",), "c": ("b",)}, b={"outcome": AdmitOutcome(False, True, reason)}
    )
    full = runner.admit(step_for(["a", "b", "c"]))
    assert not full.ok
    assert full.failed_resource == "b"
    assert full.reason is reason
    assert journal == [("admit", "a"), ("admit", "b"), ("abort", "a")]  # c never asked; a's claim undone


def test_admit_ands_ready():
    runner, _, _ = make({"a": (), "b": ()}, a={"outcome": AdmitOutcome(True, False, None)})
    full = runner.admit(step_for(["a", "b"]))
    assert (full.ok, full.ready, full.failed_resource) == (True, False, None)
    runner, _, _ = make({"a": (), "b": ()})
    full = runner.admit(step_for(["a", "b"]))
    assert (full.ok, full.ready, full.reason) == (True, True, None)


def test_admit_runtime_error_is_reported_with_its_resource():
    reason = AdmitRuntimeError("no position")
    runner, _, _ = make({"a": ()}, a={"outcome": AdmitOutcome(False, False, reason)})
    full = runner.admit(step_for(["a"]))
    assert full.reason is reason
    assert full.failed_resource == "a"


def test_commit_sweeps_declared_resources_in_order():
    runner, _, journal = make({"z": (), "y": ("z",), "x": ()})
    runner.commit(step_for(["y", "z"]))
    assert journal == [("commit", "z"), ("commit", "y")]


def test_abort_reaches_every_resource_even_if_one_raises():
    runner, _, journal = make({"a": (), "b": (), "c": ()}, a={"abort_error": RuntimeError("boom")})
    with pytest.raises(RuntimeError, match="boom"):
        runner.abort_step(step_for(["a", "b", "c"]))
    assert journal == [("abort", "a"), ("abort", "b"), ("abort", "c")]


def test_ingest_routes_overrides_by_key_and_missing_gets_none():
    runner, resources, journal = make({"a": (), "b": ()})
    override = ResourceReqConfig()
    runner.ingest_request("r0", {"b": override, "elsewhere": override})
    assert resources["a"].ingested == {"r0": None}
    assert resources["b"].ingested["r0"] is override
    runner.remove_request("r0")
    assert resources["a"].ingested == {}
    assert resources["b"].ingested == {}
    assert journal == [("ingest", "a"), ("ingest", "b"), ("remove", "a"), ("remove", "b")]


def test_unknown_key_in_a_step_raises_key_error():
    runner, _, _ = make({"a": ()})
    for call in (runner.admit, runner.plan, runner.commit, runner.abort_step):
        with pytest.raises(KeyError, match="does not have"):
            call(step_for(["a", "nope"]))


def test_resource_step_inherits_submodule_segments_unless_it_has_its_own():
    own = (Segment("r1", "main", 2),)
    step = SubmoduleStep(
        {"a": ResourceStep(), "b": ResourceStep(segments=own)}, segments=[Segment("r0", "main", 1)]
    )
    assert step.steps["a"].segments == (Segment("r0", "main", 1),)
    assert step.steps["b"].segments == own


def test_padded_request_ids_follow_the_real_ones():
    ctx = StepContext(["a", "b"], "walk", 0, capture=False)
    assert tuple(ctx.padded_request_ids) == ("a", "b")
    ctx.set_padded_rids(["a", "b", "pad0"])
    ctx.request_ids = ["a", "b"]  # the same ids keep the padding
    assert tuple(ctx.padded_request_ids) == ("a", "b", "pad0")
    assert ctx.is_padding_row("pad0")
    assert not ctx.is_padding_row("a")
    ctx.request_ids = ["a"]  # a dropped rid invalidates it
    assert tuple(ctx.padded_request_ids) == ("a",)
    assert not ctx.is_padding_row("pad0")  # the answer follows every change, though it is cached
    ctx.set_padded_rids(["a", "b"])
    assert ctx.is_padding_row("b")
    ctx.set_padded_rids(None)
    assert not ctx.is_padding_row("b")


def test_a_refused_admit_leaves_no_claim_in_resources_that_admitted_before():
    from mstar_jax.resources.kv.bounded.config import (
        BoundedKVConfig,
        BoundedKVSpec,
        BoundedKVStep,
        SinkWindow,
    )
    from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
    from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

    def manager(key, slots):
        cfg = BoundedKVConfig(1, 1, 4, 1, 0, SinkWindow(1, 2), max_slots=slots)
        return BoundedKVManager(BoundedKVSpec(key, {"n"}, cfg), num_sources=1)

    runner = ResourceRunner({"a": manager("a", 2), "b": manager("b", 1)})
    for rid in ("x", "y"):
        runner.ingest_request(rid, {})

    def step(rid):
        kv = BoundedKVStep((Segment(rid, "main", 1),), {rid: Pos(0, 0)})
        sub = SubmoduleStep({"a": kv, "b": kv})
        sub.set_ctx(StepContext([rid], "decode", 0, capture=False))
        return sub

    assert runner.admit(step("x")).ok
    refused = runner.admit(step("y"))  # "a" has room, "b" is full
    assert (refused.ok, refused.failed_resource) == (False, "b")
    assert runner.resources["a"].slot_of("y") is None
    assert runner.resources["a"].free_slots == 1


class Info(PublishedInfo):
    def __init__(self, value):
        self.value = value

    def update(self, other):
        self.value = other.value


class Publisher(Recorder):
    """Publishes `published[request_id]` (None for others) and answers retrievals with `retrieve`."""

    def __init__(self, key, journal, published=None, retrieve=ADMIT_OK):
        super().__init__(key, journal)
        self.published, self.retrieve, self.retrieved = published or {}, retrieve, []

    def publish(self, request_id):
        self.journal.append(("publish", self.key))
        return self.published.get(request_id)

    def admit_retrieve(self, request_id, node_name, graph_walk, published):
        self.journal.append(("retrieve", self.key))
        self.retrieved.append((request_id, node_name, graph_walk, published))
        return self.retrieve


def test_publish_collects_each_requests_info_by_key_leaving_out_none_from_every_publisher():
    journal = []
    a_info, b_info = Info(1), Info(2)
    runner = ResourceRunner({
        "a": Publisher("a", journal, {"r1": a_info}),
        "b": Publisher("b", journal, {"r1": b_info, "r2": None}),
        "plain": Recorder("plain", journal),  # publishes nothing: never asked
    })  # fmt: skip
    assert runner.publish(["r1", "r2", "r3"]) == {"r1": {"a": a_info, "b": b_info}}
    # Not step-scoped: no step declared anything, and every publisher was asked for every request.
    assert journal == [("publish", "a"), ("publish", "b")] * 3


def test_admit_retrieve_routes_published_info_by_key_ands_ready_and_stops_at_a_refusal():
    journal = []
    waiting = AdmitOutcome(True, False, None)
    refused = AdmitOutcome(False, False, AdmitRuntimeError("no such transfer"))
    a, b = Publisher("a", journal, retrieve=waiting), Publisher("b", journal)
    runner = ResourceRunner({"a": a, "b": b, "plain": Recorder("plain", journal)})
    info = Info(7)
    outcome = runner.admit_retrieve("r1", "talker", "prefill", {"b": info})
    assert (outcome.ok, outcome.ready, outcome.failed_resource) == (True, False, None)
    assert a.retrieved == [("r1", "talker", "prefill", None)]  # a key absent from `published` gets None
    assert b.retrieved == [("r1", "talker", "prefill", info)]
    b.retrieve = ADMIT_OK
    a.retrieve = ADMIT_OK
    assert runner.admit_retrieve("r2", "talker", "decode", {}).ok
    assert runner.admit_retrieve("r2", "talker", "decode", {}).ready
    journal.clear()
    a.retrieve = refused
    outcome = runner.admit_retrieve("r3", "talker", "decode", {})
    assert (outcome.ok, outcome.failed_resource) == (False, "a")
    assert outcome.reason is refused.reason  # the refusal object itself
    assert journal == [("retrieve", "a")]  # b was never asked


def test_admit_retrieve_takes_the_originals_positional_order_and_passes_it_through_unchanged():
    # The seed's order is (request_id, node_name, graph_walk, published), as on `Resource.admit_retrieve`;
    # four distinct strings so a swap of any two arguments shows up at the resource's hook.
    journal = []
    resource = Publisher("kv", journal)
    runner = ResourceRunner({"kv": resource})
    info = Info(3)
    assert runner.admit_retrieve("rid", "node", "walk", {"kv": info}).ok
    assert resource.retrieved == [("rid", "node", "walk", info)]
    resource.retrieved.clear()
    assert runner.admit_retrieve(request_id="rid", node_name="node", graph_walk="walk", published={}).ok
    assert resource.retrieved == [("rid", "node", "walk", None)]


def test_admit_retrieve_takes_none_as_nothing_published():
    journal = []
    a, b = Publisher("a", journal), Publisher("b", journal, retrieve=AdmitOutcome(True, False, None))
    runner = ResourceRunner({"a": a, "b": b})
    outcome = runner.admit_retrieve("r1", "talker", "prefill", None)
    assert (outcome.ok, outcome.ready, outcome.failed_resource) == (True, False, None)
    assert runner.admit_retrieve("r2", "talker", "decode").ok  # None is the default
    assert a.retrieved == b.retrieved == [("r1", "talker", "prefill", None), ("r2", "talker", "decode", None)]


@pytest.mark.parametrize(
    ("published", "shown"),
    [([("a", 1)], r"\[\('a', 1\)\]"), (Info(1), "<.*Info object at .*>"), ("a", "'a'")],
)
def test_admit_retrieve_refuses_published_info_that_is_not_a_mapping_before_asking_anyone(published, shown):
    journal = []
    resource = Publisher("a", journal)
    runner = ResourceRunner({"a": resource})
    with pytest.raises(TypeError) as info:
        runner.admit_retrieve("r1", "talker", "prefill", published)
    assert re.fullmatch(
        f"published={shown} must be None or a mapping of resource key to PublishedInfo \\(what publish\\(\\) "
        f"returns for one request\\), got {type(published).__name__}",
        str(info.value),
    ), str(info.value)
    assert resource.retrieved == []
    assert journal == []


def test_a_resource_that_raises_in_admit_has_the_earlier_admits_aborted_then_the_error_raised():
    """Only a refusal used to abort: an exception left the earlier resources holding their claims."""
    error = TypeError("a bad field")
    runner, _, journal = make({"a": (), "b": ("a",), "c": ("b",)}, c={"outcome": error})
    with pytest.raises(TypeError, match="a bad field"):
        runner.admit(step_for(["a", "b", "c"]))
    assert journal == [("admit", "a"), ("admit", "b"), ("admit", "c"), ("abort", "b"), ("abort", "a")]
