"""`BoundedKVManager`: slots, atomic admission, plans and commits, the source bank, offload and reload.

Bookkeeping is compared field by field before and after every refused call (a refusal claims nothing).
Device results are checked against a float64 attention written from the stream definition, or bit for
bit against a run that took another path (an offload and a reload into another slot).
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    store_capacity,
)
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import (
    ADMIT_OK,
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    RequestOffloading,
    Segment,
    SlotLease,
    StepContext,
    StepNotAdmittedError,
    UnknownRequestError,
)

# Sources of 1..4 tokens; the sink is the source plus one written token, the ring holds 3:
# sink_capacity = 1, window 3, so C = 4 slot tokens.
CFG = BoundedKVConfig(
    num_layers=2, num_heads=1, head_dim=4, rows_per_request=2, max_source_len=4, min_source_len=1,
    retention=lambda s: SinkWindow(s + 1, 3), max_slots=3,
)  # fmt: skip
HEADS = 2  # query heads (GQA over CFG.num_heads KV heads)
BUCKET = BucketKey("decode", bs=3, num_tokens=2)
L, R, G, D, T = CFG.num_layers, CFG.rows_per_request, CFG.num_heads, CFG.head_dim, BUCKET.num_tokens
SOURCE_LENGTHS = {0: 3, 1: 4}


def _source(seed: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (L, R, G, length, D)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


SOURCES = {index: _source(index, length) for index, length in SOURCE_LENGTHS.items()}


def new_manager(config: BoundedKVConfig = CFG) -> BoundedKVManager:
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, config), num_sources=3)
    if config is CFG:
        for index, (k, v) in SOURCES.items():
            manager.register_source(index, list(k), list(v))
    return manager


@pytest.fixture
def manager() -> BoundedKVManager:
    return new_manager()


def declare(entries, *, padding: int = 0, tokens=None, capture: bool = False, lease: bool = True):
    """A step and its context: `entries` are (rid, position or None, span); padding rows follow."""
    real = [rid for rid, _, _ in entries]
    pads = [f"pad{i}" for i in range(padding)]
    step = BoundedKVStep(
        tuple(Segment(rid, "main", span) for rid, _, span in entries)
        + tuple(Segment(p, "main", 0) for p in pads),
        positions={rid: pos for rid, pos, _ in entries if pos is not None},
        step_tokens=tokens or {},
    )
    ctx = StepContext(real, "decode", 0, capture=capture, slot_lease=SlotLease(0, BUCKET) if lease else None)
    if pads:
        ctx.set_padded_rids(real + pads)
    return step, ctx


def state(manager: BoundedKVManager) -> tuple:
    """Every piece of host bookkeeping a refused call must leave as it was."""
    requests = {
        rid: (r.slot, r.written, r.source, r.source_len, r.policy, r.host_copy is not None)
        for rid, r in manager._requests.items()
    }
    readers = {index: n for index, n in manager._readers.items() if n}
    return manager._slots.snapshot(), requests, readers, dict(manager._source_lengths)


def admit_ok(manager: BoundedKVManager, step, ctx) -> None:
    outcome = manager.admit(step, ctx)
    assert outcome.ok, outcome


def ingest(manager: BoundedKVManager, *rids: str) -> None:
    for rid in rids:
        manager.ingest_request(rid)


# --- device steps -----------------------------------------------------------------------------------------


@partial(jax.jit, donate_argnums=0)
def run_step(cache, bank, plan, q, k, v):
    outs = []
    for layer in range(L):
        out, cache = attend(
            cache, bank, plan, layer, q[layer], k[layer], v[layer], config=CFG, implementation="xla"
        )
        outs.append(out)
    return cache, jnp.stack(outs)


def step_inputs(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [L, bs * R, T, H, D], k and v [L, bs * R, T, G, D]."""
    rng = np.random.default_rng(seed)
    rows = BUCKET.bs * R
    q = rng.standard_normal((L, rows, T, HEADS, D)).astype(np.float32)
    k = rng.standard_normal((L, rows, T, G, D)).astype(np.float32)
    v = rng.standard_normal((L, rows, T, G, D)).astype(np.float32)
    return q, k, v


def run(manager: BoundedKVManager, entries, seed: int, *, tokens=None) -> np.ndarray:
    """Admit, plan, run and commit one step padded to the bucket; returns out [L, bs * R, T, H, D]."""
    step, ctx = declare(entries, padding=BUCKET.bs - len(entries), tokens=tokens)
    admit_ok(manager, step, ctx)
    plan = manager.plan(step, ctx)
    manager.cache, out = run_step(manager.cache, manager.bank, plan, *step_inputs(seed))
    manager.commit(step, ctx)
    return np.asarray(out)


