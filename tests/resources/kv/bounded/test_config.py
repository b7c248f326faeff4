"""Bounded KV declarations: the seed's public names, SinkWindow and StreamPosition, BoundedKVConfig's
validation and capacities (against a brute-force stream simulation), BoundedKVSpec's YAML block, and
BoundedKVStep as a pytree under `jax.jit`."""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.resources.kv.bounded import config as config_module
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)
from mstar_jax.resources.spec import NodeResourceSpec, apply_yaml_overrides
from mstar_jax.resources.step import ResourceStep, Segment, SubmoduleStep
from tests.resources.seed_api import fields_and_defaults

MISSING = dataclasses.MISSING


def make(**overrides) -> BoundedKVConfig:
    """A small valid config, with `overrides` applied."""
    kwargs = {
        "num_layers": 2,
        "num_heads": 2,
        "head_dim": 4,
        "rows_per_request": 1,
        "max_source_len": 8,
        "retention": SinkWindow(2, 4),
    }
    return BoundedKVConfig(**{**kwargs, **overrides})


# --- every public name on the seed page ---------------------------------------------------------------------

SEED_CLASSES = ["BoundedKVConfig", "BoundedKVSpec", "BoundedKVStep", "SinkWindow", "StreamPosition"]

# (class, the seed's positional fields with defaults; MISSING: required, dict: a factory)
SEED_FIELDS = [
    (
        "BoundedKVConfig",
        [
            ("num_layers", MISSING),
            ("num_heads", MISSING),
            ("head_dim", MISSING),
            ("rows_per_request", MISSING),
            ("max_source_len", MISSING),
            ("retention", MISSING),
            ("max_slots", 32),
            ("min_source_len", 0),
            ("dtype", jnp.float32),
            ("reverse_step_order", False),
            ("query_window", None),
        ],
    ),
    ("BoundedKVSpec", [("resource_key", MISSING), ("nodes", MISSING), ("config", MISSING)]),
    ("BoundedKVStep", [("segments", None), ("positions", dict)]),
    ("SinkWindow", [("sink", MISSING), ("window", MISSING), ("window_includes_step", False)]),
    ("StreamPosition", [("source_len", MISSING), ("written", MISSING), ("source", 0)]),
]

SEED_MEMBERS = [
    ("BoundedKVConfig", "max_retained", "property"),
    ("BoundedKVConfig", "sink_capacity", "property"),
    ("BoundedKVConfig", "slot_tokens", "property"),
    ("BoundedKVConfig", "window_capacity", "property"),
    ("BoundedKVConfig", "retention_for", "method"),
    ("BoundedKVSpec", "apply_yaml_overrides", "method"),
    ("BoundedKVSpec", "resource_class", "property"),
]

SEED_BASES = [
    ("BoundedKVSpec", NodeResourceSpec),
    ("BoundedKVStep", ResourceStep),
    ("SinkWindow", tuple),
    ("StreamPosition", tuple),
]


@pytest.mark.parametrize("name", SEED_CLASSES)
def test_seed_classes_import(name):
    assert name in config_module.__all__
    assert isinstance(getattr(config_module, name), type)
    from mstar_jax.resources.kv import bounded

    assert getattr(bounded, name) is getattr(config_module, name)


@pytest.mark.parametrize(("name", "fields"), SEED_FIELDS, ids=[name for name, _ in SEED_FIELDS])
def test_seed_fields_in_order_with_defaults(name, fields):
    got = fields_and_defaults(getattr(config_module, name))
    assert got[: len(fields)] == fields


@pytest.mark.parametrize(("name", "member", "kind"), SEED_MEMBERS)
def test_seed_members(name, member, kind):
    attr = getattr(getattr(config_module, name), member)
    assert isinstance(attr, property | functools.cached_property) == (kind == "property")
    assert kind == "property" or callable(attr)


@pytest.mark.parametrize(("name", "base"), SEED_BASES)
def test_seed_bases(name, base):
    assert issubclass(getattr(config_module, name), base)


# --- SinkWindow, StreamPosition -----------------------------------------------------------------------------