def first_step_reference(source_k, source_v, source_len, q, k, v, tokens) -> np.ndarray:
    """A fresh request's first step whose sink covers the source: every query sees the whole source, then
    the step's own tokens. q [L, R, T, H, D], k/v [L, R, T, G, D], source [L, R, G, P, D] -> float64."""
    out = np.zeros((L, R, tokens, HEADS, D))
    for layer in range(L):
        for c in range(R):
            for h in range(HEADS):
                g = h // (HEADS // G)
                keys = np.concatenate([source_k[layer, c, g, :source_len], k[layer, c, :tokens, g]]).astype(
                    float
                )
                values = np.concatenate([source_v[layer, c, g, :source_len], v[layer, c, :tokens, g]]).astype(
                    float
                )
                scores = keys @ q[layer, c, :tokens, h].astype(float).T / np.sqrt(D)  # [keys, tokens]
                weights = np.exp(scores - scores.max(axis=0))
                out[layer, c, :, h] = (weights / weights.sum(axis=0)).T @ values
    return out


# --- slots and admission ----------------------------------------------------------------------------------


def test_slots_are_handed_out_from_slot_0(manager):
    ingest(manager, "a", "b", "c")
    assert manager.free_slots == 3
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1)]))
    admit_ok(manager, *declare([("b", Pos(3, 0, 0), 1)]))
    assert (manager.slot_of("a"), manager.slot_of("b"), manager.free_slots) == (0, 1, 1)
    manager.remove_request("a")
    admit_ok(manager, *declare([("c", Pos(4, 0, 1), 1)]))
    assert manager.slot_of("c") == 0  # the freed slot comes back first
    assert manager.slot_of("a") is None
    assert manager.padding_slot == CFG.max_slots == 3


def test_a_full_cache_refuses_with_allocation_failed(manager):
    ingest(manager, "a", "b", "c", "d")
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1), ("b", Pos(3, 0, 0), 1), ("c", Pos(4, 0, 1), 1)]))
    before = state(manager)
    step, ctx = declare([("d", Pos(3, 0, 0), 1)])
    outcome = manager.admit(step, ctx)
    assert (outcome.ok, outcome.ready) == (False, True)  # retry once a slot frees up: not terminal
    assert isinstance(outcome.reason, AllocationFailed)
    assert (outcome.reason.pages_short, outcome.reason.label, outcome.reason.request_id) == (1, "main", "d")
    assert outcome.reason.message == "bounded KV is full: 3 slots, 0 free, 1 needed"
    assert state(manager) == before
    manager.remove_request("b")
    admit_ok(manager, step, ctx)
    assert manager.slot_of("d") == 1


def test_three_new_requests_for_two_free_slots_claim_nothing(manager):
    ingest(manager, "old", "a", "b", "c")
    admit_ok(manager, *declare([("old", Pos(3, 0, 0), 1)]))
    before = state(manager)
    step, ctx = declare([("a", Pos(3, 0, 0), 1), ("b", Pos(4, 0, 1), 1), ("c", Pos(3, 0, 0), 1)])
    outcome = manager.admit(step, ctx)
    assert not outcome.ok
    assert (outcome.reason.pages_short, outcome.reason.request_id) == (1, "c")
    assert state(manager) == before
    assert [manager.slot_of(rid) for rid in "abc"] == [None, None, None]
    manager.remove_source(1)  # "b" never became a reader of source 1


def test_a_request_named_twice_in_a_step_is_refused_and_claims_nothing(manager):
    # Two rows of one request would share its slot and write range while commit advanced it once;
    # several rows per request are `rows_per_request`, not repeated segments.
    ingest(manager, "a")
    step = BoundedKVStep(
        (Segment("a", "main", 1), Segment("a", "cond", 0)), positions={"a": Pos(3, 0, 0)}, step_tokens={}
    )
    outcome = manager.admit(step, StepContext(["a"], "decode", 0, capture=False))
    assert not outcome.ok
    assert isinstance(outcome.reason, AdmitRuntimeError)
    assert "'a' twice" in outcome.reason.message
    assert (manager.slot_of("a"), manager.free_slots) == (None, 3)


def _commit_first_step(manager: BoundedKVManager, rid: str = "a") -> None:
    step, ctx = declare([(rid, Pos(3, 0, 0), 1)])
    admit_ok(manager, step, ctx)
    manager.commit(step, ctx)


# (setup, entry for request "a", step tokens, the message's pattern). Request "b", new and well-formed,
# comes first in every step, so each refusal also shows that the earlier segment claimed nothing.
RUNTIME_ERRORS = {
    "never_ingested": (
        None, ("ghost", Pos(3, 0, 0), 1), None,
        "bounded KV: request 'ghost' was never ingested (call ingest_request first)",
    ),
    "missing_position": (None, ("a", None, 1), None, "bounded KV step declares no position for 'a'"),
    "source_too_short": (
        None, ("a", Pos(0, 0, 0), 1), None, "'a' has a 0-token source; the slots hold sources of [1, 4]",
    ),
    "source_too_long": (
        None, ("a", Pos(5, 0, 1), 1), None, "'a' has a 5-token source; the slots hold sources of [1, 4]",
    ),
    "unknown_source": (
        None, ("a", Pos(2, 0, 2), 1), None, "'a' reads source 2, which is not registered; registered: [0, 1]",
    ),
    "longer_than_registered": (
        None, ("a", Pos(4, 0, 0), 1), None, "'a' reads 4 tokens of source 0, which holds 3",
    ),
    "changed_source": (
        _commit_first_step, ("a", Pos(4, 1, 1), 1), None,
        "'a' declares source 1 of length 4, but its stream started on source 0 of length 3",
    ),
    "changed_source_len": (
        _commit_first_step, ("a", Pos(2, 1, 0), 1), None,
        "'a' declares source 0 of length 2, but its stream started on source 0 of length 3",
    ),
    "written_ahead_of_commits": (
        _commit_first_step, ("a", Pos(3, 3, 0), 1), None,
        "'a' declares 3 written tokens; 1 were committed (positions must continue from the last committed",
    ),
    "new_request_with_written": (None, ("a", Pos(3, 2, 0), 1), None, "'a' declares 2 written tokens; 0 were"),
    "span_over_step_tokens": (
        None, ("a", Pos(3, 0, 0), 2), {"a": 1}, "'a': span=2 must be in [0, step tokens=1]",
    ),
    "negative_span": (None, ("a", Pos(3, 0, 0), -1), None, "'a': span=-1 must be in [0, step tokens=1]"),
    "tokens_over_bucket": (
        None, ("a", Pos(3, 0, 0), 1), {"a": 3},
        "'a' brings 3 tokens; bucket decode[bs=3,tokens=2] holds 2 per row",
    ),
    # Fields of the wrong type are refused before any claim (a float source_len once claimed a slot,
    # then raised while looking up its retention: the slot leaked and the source's readers miscounted).
    "float_source_len": (
        None, ("a", Pos(3.0, 0, 0), 1), None, "'a' declares source_len=3.0; it must be an int",
    ),
    "float_written": (
        None, ("a", Pos(3, 0.0, 0), 1), None, "'a' declares written=0.0; it must be an int >= 0",
    ),
    "bool_source": (
        None, ("a", Pos(3, 0, True), 1), None, "'a' declares source=True; it must be an int >= 0",
    ),
    "negative_source": (
        None, ("a", Pos(3, 0, -1), 1), None, "'a' declares source=-1; it must be an int >= 0",
    ),
    "string_written": (None, ("a", Pos(3, "0", 0), 1), None, "'a' declares written='0'; it must be an int"),
    "float_span": (None, ("a", Pos(3, 0, 0), 1.0), None, "'a' declares span=1.0; it must be an int"),
    "float_step_tokens": (
        None, ("a", Pos(3, 0, 0), 1), {"a": 1.5}, "'a' declares step tokens=1.5; it must be an int",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", RUNTIME_ERRORS)
def test_terminal_admission_errors_claim_nothing(manager, case):
    setup, entry, tokens, message = RUNTIME_ERRORS[case]
    ingest(manager, "a", "b")
    if setup is not None:
        setup(manager)
    before = state(manager)
    step, ctx = declare([("b", Pos(4, 0, 1), 1), entry], tokens={"b": 1, **(tokens or {})})
    outcome = manager.admit(step, ctx)
    assert (outcome.ok, outcome.ready) == (False, False)  # terminal: fail the request, do not retry
    assert type(outcome.reason) is AdmitRuntimeError
    assert re.fullmatch(re.escape(message) + ".*", outcome.reason.message), outcome.reason.message
    assert state(manager) == before
    assert manager.slot_of("b") is None


def test_a_capture_step_over_ingested_requests_plans_every_row_empty(manager):
    ingest(manager, "a", "b")
    _commit_first_step(manager, "a")
    step, ctx = declare([("a", Pos(3, 1, 0), 1), ("b", Pos(4, 0, 1), 1)], padding=1, capture=True)
    before = state(manager)
    assert manager.admit(step, ctx) is ADMIT_OK
    table = manager.plan(step, ctx).table
    np.testing.assert_array_equal(table, layout.padding_rows(BUCKET.bs, manager.padding_slot))
    manager.commit(step, ctx)
    assert state(manager) == before


def test_capture_admits_without_claiming(manager):
    ingest(manager, "a", "b", "c", "d")
    before = state(manager)
    entries = [(rid, Pos(3, 0, 0), 1) for rid in "abcd"] + [("ghost", None, 1)]  # more than fits, and worse
    step, ctx = declare(entries, capture=True)
    assert manager.admit(step, ctx) is ADMIT_OK
    manager.commit(step, ctx)
    assert state(manager) == before


# --- plan and commit --------------------------------------------------------------------------------------


def test_plan_rows_follow_the_layout_and_pad_to_the_bucket(manager):
    ingest(manager, "a")
    step, ctx = declare([("a", Pos(3, 0, 0), 2)], padding=1, tokens={"a": 2})
    admit_ok(manager, step, ctx)
    plan = manager.plan(step, ctx)
    assert plan.table.shape == (BUCKET.bs, tbl.ROW_INTS)  # 1 real + 1 declared padding + 1 to fill the bucket
    assert plan.table.dtype == np.int32
    expected = layout.plan_table(
        slot=[0], source=[0], source_len=[3], written=[0], span=[2], step_tokens=[2], sink=[4], window=[3],
        window_includes_step=[False], sink_capacity=1, reverse=False,
    )  # fmt: skip
    np.testing.assert_array_equal(plan.table[:1], expected)
    # Padding rows read and write nothing and name the padding slot, which no request owns.
    np.testing.assert_array_equal(plan.table[1:], layout.padding_rows(2, manager.padding_slot))
    assert (plan.table[1:, tbl.SLOT] == 3).all()
    assert not plan.table[1:, tbl.SLOT + 1 :].any()
    assert not plan.table.flags.writeable
    # Planning is a pure function of the step: twice, the same table; once committed, the step is no
    # longer the one admit accepted, and a plan of it is refused (it could read entries not yet written).
    np.testing.assert_array_equal(manager.plan(step, ctx).table, plan.table)
    manager.commit(step, ctx)
    with pytest.raises(StepNotAdmittedError, match=r"bounded KV plan: 'a' .* admit accepted no step"):
        manager.plan(step, ctx)


def test_plan_without_a_lease_has_one_row_per_segment(manager):
    ingest(manager, "a", "b")
    step, ctx = declare([("a", Pos(3, 0, 0), 1), ("b", Pos(4, 0, 1), 1)], lease=False)
    admit_ok(manager, step, ctx)
    table = manager.plan(step, ctx).table
    assert table.shape == (2, tbl.ROW_INTS)
    assert list(table[:, tbl.SLOT]) == [0, 1]
    assert list(table[:, tbl.SOURCE]) == [0, 1]
    assert list(table[:, tbl.STREAM_LEN]) == [3, 4]


def test_commit_advances_written_by_the_span(manager):
    ingest(manager, "a")
    written = 0
    for span in (2, 0, 1, 2):
        step, ctx = declare([("a", Pos(3, written, 0), span)], padding=1, tokens={"a": 2})
        admit_ok(manager, step, ctx)
        manager.commit(step, ctx)
        written += span
        assert manager.written("a") == written
        before = state(manager)
        with pytest.raises(StepNotAdmittedError, match="admit accepted no step"):
            manager.commit(step, ctx)  # a step commits once: a second commit would skip a position
        assert state(manager) == before
    assert manager.slot_of("a") == 0


def test_a_commit_without_its_admit_is_refused_so_no_request_reads_a_previous_occupant(manager):
    """A fresh request in a slot a finished request used, committed without an admit, would start at
    `written=5` and read the previous occupant's five entries as its own."""
    ingest(manager, "old", "new")
    old, ctx = declare([("old", Pos(3, 0, 0), 2)], tokens={"old": 2})
    admit_ok(manager, old, ctx)
    manager.commit(old, ctx)
    manager.remove_request("old")  # slot 0 is free, its entries still on the device
    before = state(manager)
    unadmitted, ctx = declare([("new", Pos(3, 0, 0), 2)], tokens={"new": 2})
    with pytest.raises(StepNotAdmittedError, match=r"'new' holds no slot"):
        manager.commit(unadmitted, ctx)
    assert state(manager) == before
    assert manager.written("new") == 0
    # The first admitted step must start at 0; once admitted, only that exact step commits.
    assert not manager.admit(declare([("new", Pos(3, 2, 0), 1)])[0], ctx).ok
    admit_ok(manager, unadmitted, ctx)
    before = state(manager)
    for wrong in (Pos(3, 1, 0), Pos(2, 0, 0), Pos(3, 0, 1)):
        with pytest.raises(
            StepNotAdmittedError, match=r"admit accepted \(source=0, source_len=3, written=0, span=2\)"
        ):
            manager.commit(declare([("new", wrong, 2)], tokens={"new": 2})[0], ctx)
    with pytest.raises(StepNotAdmittedError, match="span=1"):
        manager.commit(declare([("new", Pos(3, 0, 0), 1)], tokens={"new": 2})[0], ctx)
    assert state(manager) == before
    manager.commit(unadmitted, ctx)
    assert manager.written("new") == 2


def test_an_aborted_step_cannot_be_committed(manager):
    ingest(manager, "a")
    _commit_first_step(manager, "a")
    step, ctx = declare([("a", Pos(3, 1, 0), 1)])
    admit_ok(manager, step, ctx)
    manager.abort_step(step, ctx)
    before = state(manager)
    with pytest.raises(StepNotAdmittedError):
        manager.commit(step, ctx)
    assert state(manager) == before
    assert manager.written("a") == 1


def test_plan_and_commit_of_a_never_ingested_request_are_typed_errors(manager):
    step, ctx = declare([("ghost", Pos(3, 0, 0), 1)])
    for call in (manager.plan, manager.commit):
        with pytest.raises(UnknownRequestError, match="'ghost' was never ingested"):
            call(step, ctx)
    assert isinstance(UnknownRequestError("x"), ValueError)


def test_a_refused_float_position_leaks_nothing_and_a_retry_succeeds(manager):
    ingest(manager, "a")
    before = state(manager)
    outcome = manager.admit(*declare([("a", Pos(3.0, 0, 0), 1)]))
    assert type(outcome.reason) is AdmitRuntimeError
    assert state(manager) == before
    assert manager.readers(0) == 0
    _commit_first_step(manager, "a")
    assert (manager.slot_of("a"), manager.readers(0)) == (0, 1)
    manager.remove_request("a")
    assert manager.readers(0) == 0
    manager.remove_source(0)  # no live reader is left behind to read it


def test_numpy_integer_positions_are_accepted(manager):
    ingest(manager, "a")
    step, ctx = declare([("a", Pos(np.int64(3), np.int32(0), np.int16(0)), np.int64(1))])
    admit_ok(manager, step, ctx)
    manager.commit(step, ctx)
    assert manager.written("a") == 1
    assert type(manager.written("a")) is int


def test_abort_step_returns_only_that_admits_slots(manager):
    ingest(manager, "a", "b")
    _commit_first_step(manager, "a")
    step, ctx = declare([("a", Pos(3, 1, 0), 1), ("b", Pos(4, 0, 1), 1)])
    admit_ok(manager, step, ctx)
    assert (manager.slot_of("a"), manager.slot_of("b"), manager.free_slots) == (0, 1, 1)
    manager.abort_step(step, ctx)
    assert (manager.slot_of("a"), manager.slot_of("b"), manager.free_slots) == (0, None, 2)
    assert manager.written("a") == 1
    manager.remove_source(1)  # "b" no longer reads it
    manager.register_source(1, list(SOURCES[1][0]), list(SOURCES[1][1]))
    admit_ok(manager, step, ctx)  # the aborted step can be admitted again, from scratch
    assert manager.slot_of("b") == 1


def test_remove_request_frees_the_slot_and_the_source(manager):
    ingest(manager, "a")
    admit_ok(manager, *declare([("a", Pos(4, 0, 1), 1)]))
    with pytest.raises(ValueError, match=r"source 1 is read by 1 live request\(s\); cannot remove it"):
        manager.remove_source(1)
    manager.remove_request("a")
    assert manager.free_slots == 3
    manager.remove_source(1)
    assert manager.source_length(1) is None
    manager.remove_request("a")  # removing twice (or an unknown id) is harmless
    manager.remove_request("never-seen")
    assert manager.free_slots == 3


def test_reset_request(manager):
    ingest(manager, "a")
    _commit_first_step(manager)
    manager.reset_request("a")
    assert (manager.written("a"), manager.slot_of("a")) == (0, 0)  # rewound, slot kept
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1)]))
    manager.reset_request("a", free=True)
    assert manager.slot_of("a") is None
    assert manager.free_slots == 3
    manager.remove_source(0)