def test_sink_window_and_stream_position():
    assert SinkWindow(3, 5) == (3, 5, False)
    policy = SinkWindow(3, 5, True)
    assert (policy.sink, policy.window, policy.window_includes_step) == (3, 5, True)
    assert StreamPosition(10, 4) == (10, 4, 0)
    pos = StreamPosition(10, 4, 2)
    assert (pos.source_len, pos.written, pos.source) == (10, 4, 2)


# --- BoundedKVConfig: fields and validation -----------------------------------------------------------------


def test_configfields_and_defaults():
    cfg = make()
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.rows_per_request) == (2, 2, 4, 1)
    assert (cfg.max_source_len, cfg.retention) == (8, SinkWindow(2, 4))
    assert cfg.max_slots == 32
    assert cfg.min_source_len == 0
    assert cfg.dtype == np.dtype(np.float32)
    assert cfg.reverse_step_order is False
    assert cfg.query_window is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_slots = 4


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, np.float32),
        (jnp.float32, np.float32),
        ("float32", np.float32),
        (jnp.bfloat16, jnp.bfloat16),
        (np.float16, np.float16),
    ],
)
def test_dtype_is_resolved(dtype, expected):
    assert make(dtype=dtype).dtype == np.dtype(expected)


def test_slot_bytes_count_the_entries_the_cache_arrays_hold():
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        cfg = make(dtype=dtype)  # 2 layers x 8 entries (one tile) x 1 row x 2 heads x (K, V) x 4 dims
        assert cfg.slot_bytes == 2 * 8 * 1 * 2 * 2 * 4 * itemsize


def test_the_largest_int32_retention_and_source_are_accepted():
    cfg = make(retention=SinkWindow(2**31 - 2, 1), max_source_len=2**31 - 1, query_window=2**31 - 1)
    assert cfg.max_retained == 2**31 - 1
    assert cfg.retention_for(2**31 - 1) == SinkWindow(2**31 - 2, 1)


def test_numpy_integers_are_accepted():
    cfg = make(num_layers=np.int64(3), max_source_len=np.int32(5), max_slots=np.int64(2))
    assert (cfg.num_layers, cfg.max_source_len, cfg.max_slots) == (3, 5, 2)


def test_reverse_step_order_and_query_window_each_alone():
    assert make(reverse_step_order=True).reverse_step_order is True
    assert make(query_window=1).query_window == 1
    assert make(query_window=16).query_window == 16