def test_truncate_counts_fewer_entries_and_the_next_step_writes_there(manager):
    """A decode block that masked its last write (a stop token) committed 2 entries but wrote 1: after
    `truncate` the request's next step must declare 1, and declaring 2 is refused."""
    ingest(manager, "a")
    step, ctx = declare([("a", Pos(3, 0, 0), 2)])
    admit_ok(manager, step, ctx)
    manager.commit(step, ctx)
    assert manager.written("a") == 2
    manager.truncate("a", 1)
    assert (manager.written("a"), manager.slot_of("a")) == (1, 0)
    assert not manager.admit(*declare([("a", Pos(3, 2, 0), 1)])).ok
    admit_ok(manager, *declare([("a", Pos(3, 1, 0), 1)]))
    manager.remove_request("a")


@pytest.mark.parametrize(
    ("rid", "written", "error", "match"),
    [
        ("ghost", 0, UnknownRequestError, "request_id='ghost' is not a request of cache 'kv'"),
        ("a", 2, ValueError, r"written=2 must be an int in \[0, 1\]"),
        ("a", -1, ValueError, r"written=-1 must be an int in \[0, 1\]"),
        ("a", 0.5, ValueError, r"written=0.5 must be an int"),
        ("a", True, ValueError, r"written=True must be an int"),
    ],
)
def test_a_bad_truncate_is_refused_and_changes_nothing(manager, rid, written, error, match):
    ingest(manager, "a")
    _commit_first_step(manager)
    before = state(manager)
    with pytest.raises(error, match=match):
        manager.truncate(rid, written)
    assert state(manager) == before
    manager.remove_request("a")


def test_truncate_waits_for_no_step_admitted(manager):
    ingest(manager, "a")
    _commit_first_step(manager)
    admit_ok(manager, *declare([("a", Pos(3, 1, 0), 1)]))
    with pytest.raises(ValueError, match="'a' has a step admitted"):
        manager.truncate("a", 0)
    assert manager.written("a") == 1
    manager.remove_request("a")


# --- the source bank --------------------------------------------------------------------------------------


def test_register_source_stores_each_layer_padded(manager):
    k, v = _source(7, 2)
    bank_before = jax.device_get(manager.bank)
    manager.register_source(2, list(k), list(v))
    assert manager.source_length(2) == 2
    bank = jax.device_get(manager.bank)
    for layer in range(L):
        for new, x, old in (
            (bank.k[layer], k, bank_before.k[layer]),
            (bank.v[layer], v, bank_before.v[layer]),
        ):
            assert new.shape == (3, R, G, store_capacity(CFG.max_source_len, CFG.head_dim), D)
            np.testing.assert_array_equal(new[2, :, :, :2], x[layer])
            assert not new[2, :, :, 2:].any()  # padded past the source's length
            np.testing.assert_array_equal(new[:2], old[:2])  # other sources untouched


@pytest.mark.parametrize(
    ("index", "arrays", "message"),
    [
        (-1, _source(9, 2), "source index=-1 must be an int in [0, 3)"),
        (3, _source(9, 2), "source index=3 must be an int in [0, 3)"),
        (True, _source(9, 2), "source index=True must be an int in [0, 3)"),
        (1.0, _source(9, 2), "source index=1.0 must be an int in [0, 3)"),
        (2, (_source(9, 2)[0][:1],) * 2, "source k/v shapes (1, 2, 1, 2, 4)/(1, 2, 1, 2, 4) must"),
        (2, (_source(9, 2)[0][:, :1],) * 2, "both be [layers=2] x [rows=2, kv_heads=1, length, head_dim=4"),
        (2, (_source(9, 2)[0][..., :3],) * 2, "source k/v shapes (2, 2, 1, 2, 3)/(2, 2, 1, 2, 3)"),
        (2, (_source(9, 2)[0], _source(9, 3)[0]), "source k/v shapes (2, 2, 1, 2, 4)/(2, 2, 1, 3, 4)"),
        (2, _source(9, 0), "source length 0 is outside [min_source_len=1, max_source_len=4]"),
        (2, _source(9, 5), "source length 5 is outside [min_source_len=1, max_source_len=4]"),
    ],
    ids=[
        "negative", "past_the_bank", "bool", "float", "layers", "rows", "head_dim", "k_v_mismatch", "empty",
        "long",
    ],
)  # fmt: skip
def test_register_source_validates(manager, index, arrays, message):
    before = state(manager)
    with pytest.raises(ValueError, match=re.escape(message)):
        manager.register_source(index, list(arrays[0]), list(arrays[1]))
    assert state(manager) == before
    assert manager.source_length(2) is None