BAD_CONFIGS = [
    # Sizes are ints >= 1; a bool is not an int here.
    *[
        ({name: 0}, f"{name}=0 must be an int >= 1")
        for name in ("num_layers", "num_heads", "head_dim", "rows_per_request", "max_slots")
    ],
    ({"num_heads": -1}, "num_heads=-1 must be an int >= 1"),
    ({"num_layers": True}, "num_layers=True must be an int >= 1"),
    ({"head_dim": 4.0}, "head_dim=4.0 must be an int >= 1"),
    ({"rows_per_request": "2"}, "rows_per_request='2' must be an int >= 1"),
    ({"max_slots": True}, "max_slots=True must be an int >= 1"),
    ({"max_slots": None}, "max_slots=None must be an int >= 1"),
    # Source lengths are ints >= 0 with min <= max.
    ({"max_source_len": -1}, "max_source_len=-1 must be an int in [0, 2147483647]"),
    ({"max_source_len": False}, "max_source_len=False must be an int in [0, 2147483647]"),
    ({"min_source_len": -1}, "min_source_len=-1 must be an int >= 0"),
    ({"min_source_len": True}, "min_source_len=True must be an int >= 0"),
    ({"min_source_len": 9}, "min_source_len=9 must be <= max_source_len=8"),
    # query_window is None or an int >= 1, and excludes reverse_step_order.
    ({"query_window": 0}, "query_window=0 must be an int in [1, 2147483647]"),
    ({"query_window": -2}, "query_window=-2 must be an int in [1, 2147483647]"),
    ({"query_window": True}, "query_window=True must be an int in [1, 2147483647]"),
    ({"query_window": 1.5}, "query_window=1.5 must be an int in [1, 2147483647]"),
    ({"reverse_step_order": True, "query_window": 2}, "reverse_step_order=True with query_window=2"),
    ({"reverse_step_order": 1}, "reverse_step_order=1 must be a bool"),
    ({"reverse_step_order": "yes"}, "reverse_step_order='yes' must be a bool"),
    # A real floating dtype.
    ({"dtype": jnp.int32}, "must be a floating dtype"),
    ({"dtype": np.bool_}, "must be a floating dtype"),
    ({"dtype": np.complex64}, "must be a floating dtype"),
    ({"dtype": "nope"}, "dtype='nope' is not a dtype; use one of float32, bfloat16, float16"),
    # Only what the cache stores: a float64 config would count 8-byte entries in float32 arrays.
    (
        {"dtype": jnp.float64},
        "dtype=<class 'jax.numpy.float64'> must be a floating dtype the cache stores (float32, bfloat16, "
        "float16), not float64",
    ),
    ({"dtype": "float64"}, "dtype='float64' must be a floating dtype the cache stores"),
    ({"dtype": np.int32}, "(float32, bfloat16, float16), not int32"),
    # Positions are int32: a sink, window, source or band past 2**31 - 1 is refused, not overflowed.
    ({"retention": SinkWindow(2**31, 4)}, "retention(0).sink=2147483648 must be an int in [0, 2147483647]"),
    ({"retention": SinkWindow(2, 2**31)}, "retention(0).window=2147483648 must be an int in [0, 2147483647]"),
    (
        {"retention": SinkWindow(2**30, 2**30)},
        "retention(0) keeps sink=1073741824 + window=1073741824 = 2147483648 entries; the sum must be <= "
        "2147483647 (positions are int32)",
    ),
    (
        {"retention": lambda s: SinkWindow(s + 2**31 - 9, 1)},
        "retention(8) keeps sink=2147483647 + window=1 = 2147483648 entries",
    ),
    ({"max_source_len": 2**31}, "max_source_len=2147483648 must be an int in [0, 2147483647]"),
    ({"query_window": 2**31}, "query_window=2147483648 must be an int in [1, 2147483647]"),
    # Retention: a SinkWindow or a callable returning one, non-negative, never shrinking.
    ({"retention": 5}, "retention=5 must be a SinkWindow or a callable"),
    ({"retention": SinkWindow(-1, 2)}, "retention(0).sink=-1 must be an int in [0, 2147483647]"),
    ({"retention": SinkWindow(1, -2)}, "retention(0).window=-2 must be an int in [0, 2147483647]"),
    ({"retention": SinkWindow(True, 2)}, "retention(0).sink=True must be an int in [0, 2147483647]"),
    ({"retention": SinkWindow(1, 2.0)}, "retention(0).window=2.0 must be an int in [0, 2147483647]"),
    ({"retention": SinkWindow(1, 2, 1)}, "retention(0).window_includes_step=1 must be a bool"),
    ({"retention": lambda s: (1, 2, False, 4)}, "retention(0)=(1, 2, False, 4) must be a SinkWindow"),
    ({"retention": lambda s: "x"}, "retention(0)='x' must be a SinkWindow"),
    ({"retention": lambda s: SinkWindow(1, 2) if s < 5 else SinkWindow(-1, 2)}, "retention(5).sink=-1"),
    (
        {"retention": lambda s: SinkWindow(10 - s, 4)},
        "retention shrinks as the source grows: retention(0)=(10, 4, False) but retention(1)=(9, 4, False); "
        "sink and window must not decrease",
    ),
    (
        {"retention": lambda s: SinkWindow(2, 4 if s < 6 else 3), "min_source_len": 3},
        "retention(5)=(2, 4, False) but retention(6)=(2, 3, False)",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(**overrides)


def test_retention_is_tabulated_over_the_allowed_source_range_only():
    calls = []

    def retention(source_len):
        calls.append(source_len)
        return (source_len, 3)  # a plain tuple is accepted and stored as a SinkWindow

    cfg = make(retention=retention, min_source_len=2, max_source_len=6)
    assert calls == [2, 3, 4, 5, 6]
    assert cfg.retention is retention
    for s in range(2, 7):
        policy = cfg.retention_for(s)
        assert type(policy) is SinkWindow
        assert policy == SinkWindow(s, 3, False)
    assert calls == [2, 3, 4, 5, 6]  # retention_for reads the table


def test_constant_retention():
    cfg = make(retention=SinkWindow(3, 5, True), min_source_len=1, max_source_len=4)
    assert [cfg.retention_for(s) for s in range(1, 5)] == [SinkWindow(3, 5, True)] * 4


def test_constant_retention_needs_no_table_whatever_the_source_range():
    # 2**31 source lengths: tabulating them would never finish. One run, closed-form capacities.
    cfg = make(retention=SinkWindow(30, 5), min_source_len=10, max_source_len=2**31 - 1)
    assert cfg.sink_capacity == 30 - 10  # largest at the shortest source
    assert cfg.window_capacity == 5
    assert cfg.max_retained == 30 + 5
    assert cfg.retention_for(10) == cfg.retention_for(2**31 - 1) == SinkWindow(30, 5)
    assert (
        make(retention=SinkWindow(30, 5), min_source_len=10**9, max_source_len=2**31 - 1).sink_capacity == 0
    )
    assert cfg == make(retention=SinkWindow(30, 5), min_source_len=10, max_source_len=2**31 - 1)


def test_callable_retention_over_too_many_lengths_is_refused_before_any_call():
    calls = []

    def retention(source_len):
        calls.append(source_len)
        return SinkWindow(source_len + 4, 32)

    bound = config_module.MAX_TABULATED_SOURCE_LENGTHS
    assert bound == 2**16
    with pytest.raises(ValueError, match="max_source_len=100000000") as info:
        make(retention=retention, min_source_len=8, max_source_len=100_000_000)
    assert str(info.value).startswith(
        "max_source_len=100000000 and min_source_len=8 span 99,999,993 source lengths, but a callable "
        "retention is tabulated at each and at most MAX_TABULATED_SOURCE_LENGTHS=65,536 are allowed"
    )
    assert calls == []
    with pytest.raises(ValueError, match="span 65,537 source lengths"):
        make(retention=retention, min_source_len=1, max_source_len=bound + 1)
    assert calls == []
    # Exactly the bound is tabulated, one call per length.
    cfg = make(retention=retention, min_source_len=1, max_source_len=bound)
    assert len(calls) == bound
    assert (cfg.sink_capacity, cfg.window_capacity, cfg.max_retained) == (4, 32, bound + 4 + 32)


def test_retention_for_reads_runs_of_equal_policies():
    def retention(source_len):
        # Runs: [0, 3) -> (2, 4), [3, 7) -> (5, 4), 7 -> (5, 6), [8, 12] -> (9, 6, True).
        if source_len < 3:
            return SinkWindow(2, 4)
        if source_len < 7:
            return SinkWindow(5, 4)
        return SinkWindow(5, 6) if source_len == 7 else SinkWindow(9, 6, True)

    cfg = make(retention=retention, max_source_len=12)
    assert [cfg.retention_for(s) for s in range(13)] == [retention(s) for s in range(13)]
    # The written sink is largest where a run starts: 2 - 0, 5 - 3, 5 - 7, 9 - 8.
    assert (cfg.sink_capacity, cfg.window_capacity, cfg.max_retained) == (2, 6, 15)


@pytest.mark.parametrize("source_len", [-1, 1, 9, 100])
def test_retention_for_refuses_lengths_out_of_range(source_len):
    cfg = make(min_source_len=2)
    with pytest.raises(
        ValueError,
        match=re.escape(f"source_len={source_len} is outside [min_source_len=2, max_source_len=8]"),
    ):
        cfg.retention_for(source_len)


@pytest.mark.parametrize("source_len", [1.5, "3"])
def test_retention_for_refuses_non_integers_by_name(source_len):
    with pytest.raises(ValueError, match="source_len="):
        make().retention_for(source_len)


# --- capacities against a brute-force stream simulation ----------------------------------------------------

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def simulate_capacities(policy_of, min_source_len: int, max_source_len: int) -> dict[str, int]:
    """Walk every stream a request can have and count what a slot must hold.

    For each source length `s` and each stream length `n`, the retained positions are
    `[0, min(sink, n)) ∪ [max(sink, n - window), n)` (docs/design.md §3, a reading step). Of those, positions
    `< s` live in the source; `[s, sink)` are the written sink; positions `>= max(sink, s)` are in
    the ring. The capacities are the largest counts seen.
    """
    sink_cap = window_cap = most_retained = 0
    for s in range(min_source_len, max_source_len + 1):
        sink, window, _ = policy_of(s)
        for n in range(s, s + sink + window + 3):
            retained = set(range(min(sink, n))) | set(range(max(sink, n - window), n))
            written_sink = [p for p in retained if s <= p < sink]
            ring = [p for p in retained if p >= max(sink, s)]
            assert len(written_sink) + len(ring) == len([p for p in retained if p >= s])
            sink_cap = max(sink_cap, len(written_sink))
            window_cap = max(window_cap, len(ring))
            most_retained = max(most_retained, len(retained))
    return {"sink_capacity": sink_cap, "window_capacity": window_cap, "max_retained": most_retained}


def _random_config(rng: np.random.Generator):
    """A config with random sizes and a random non-shrinking policy, plus the policy as a plain dict."""
    lo = int(rng.integers(0, 7))
    hi = lo + int(rng.integers(0, 9))
    sink, window = int(rng.integers(0, 10)), int(rng.integers(0, 10))
    includes_step = bool(rng.integers(0, 2))
    table = {}
    for s in range(lo, hi + 1):
        table[s] = SinkWindow(sink, window, includes_step)
        sink += int(rng.choice([0, 0, 0, 1, 3]))
        window += int(rng.choice([0, 0, 1, 2]))
    constant = rng.integers(0, 4) == 0
    retention = table[lo] if constant else table.__getitem__
    dtype = str(rng.choice(list(ITEMSIZE)))
    sizes = {
        name: int(rng.integers(1, 4)) for name in ("num_layers", "num_heads", "head_dim", "rows_per_request")
    }
    cfg = BoundedKVConfig(
        **sizes,
        max_source_len=hi,
        min_source_len=lo,
        retention=retention,
        dtype=dtype,
        max_slots=int(rng.integers(1, 5)),
    )
    policy_of = (lambda s: table[lo]) if constant else table.__getitem__
    return cfg, policy_of, sizes, dtype


@pytest.mark.parametrize("seed", range(8))
def test_capacities_equal_a_brute_force_stream_simulation(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        cfg, policy_of, sizes, dtype = _random_config(rng)
        expected = simulate_capacities(policy_of, cfg.min_source_len, cfg.max_source_len)
        assert cfg.sink_capacity == expected["sink_capacity"]
        assert cfg.window_capacity == expected["window_capacity"]
        assert cfg.max_retained == expected["max_retained"]
        slot_tokens = expected["sink_capacity"] + expected["window_capacity"]
        assert cfg.slot_tokens == slot_tokens
        # Allocated in whole tiles: 8 entries, or 128 where D is no multiple of 128 and the slot spans
        # more than one lane tile; at least 8.
        tile = 128 if sizes["head_dim"] % 128 and slot_tokens > 128 else 8
        capacity = max(8, -(-slot_tokens // tile) * tile)
        assert cfg.slot_capacity == capacity
        # K and V, for every layer, row, head and head dim element.
        per_token = sizes["rows_per_request"] * sizes["num_heads"] * 2 * sizes["head_dim"] * ITEMSIZE[dtype]
        assert cfg.slot_bytes == sizes["num_layers"] * capacity * per_token


@pytest.mark.parametrize(
    ("retention", "lo", "hi", "sink_capacity", "window_capacity", "max_retained"),
    [
        # The DiT case: a constant sink of 100 over voices of 60..302 frames; the 60-frame voice writes
        # 100 - 60 = 40 sink entries, although sizing at max_source_len alone would give 0.
        (SinkWindow(100, 120), 60, 302, 40, 120, 220),
        # enc1 = SinkWindow(P + 50, 0): every voice writes exactly 50 sink entries, no ring.
        (lambda p: SinkWindow(p + 50, 0), 10, 151, 50, 0, 151 + 50),
        # enc2 = SinkWindow(2P, 100): the written sink is P, largest at P = 151.
        (lambda p: SinkWindow(2 * p, 100), 10, 151, 151, 100, 302 + 100),
        # No source at all: everything retained is written.
        (SinkWindow(4, 16), 0, 0, 4, 16, 20),
        # A source longer than the sink: nothing of the sink is written.
        (SinkWindow(4, 16), 5, 9, 0, 16, 20),
    ],
    ids=["dit", "enc1", "enc2", "no-source", "sink-inside-source"],
)
def test_capacities_hand_computed(retention, lo, hi, sink_capacity, window_capacity, max_retained):
    cfg = make(retention=retention, min_source_len=lo, max_source_len=hi)
    assert (cfg.sink_capacity, cfg.window_capacity, cfg.max_retained) == (
        sink_capacity,
        window_capacity,
        max_retained,
    )
    assert cfg.slot_tokens == sink_capacity + window_capacity
    # 2 layers x slot tokens (in tiles of 8, or of 128 past 128 tokens: D = 4) x 1 row x 2 heads
    # x (K and V) x 4 dims x 4 bytes.
    tokens = sink_capacity + window_capacity
    tile = 128 if tokens > 128 else 8
    capacity = max(8, -(-tokens // tile) * tile)
    assert cfg.slot_bytes == 2 * capacity * 1 * 2 * 2 * 4 * 4


# --- equality and hashing -----------------------------------------------------------------------------------


def test_configs_compare_by_tabulated_retention():
    constant = make(retention=SinkWindow(2, 4))
    same_callable = make(retention=lambda s: SinkWindow(2, 4))
    # Differs only past max_source_len=8, which no request can reach.
    same_in_range = make(retention=lambda s: SinkWindow(2, 4) if s <= 8 else SinkWindow(50, 50))
    for other in (same_callable, same_in_range):
        assert constant == other
        assert hash(constant) == hash(other)
    assert make(retention=lambda s: SinkWindow(s, 4)) == make(retention=lambda s: SinkWindow(s, 4))
    assert make(retention=lambda s: SinkWindow(s, 4)) != make(retention=lambda s: SinkWindow(s + 1, 4))
    assert constant != make(retention=SinkWindow(2, 4, True))
    assert make(dtype=None) == make(dtype="float32") == make(dtype=jnp.float32)
    assert len({constant, same_callable, same_in_range, make(dtype="float32")}) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"max_slots": 4},
        {"min_source_len": 1},
        {"max_source_len": 9},
        {"dtype": jnp.bfloat16},
        {"reverse_step_order": True},
        {"query_window": 3},
        {"num_layers": 3},
        {"rows_per_request": 2},
    ],
    ids=lambda change: next(iter(change)),
)
def test_configs_differ_by_every_field(change):
    assert make() != make(**change)


def test_config_is_not_equal_to_other_objects():
    assert make() != "config"
    assert make() != dataclasses.astuple(make())


def test_replace_revalidates_and_keeps_the_original():
    cfg = make(retention=lambda s: SinkWindow(s, 4))
    bigger = dataclasses.replace(cfg, max_slots=64)
    assert bigger.max_slots == 64
    assert cfg.max_slots == 32
    assert bigger.retention_for(3) == SinkWindow(3, 4)
    with pytest.raises(ValueError, match="max_slots=0 must be an int >= 1"):
        dataclasses.replace(cfg, max_slots=0)


# --- BoundedKVSpec ------------------------------------------------------------------------------------------


def test_spec_fields():
    spec = BoundedKVSpec("kv", ["dit", "enc"], make())
    assert spec.resource_key == "kv"
    assert spec.nodes == {"dit", "enc"}
    assert spec.config == make()
    assert spec.depends_on() == set()
    assert spec == BoundedKVSpec("kv", ("enc", "dit"), make(retention=lambda s: SinkWindow(2, 4)))
    assert hash(spec) == hash(BoundedKVSpec("kv", {"enc", "dit"}, make()))


def test_spec_config_must_be_a_bounded_kv_config():
    with pytest.raises(TypeError, match=r"config=\{'max_slots': 4\} must be a BoundedKVConfig"):
        BoundedKVSpec("kv", ["n"], {"max_slots": 4})


def test_spec_resource_class_is_the_manager():
    from mstar_jax.resources.kv.bounded import manager

    assert BoundedKVSpec("kv", ["n"], make()).resource_class is manager.BoundedKVManager


def test_yaml_max_slots_returns_a_patched_spec():
    retention = lambda s: SinkWindow(s, 4)  # noqa: E731
    spec = BoundedKVSpec("kv", ["n"], make(retention=retention, max_source_len=6))
    patched = spec.apply_yaml_overrides(max_slots=5)
    assert patched.config.max_slots == 5
    assert dataclasses.replace(patched.config, max_slots=32) == spec.config
    assert patched.config.retention is retention
    assert (patched.resource_key, patched.nodes) == ("kv", {"n"})
    assert spec.config.max_slots == 32  # frozen: the original is unchanged
    assert spec.apply_yaml_overrides(5) == patched
    assert spec.apply_yaml_overrides() is spec
    assert spec.apply_yaml_overrides(max_slots=None) is spec


@pytest.mark.parametrize(
    ("block", "shown"),
    [
        ({"max_num_pages": 4}, "['max_num_pages']"),
        ({"window": 4, "sink": 2, "max_slots": 3}, "['sink', 'window']"),
    ],
)
def test_yaml_refuses_other_keys_naming_the_resource_and_max_slots(block, shown):
    spec = BoundedKVSpec("dit_kv", ["n"], make())
    with pytest.raises(
        TypeError, match=r"resource 'dit_kv' .*" + re.escape(shown) + r".*accepts \['max_slots'\]"
    ):
        spec.apply_yaml_overrides(**block)


@pytest.mark.parametrize("max_slots", [0, -1, True, 2.5, "4"])
def test_yaml_refuses_invalid_max_slots(max_slots):
    spec = BoundedKVSpec("kv", ["n"], make())
    with pytest.raises(ValueError, match=re.escape(f"max_slots={max_slots!r} must be an int >= 1")):
        spec.apply_yaml_overrides(max_slots=max_slots)


def test_two_pools_are_tuned_on_their_own():
    dec, enc = BoundedKVSpec("dec_kv", ["dec"], make()), BoundedKVSpec("enc_kv", ["enc"], make())
    patched = apply_yaml_overrides([dec, enc], {"resources": {"enc_kv": {"max_slots": 2}, "dec_kv": {}}})
    assert [spec.config.max_slots for spec in patched] == [32, 2]
    assert patched[0] == dec
    with pytest.raises(ValueError, match="max_slots=0 must be an int >= 1"):
        apply_yaml_overrides([dec, enc], {"resources": {"enc_kv": {"max_slots": 0}}})


# --- declarations are static under jit ----------------------------------------------------------------------


def test_spec_and_config_are_leafless_pytrees():
    spec = BoundedKVSpec("kv", ["n"], make(retention=lambda s: SinkWindow(s, 4)))
    for obj in (spec, spec.config):
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        assert leaves == []
        assert jax.tree_util.tree_unflatten(treedef, leaves) == obj


def test_equal_specs_trace_once():
    chex.clear_trace_counter()

    def scaled(spec, x):
        return x * spec.config.slot_tokens

    run = jax.jit(chex.assert_max_traces(scaled, n=2))
    x = np.float32(1.0)
    # Equal specs (distinct retention callables that tabulate alike) share one program.
    assert run(BoundedKVSpec("kv", ["n"], make(retention=lambda s: SinkWindow(2, 4))), x) == 6.0
    assert run(BoundedKVSpec("kv", ("n",), make(retention=SinkWindow(2, 4))), x) == 6.0
    # A different spec is a different program; a third would exceed n=2 and fail.
    assert run(BoundedKVSpec("kv", ["n"], make(retention=SinkWindow(2, 5))), x) == 7.0
    assert run(BoundedKVSpec("kv", ["n"], make(retention=SinkWindow(2, 4))), x) == 6.0


def test_config_as_a_static_argument():
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def scaled(cfg, x):
        traces.append(cfg)
        return x * cfg.max_retained

    x = np.float32(1.0)
    assert scaled(make(), x) == 6.0
    assert scaled(make(retention=lambda s: SinkWindow(2, 4)), x) == 6.0
    assert len(traces) == 1


# --- BoundedKVStep ------------------------------------------------------------------------------------------


def _step(spans=(2, 0), written=(5, 7), rids=("a", "b")) -> BoundedKVStep:
    return BoundedKVStep(
        tuple(Segment(rid, "main", span) for rid, span in zip(rids, spans, strict=True)),
        {rid: (3, w, i) for i, (rid, w) in enumerate(zip(rids, written, strict=True))},
    )


def test_step_defaults_and_normalisation():
    step = BoundedKVStep()
    assert step.segments is None
    assert step.positions == {}
    step = BoundedKVStep([Segment("a", "main", 1)], [("a", (3, 4))])
    assert step.segments == (Segment("a", "main", 1),)
    assert step.positions == {"a": StreamPosition(3, 4, 0)}
    assert type(step.positions["a"]) is StreamPosition
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.positions = {}


def test_submodule_step_inherits_segments_into_a_bounded_step():
    step = BoundedKVStep(positions={"a": StreamPosition(0, 2)})
    sub = SubmoduleStep({"kv": step}, [Segment("a", "main", 1)])
    assert sub.steps["kv"] == BoundedKVStep((Segment("a", "main", 1),), {"a": StreamPosition(0, 2)})


def test_step_flattens_to_spans_and_positions():
    step = _step()
    leaves, treedef = jax.tree_util.tree_flatten(step)
    # spans, then each position's (source_len, written, source).
    assert leaves == [2, 0, 3, 5, 0, 3, 7, 1]
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt == step
    assert type(rebuilt.positions["b"]) is StreamPosition
    shifted = jax.tree_util.tree_map(lambda x: x + 1, step)
    assert shifted.segments == (Segment("a", "main", 3), Segment("b", "main", 1))
    assert shifted.positions == {"a": StreamPosition(4, 6, 1), "b": StreamPosition(4, 8, 2)}
    # Per-request token counts (beyond the seed) are data too.
    with_tokens = dataclasses.replace(step, step_tokens={"a": 4})
    assert jax.tree_util.tree_leaves(with_tokens) == [*leaves, 4]
    assert jax.tree_util.tree_map(lambda x: x, with_tokens) == with_tokens


def test_jitted_step_function_takes_spans_and_positions_as_data():
    traces = []

    @jax.jit
    def stream_ends(step):
        traces.append(step)
        # Where each request's stream ends after this step: source_len + written + span.
        return jnp.stack(
            [
                step.positions[seg.request_id].source_len + step.positions[seg.request_id].written + seg.span
                for seg in step.segments
            ]
        )

    np.testing.assert_array_equal(stream_ends(_step(spans=(2, 0), written=(5, 7))), [10, 10])
    np.testing.assert_array_equal(stream_ends(_step(spans=(1, 4), written=(9, 0))), [13, 7])
    assert len(traces) == 1
    traced = traces[0]
    for value in (
        *[seg.span for seg in traced.segments],
        *[v for pos in traced.positions.values() for v in pos],
    ):
        assert isinstance(value, jax.Array)
        assert not isinstance(value, int)
    assert traced.request_ids() == ("a", "b")  # ids stay static
    # A different batch of requests is a different program.
    stream_ends(_step(rids=("a", "c")))
    assert len(traces) == 2


def test_a_retention_callable_that_raises_is_named_with_the_source_length():
    def retention(source_len):
        if source_len == 7:
            raise KeyError("no policy")
        return SinkWindow(source_len, 4)

    message = (
        r"retention\(7\) raised KeyError\('no policy'\); it must return a SinkWindow for every source "
        r"length in \[min_source_len=2, max_source_len=9\]"
    )
    with pytest.raises(ValueError, match=message):
        BoundedKVConfig(
            num_layers=1,
            num_heads=1,
            head_dim=8,
            rows_per_request=1,
            max_source_len=9,
            min_source_len=2,
            retention=retention,
        )