def test_replace_and_remove_a_source(manager):
    k, v = _source(11, 2)
    manager.register_source(0, list(k), list(v))  # replace: 3 tokens become 2
    assert manager.source_length(0) == 2
    np.testing.assert_array_equal(np.asarray(manager.bank.k[1][0, :, :, :2]), k[1])
    assert not np.asarray(manager.bank.k[1][0, :, :, 2:]).any()  # nothing of the old source is left
    ingest(manager, "a")
    outcome = manager.admit(*declare([("a", Pos(3, 0, 0), 1)]))
    assert outcome.reason.message == "'a' reads 3 tokens of source 0, which holds 2"
    manager.remove_source(0)
    assert manager.source_length(0) is None
    outcome = manager.admit(*declare([("a", Pos(2, 0, 0), 1)]))
    assert outcome.reason.message == "'a' reads source 0, which is not registered; registered: [1]"
    with pytest.raises(ValueError, match=re.escape("source 0 is not registered; registered: [1]")):
        manager.remove_source(0)


def test_a_source_in_use_can_be_neither_removed_nor_replaced(manager):
    ingest(manager, "a", "b")
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1), ("b", Pos(2, 0, 0), 1)]))
    before = state(manager), jax.device_get(manager.bank)
    with pytest.raises(
        ValueError, match=re.escape("source 0 is read by 2 live request(s); cannot remove it")
    ):
        manager.remove_source(0)
    k, v = _source(12, 3)
    with pytest.raises(
        ValueError, match=re.escape("source 0 is read by 2 live request(s); remove them before")
    ):
        manager.register_source(0, list(k), list(v))
    assert state(manager) == before[0]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(manager.bank), before[1])
    manager.offload("a")  # an offloaded request still reads its source
    manager.remove_request("b")
    with pytest.raises(ValueError, match=re.escape("source 0 is read by 1 live request(s)")):
        manager.remove_source(0)
    manager.remove_request("a")
    manager.register_source(0, list(k), list(v))
    manager.remove_source(0)


def test_requests_of_one_voice_share_one_source(manager):
    ingest(manager, "a", "b", "c")
    bank = manager.bank
    bank_bytes = sum(x.nbytes for x in jax.tree.leaves(bank))
    # Every slot NaN: a step that read any slot entry it did not write (or a copied source) goes NaN.
    manager.cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), manager.cache)
    entries = [(rid, Pos(4, 0, 1), 2) for rid in "abc"]
    q, k, v = step_inputs(5)
    out = run(manager, entries, 5, tokens=dict.fromkeys("abc", 2))
    assert manager.bank is bank  # nothing copied into, or grown in, the bank
    assert sum(x.nbytes for x in jax.tree.leaves(manager.bank)) == bank_bytes
    assert sorted(manager.slot_of(rid) for rid in "abc") == [0, 1, 2]
    with pytest.raises(ValueError, match=re.escape("source 1 is read by 3 live request(s)")):
        manager.remove_source(1)
    cache = jax.device_get(manager.cache)
    for b, rid in enumerate("abc"):
        rows = slice(b * R, (b + 1) * R)
        expected = first_step_reference(*SOURCES[1], 4, q[:, rows], k[:, rows], v[:, rows], 2)
        np.testing.assert_allclose(out[:, rows], expected, rtol=2e-5, atol=2e-5)
        # Position 4 is the sink's one written entry (offset 0), position 5 the ring's first (offset 1 +
        # (5 - 5) mod 3 = 1); the rest of the slot was never written and still holds NaN.
        slot = manager.slot_of(rid)
        for layer in range(L):
            written = cache.k[layer][slot, :, :, :2]  # [R, G, 2, D]
            np.testing.assert_array_equal(written, k[layer, rows].transpose(0, 2, 1, 3))
            assert np.isnan(cache.k[layer][slot, :, :, 2:]).all()
    assert np.isnan(cache.k[0][manager.padding_slot]).all()


def test_requests_read_the_registered_source_in_place(manager):
    q, k, v = step_inputs(3)
    ingest(manager, "a", "b")
    out_a = run(manager, [("a", Pos(3, 0, 0), 1)], 3, tokens={"a": 2})
    manager.remove_request("a")
    other = _source(13, 3)
    manager.register_source(0, list(other[0]), list(other[1]))
    out_b = run(manager, [("b", Pos(3, 0, 0), 1)], 3, tokens={"b": 2})  # same step, same slot, new voice
    rows = slice(0, R)
    np.testing.assert_allclose(
        out_a[:, rows],
        first_step_reference(*SOURCES[0], 3, q[:, rows], k[:, rows], v[:, rows], 2),
        rtol=2e-5,
        atol=2e-5,
    )
    np.testing.assert_allclose(
        out_b[:, rows],
        first_step_reference(*other, 3, q[:, rows], k[:, rows], v[:, rows], 2),
        rtol=2e-5,
        atol=2e-5,
    )
    assert np.abs(out_a - out_b).max() > 0.1


# --- offload and reload -----------------------------------------------------------------------------------


def _random_cache(seed: int) -> BoundedKVCache:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), BoundedKVCache.abstract(CFG)
    )


def test_offload_and_reload_restore_the_slot_bit_exactly(manager):
    ingest(manager, "a", "b")
    admit_ok(manager, *declare([("a", Pos(3, 0, 0), 1)]))
    manager.cache = _random_cache(0)
    before = jax.device_get(manager.cache)
    assert manager.offload("a") == CFG.slot_bytes
    assert manager.is_offloaded("a")
    assert (manager.slot_of("a"), manager.free_slots) == (None, 3)
    admit_ok(manager, *declare([("b", Pos(4, 0, 1), 1)]))
    assert manager.slot_of("b") == 0  # the offloaded request's slot went to another request
    manager.cache = _random_cache(1)  # "b" and everything else overwrite every slot
    overwritten = jax.device_get(manager.cache)
    assert manager.reload("a")
    assert not manager.is_offloaded("a")
    assert manager.slot_of("a") == 1
    after = jax.device_get(manager.cache)
    for old, mid, new in zip(
        before.k + before.v, overwritten.k + overwritten.v, after.k + after.v, strict=True
    ):
        np.testing.assert_array_equal(new[1].view(np.uint32), old[0].view(np.uint32))  # every bit
        np.testing.assert_array_equal(np.delete(new, 1, axis=0), np.delete(mid, 1, axis=0))


def test_an_offloaded_request_is_refused_until_reloaded(manager):
    ingest(manager, "a", "b", "c", "d")
    _commit_first_step(manager, "a")
    assert manager.offload("a") == CFG.slot_bytes
    assert manager.offload("a") == 0  # nothing left to reclaim
    assert manager.offload("unknown") == 0
    before = state(manager)
    step, ctx = declare([("a", Pos(3, 1, 0), 1)])
    outcome = manager.admit(step, ctx)
    assert (outcome.ok, outcome.ready) == (False, True)
    assert isinstance(outcome.reason, RequestOffloading)
    assert (outcome.reason.label, outcome.reason.request_id) == ("main", "a")
    assert outcome.reason.message == "bounded KV: 'a' is offloaded to host memory"
    assert state(manager) == before
    # The freed slot serves others; with every slot taken the reload waits.
    admit_ok(manager, *declare([(rid, Pos(3, 0, 0), 1) for rid in "bcd"]))
    assert not manager.reload("a")
    assert manager.is_offloaded("a")
    assert state(manager)[1]["a"][0] is None
    manager.remove_request("c")
    assert manager.reload("a")
    assert manager.slot_of("a") == 1
    assert manager.reload("a")  # already resident: nothing to do
    admit_ok(manager, step, ctx)
    assert manager.written("a") == 1


def test_a_stream_continues_after_reload_as_if_never_offloaded():
    def drive(manager: BoundedKVManager, moved: bool) -> list[np.ndarray]:
        ingest(manager, "r", "x")
        outs = []
        for i in range(5):  # the 3-entry ring wraps from the third step on
            if moved and i == 2:
                assert manager.offload("r") == CFG.slot_bytes
                run(manager, [("x", Pos(4, 0, 1), 2)], 100, tokens={"x": 2})  # "x" takes and writes slot 0
                assert manager.reload("r")
                assert manager.slot_of("r") == 1
            outs.append(run(manager, [("r", Pos(4, 2 * i, 1), 2)], i, tokens={"r": 2}))
        return outs

    for i, (steady, moved) in enumerate(
        zip(drive(new_manager(), False), drive(new_manager(), True), strict=True)
    ):
        assert np.isfinite(steady).all()
        np.testing.assert_array_equal(moved, steady, err_msg=f"step {i}")


# --- bugs found while writing these tests -----------------------------------------------------------------

ZERO_SOURCE_CFG = BoundedKVConfig(
    num_layers=1, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=4, retention=SinkWindow(2, 3),
    max_slots=2,
)  # fmt: skip


def test_a_negative_source_index_is_refused_at_admission():
    manager = new_manager(ZERO_SOURCE_CFG)
    ingest(manager, "a")
    outcome = manager.admit(*declare([("a", Pos(0, 0, -1), 1)], lease=False))
    assert not outcome.ok
    assert isinstance(outcome.reason, AdmitRuntimeError)


def test_a_request_without_a_source_does_not_block_the_bank():
    manager = new_manager(ZERO_SOURCE_CFG)
    ingest(manager, "a")
    admit_ok(manager, *declare([("a", Pos(0, 0, 1), 1)], lease=False))
    k = np.zeros((1, 1, 1, 2, 4), np.float32)
    manager.register_source(1, list(k), list(k))


def test_offload_of_a_zero_token_slot_reports_what_it_freed():
    config = BoundedKVConfig(
        num_layers=1, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=4, min_source_len=2,
        retention=lambda s: SinkWindow(s, 0), max_slots=1,
    )  # fmt: skip
    manager = new_manager(config)
    manager.register_source(0, [np.zeros((1, 1, 2, 4), np.float32)], [np.zeros((1, 1, 2, 4), np.float32)])
    ingest(manager, "a")
    admit_ok(manager, *declare([("a", Pos(2, 0, 0), 1)], lease=False))
    assert manager.offload("a") > 0
    assert manager.free_slots == 1


# --- recovery after a device fault ------------------------------------------------------------------------


def _lose_the_cache(manager: BoundedKVManager) -> None:
    """What a step that fails after its cache was donated leaves behind: deleted buffers."""
    for layer in manager.cache.k + manager.cache.v:
        layer.delete()
    assert manager.cache_lost()


def test_recover_without_a_snapshot_forgets_the_slot_holders_and_keeps_offloaded_requests(manager):
    ingest(manager, "a", "b", "parked", "idle")
    run(
        manager,
        [("a", Pos(3, 0, 0), 1), ("b", Pos(4, 0, 1), 1), ("parked", Pos(4, 0, 1), 2)],
        0,
        tokens={"parked": 2},
    )
    assert manager.offload("parked") == CFG.slot_bytes
    parked = state(manager)[1]["parked"]
    assert not manager.cache_lost()
    _lose_the_cache(manager)
    assert sorted(manager.recover()) == ["a", "b"]
    assert not manager.cache_lost()
    fresh_shapes = [x.shape for x in jax.tree.leaves(BoundedKVCache.create(CFG))]
    assert [x.shape for x in jax.tree.leaves(manager.cache)] == fresh_shapes
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(manager.cache))
    free, requests, readers, _ = state(manager)
    assert free == ((2, 1, 0),)
    assert requests == {"parked": parked, "idle": (None, 0, None, None, None, False)}
    assert readers == {1: 1}  # only the offloaded request still reads source 1
    assert manager.reload("parked")
    assert manager.slot_of("parked") == 0  # the slots are free again: serving goes on


def test_recover_from_a_snapshot_restores_entries_and_a_replay_repeats_every_output_bit_for_bit(manager):
    """Steps after the snapshot, lost and replayed, give exactly the outputs they gave the first time."""
    ingest(manager, "a", "b")
    run(manager, [("a", Pos(3, 0, 0), 2)], 0, tokens={"a": 2})
    run(manager, [("a", Pos(3, 2, 0), 1), ("b", Pos(4, 0, 1), 2)], 1, tokens={"b": 2})
    snapshot = manager.snapshot()
    at_snapshot = state(manager)
    assert snapshot.nbytes == manager.cache.nbytes
    later = [  # the ring (3 entries) wraps during these
        ([("a", Pos(3, 3, 0), 1), ("b", Pos(4, 2, 1), 1)], 2, None),
        ([("a", Pos(3, 4, 0), 2), ("b", Pos(4, 3, 1), 1)], 3, {"a": 2}),
    ]
    donated = manager.cache
    first = [run(manager, entries, seed, tokens=tokens) for entries, seed, tokens in later]
    assert all(layer.is_deleted() for layer in donated.k + donated.v)  # the snapshot pinned no buffer
    ingest(manager, "c")
    run(manager, [("c", Pos(3, 0, 0), 1)], 4)  # arrived after the snapshot
    _lose_the_cache(manager)
    assert sorted(manager.recover(snapshot, restore={"a", "b", "c"})) == ["a", "b", "c"]
    assert manager.slot_of("c") is None
    assert "c" not in state(manager)[1]  # the caller ingests it again to start over, or fails it
    assert state(manager) == at_snapshot
    for (entries, seed, tokens), out in zip(later, first, strict=True):
        np.testing.assert_array_equal(run(manager, entries, seed, tokens=tokens), out)


def test_recover_restores_only_the_requests_it_is_told_to(manager):
    ingest(manager, "a", "b")
    run(manager, [("a", Pos(3, 0, 0), 1), ("b", Pos(4, 0, 1), 1)], 0)
    snapshot = manager.snapshot()
    _lose_the_cache(manager)
    manager.recover(snapshot, restore={"a"})
    assert (manager.slot_of("a"), manager.written("a")) == (0, 1)
    assert "b" not in state(manager)[1]
    assert manager.free_slots == 2
    assert manager.readers(1) == 0
