"""Resource specs: the seed's public names, NodeResourceSpec, ResourceReqConfig, CombinedSplit, the
dependency checks and the deployment's `resources:` YAML block."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import ClassVar

import jax
import numpy as np
import pytest

from mstar_jax.resources import spec as spec_module
from mstar_jax.resources.spec import (
    CombinedSplit,
    NodeResourceSpec,
    ResourceReqConfig,
    apply_yaml_overrides,
    resolve_spec_dependencies,
    spec_dependency_problems,
    unknown_overrides_message,
)

MISSING = dataclasses.MISSING


# --- test specs ---------------------------------------------------------------------------------------------


class Builder:
    """Stands in for a Resource class: specs only name their builder."""


@dataclasses.dataclass(frozen=True)
class PlainSpec(NodeResourceSpec):
    """A spec with no tunables (the base `apply_yaml_overrides`) and declared dependencies."""

    deps: frozenset[str] = frozenset()

    @property
    def resource_class(self):
        return Builder

    def depends_on(self) -> set[str]:
        return set(self.deps)


@dataclasses.dataclass(frozen=True)
class TunableSpec(NodeResourceSpec):
    """A spec that accepts exactly `size` and `mode` from YAML, the way subclasses are meant to."""

    size: int = 1
    mode: str = "a"

    YAML_KEYS: ClassVar[tuple[str, ...]] = ("size", "mode")

    @property
    def resource_class(self):
        return Builder

    def apply_yaml_overrides(self, size: int | None = None, mode: str | None = None, **unknown):
        self._reject_unknown_yaml_keys(unknown)
        changes = {k: v for k, v in {"size": size, "mode": mode}.items() if v is not None}
        return dataclasses.replace(self, **changes)


def plain(key: str, *deps: str) -> PlainSpec:
    return PlainSpec(key, {"node"}, frozenset(deps))


# --- every public name on the seed page ---------------------------------------------------------------------

# (owner, name, kind, default): kind is "function", "class", "field" (default MISSING when required),
# "method", "property" or "abstract property", as the seed page lists them.
SEED_NAMES = [
    (None, "apply_yaml_overrides", "function", None),
    (None, "resolve_spec_dependencies", "function", None),
    (None, "spec_dependency_problems", "function", None),
    (None, "unknown_overrides_message", "function", None),
    (None, "CombinedSplit", "class", None),
    (None, "NodeResourceSpec", "class", None),
    (None, "ResourceReqConfig", "class", None),
    ("CombinedSplit", "combined_walk", "field", MISSING),
    ("CombinedSplit", "prefill_walks", "field", MISSING),
    ("CombinedSplit", "max_prefill_rows", "method", None),
    ("NodeResourceSpec", "resource_key", "field", MISSING),
    ("NodeResourceSpec", "nodes", "field", MISSING),
    ("NodeResourceSpec", "apply_yaml_overrides", "method", None),
    ("NodeResourceSpec", "depends_on", "method", None),
    ("NodeResourceSpec", "resource_class", "abstract property", None),
    ("ResourceReqConfig", "apply_conductor_config", "method", None),
    ("ResourceReqConfig", "loop_room", "method", None),
    ("ResourceReqConfig", "validate", "method", None),
]

# The seed's positional signatures, kept (STYLE: the seed's classes keep the seed's positional signatures).
SEED_FIELD_ORDER = {
    "CombinedSplit": ("combined_walk", "prefill_walks"),
    "NodeResourceSpec": ("resource_key", "nodes"),
}


def check_seed_name(module, owner, name, kind, default):
    """Assert `module` exposes `owner.name` as the seed page lists it."""
    if owner is None:
        obj = getattr(module, name)
        assert name in module.__all__
        assert isinstance(obj, type) if kind == "class" else callable(obj) and not isinstance(obj, type)
        return
    cls = getattr(module, owner)
    if kind == "field":
        if hasattr(cls, "_fields"):  # NamedTuple
            assert name in cls._fields
            assert cls._field_defaults.get(name, MISSING) == default
        else:
            field = {f.name: f for f in dataclasses.fields(cls)}[name]
            if default is dict:
                assert field.default_factory is dict
            else:
                assert field.default == default
        return
    attr = getattr(cls, name)
    if kind == "method":
        assert callable(attr)
        assert not isinstance(attr, property)
    else:
        assert isinstance(attr, property | functools.cached_property)
        assert getattr(attr, "__isabstractmethod__", False) == (kind == "abstract property")


@pytest.mark.parametrize(("owner", "name", "kind", "default"), SEED_NAMES)
def test_seed_names_import(owner, name, kind, default):
    check_seed_name(spec_module, owner, name, kind, default)


@pytest.mark.parametrize(("owner", "order"), SEED_FIELD_ORDER.items())
def test_seed_positional_field_order(owner, order):
    fields = tuple(f.name for f in dataclasses.fields(getattr(spec_module, owner)))
    assert fields[: len(order)] == order


# --- NodeResourceSpec ---------------------------------------------------------------------------------------


def test_node_resource_spec_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        NodeResourceSpec("kv", {"node"})

    @dataclasses.dataclass(frozen=True)
    class NoBuilder(NodeResourceSpec):
        pass

    with pytest.raises(TypeError, match="resource_class"):
        NoBuilder("kv", {"node"})


@pytest.mark.parametrize(
    "nodes",
    [["a", "b"], ("b", "a"), {"a", "b"}, frozenset("ab"), (n for n in "aba"), {"a": 1, "b": 2}.keys()],
    ids=["list", "tuple", "set", "frozenset", "generator", "keys"],
)
def test_nodes_from_any_iterable(nodes):
    spec = PlainSpec("kv", nodes)
    assert spec.nodes == {"a", "b"}
    assert isinstance(spec.nodes, frozenset)  # a set field would make the spec unhashable


def test_specs_built_from_different_iterables_are_equal_and_hash_alike():
    a, b = PlainSpec("kv", ["x", "y"]), PlainSpec("kv", ("y", "x", "x"))
    assert a == b
    assert hash(a) == hash(b)
    assert PlainSpec("kv", ["x"]) != PlainSpec("kv", ["y"])
    assert PlainSpec("kv", ["x"]) != PlainSpec("other", ["x"])


@pytest.mark.parametrize(("nodes", "shown"), [("ab", "nodes='ab'"), (3, "nodes=3"), (None, "nodes=None")])
def test_nodes_must_be_an_iterable_of_names(nodes, shown):
    with pytest.raises(TypeError, match=re.escape(shown) + ".*iterable of node names"):
        PlainSpec("kv", nodes)


@pytest.mark.parametrize(
    ("key", "shown"), [("", "resource_key=''"), (3, "resource_key=3"), (None, "resource_key=None")]
)
def test_resource_key_must_be_a_non_empty_str(key, shown):
    with pytest.raises(ValueError, match=re.escape(shown) + ".*non-empty str"):
        PlainSpec(key, {"node"})


def test_depends_on_defaults_to_the_empty_set():
    @dataclasses.dataclass(frozen=True)
    class Bare(NodeResourceSpec):
        @property
        def resource_class(self):
            return Builder

    deps = Bare("kv", {"node"}).depends_on()
    assert deps == set()
    assert isinstance(deps, set)
    assert Bare("kv", {"node"}).resource_class is Builder


def test_base_apply_yaml_overrides_takes_no_keys():
    spec = plain("kv")
    assert spec.apply_yaml_overrides() is spec
    with pytest.raises(TypeError, match=r"resource 'kv' .*\['max_slots'\].*takes no YAML overrides"):
        spec.apply_yaml_overrides(max_slots=4)
    # Every offending key is named, sorted.
    with pytest.raises(TypeError, match=r"resource 'kv' .*\['a', 'b'\].*takes no YAML overrides"):
        spec.apply_yaml_overrides(b=1, a=2)


def test_subclass_yaml_keys_refuse_others_naming_what_it_accepts():
    spec = TunableSpec("pool", {"node"})
    with pytest.raises(TypeError, match=r"resource 'pool' .*\['sise'\].*accepts \['size', 'mode'\]"):
        spec.apply_yaml_overrides(sise=4)
    with pytest.raises(TypeError, match=r"\['bogus', 'zz'\]"):
        spec.apply_yaml_overrides(size=4, zz=1, bogus=2)


def test_yaml_overrides_return_a_new_spec_and_leave_the_original():
    spec = TunableSpec("pool", {"node"}, size=1)
    patched = spec.apply_yaml_overrides(size=8)
    assert patched == TunableSpec("pool", {"node"}, size=8)
    assert spec.size == 1
    assert patched is not spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.resource_key = "other"


# --- ResourceReqConfig --------------------------------------------------------------------------------------


def test_req_config_base_hooks():
    cfg = ResourceReqConfig()
    spec = plain("kv")
    assert cfg.validate() is None
    assert cfg.validate(spec) is None
    assert cfg.loop_room() == {}
    assert cfg.loop_room(spec) == {}
    cfg.loop_room(spec)["x"] = 1  # a fresh dict: the caller may fill it without touching the next answer
    assert cfg.loop_room(spec) == {}
    assert cfg.apply_conductor_config(seed=3, prefix_keys=("a",)) == cfg
    assert isinstance(cfg.apply_conductor_config(), ResourceReqConfig)


@dataclasses.dataclass(frozen=True)
class SeededReqConfig(ResourceReqConfig):
    """A request config that keeps the conductor's `seed`, bounds a loop, and checks a value."""

    seed: int | None = None
    max_tokens: int = 10

    def apply_conductor_config(self, seed: int | None = None, **others) -> SeededReqConfig:
        del others
        return dataclasses.replace(self, seed=seed)

    def validate(self, spec=None) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")

    def loop_room(self, spec=None) -> dict[str, int]:
        return {"decode": self.max_tokens}


def test_req_config_subclass_hooks():
    cfg = SeededReqConfig(max_tokens=5)
    seeded = cfg.apply_conductor_config(seed=7, prefix_keys=("x",))
    assert seeded == SeededReqConfig(seed=7, max_tokens=5)
    assert isinstance(seeded, ResourceReqConfig)
    assert cfg.seed is None
    assert seeded.loop_room() == {"decode": 5}
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        SeededReqConfig(max_tokens=0).validate(plain("kv"))


# --- CombinedSplit ------------------------------------------------------------------------------------------


def test_combined_split_fields():
    split = CombinedSplit("mixed", ["prefill", "chunk"])
    assert split.combined_walk == "mixed"
    assert split.prefill_walks == ("prefill", "chunk")
    assert split == CombinedSplit("mixed", ("prefill", "chunk"))
    assert hash(split) == hash(CombinedSplit("mixed", ("prefill", "chunk")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        split.combined_walk = "other"


def test_combined_split_refuses_a_str_or_no_prefill_walks():
    with pytest.raises(TypeError, match=r"prefill_walks='prefill'.*not a str"):
        CombinedSplit("mixed", "prefill")
    with pytest.raises(ValueError, match=r"CombinedSplit\('mixed'\).*at least one prefill walk"):
        CombinedSplit("mixed", ())


@pytest.mark.parametrize(
    ("walks", "caps", "bucket_rows", "expected"),
    [
        (("p",), {}, 8, 8),  # absent: the bucket's rows
        (("p",), {"p": None}, 8, 8),  # None: the bucket's rows
        (("p",), {"p": 3}, 8, 3),
        (("p",), {"p": 0}, 8, 0),
        (("p",), {"p": 20}, 8, 8),  # min with the bucket
        (("p", "c"), {"p": 2, "c": 3}, 8, 5),  # several walks summed
        (("p", "c"), {"p": 5, "c": 6}, 8, 8),  # 11 capped at 8
        (("p", "c"), {"p": 2}, 8, 8),  # 2 + 8 (c absent) capped at 8
        (("p", "c"), {"p": 1, "c": 2, "decode": 99}, 8, 3),  # walks outside prefill_walks are ignored
        (("p",), {"p": 3}, 0, 0),
    ],
)
def test_max_prefill_rows_examples(walks, caps, bucket_rows, expected):
    assert CombinedSplit("mixed", walks).max_prefill_rows(caps, bucket_rows) == expected


def _fill_rows(walks, caps, bucket_rows):
    """Brute force: hand out the bucket's rows one at a time to any prefill walk with room left."""
    room = {w: bucket_rows if caps.get(w) is None else caps[w] for w in walks}
    rows = 0
    for _ in range(bucket_rows):
        open_walks = [w for w in room if room[w] > 0]
        if not open_walks:
            break
        room[open_walks[0]] -= 1
        rows += 1
    return rows


def test_max_prefill_rows_brute_force():
    names = ("a", "b", "c")
    cap_choices = ("absent", None, 0, 1, 2, 3, 5)
    for n_walks in (1, 2, 3):
        walks = names[:n_walks]
        split = CombinedSplit("mixed", walks)
        for choice in itertools.product(cap_choices, repeat=n_walks):
            caps = {w: c for w, c in zip(walks, choice, strict=True) if c != "absent"}
            for bucket_rows in range(7):
                got = split.max_prefill_rows(caps, bucket_rows)
                assert got == _fill_rows(walks, caps, bucket_rows), (walks, caps, bucket_rows)


@pytest.mark.parametrize("bucket_rows", [-1, True, 2.0, "2", None])
def test_max_prefill_rows_refuses_bad_bucket_rows(bucket_rows):
    with pytest.raises(ValueError, match=re.escape(f"bucket_rows={bucket_rows!r} must be an int >= 0")):
        CombinedSplit("mixed", ("p",)).max_prefill_rows({}, bucket_rows)


@pytest.mark.parametrize("cap", [-1, True, 1.5, "3"])
def test_max_prefill_rows_refuses_bad_caps(cap):
    expected = f"max_rows_in_combined['p']={cap!r} must be None or an int >= 0"
    with pytest.raises(ValueError, match=re.escape(expected)):
        CombinedSplit("mixed", ("p",)).max_prefill_rows({"p": cap}, 4)


# --- dependency checks --------------------------------------------------------------------------------------


def test_consistent_specs_resolve_to_a_key_map():
    a, b, c = plain("a"), plain("b", "a"), plain("c", "a", "b")
    assert spec_dependency_problems([a, b, c]) == []
    resolved = resolve_spec_dependencies([c, a, b])
    assert resolved == {"c": c, "a": a, "b": b}
    assert list(resolved) == ["c", "a", "b"]
    assert resolve_spec_dependencies([]) == {}


def test_every_problem_is_reported_at_once():
    specs = [plain("a"), plain("a"), plain("a"), plain("b", "zz", "a"), plain("b"), plain("c", "y", "x")]
    problems = spec_dependency_problems(specs)
    assert problems == [
        "two resources declared under the key 'a'",
        "two resources declared under the key 'a'",
        "two resources declared under the key 'b'",
        "resource 'b' depends on ['zz'], which this model does not declare; available: ['a', 'b', 'c']",
        "resource 'c' depends on ['x', 'y'], which this model does not declare; available: ['a', 'b', 'c']",
    ]
    with pytest.raises(ValueError, match="resource specs are inconsistent") as err:
        resolve_spec_dependencies(specs)
    for problem in problems:
        assert problem in str(err.value)


def test_unknown_overrides_message_lists_both_sides_sorted():
    message = unknown_overrides_message(["zz", "kv_cash"], {"kv", "enc"})
    assert message == (
        "serving config overrides unknown resource(s) ['kv_cash', 'zz']; this model declares ['enc', 'kv']"
    )


# --- the deployment's resources: block ----------------------------------------------------------------------


def _specs():
    return [plain("a"), TunableSpec("pool", {"node"}), TunableSpec("enc", {"node"}, size=2)]


@pytest.mark.parametrize(
    "model_config",
    [{}, {"resources": None}, {"resources": {}}, {"other": 1}],
    ids=["missing", "none", "empty", "unrelated"],
)
def test_empty_or_missing_block_is_a_no_op(model_config):
    specs = _specs()
    patched = apply_yaml_overrides(specs, model_config)
    assert patched == specs
    assert all(p is s for p, s in zip(patched, specs, strict=True))


@pytest.mark.parametrize("block", [{}, None])
def test_an_empty_per_resource_block_is_accepted(block):
    specs = _specs()
    # `a` takes no YAML keys at all, and an empty block still reaches it without complaint.
    assert apply_yaml_overrides(specs, {"resources": {"a": block, "pool": block}}) == specs


def test_blocks_patch_their_own_resource_and_return_specs_in_order():
    specs = _specs()
    blocks = {"enc": {"size": 9}, "pool": {"mode": "b", "size": 3}}
    patched = apply_yaml_overrides(specs, {"resources": blocks})
    assert patched == [
        plain("a"),
        TunableSpec("pool", {"node"}, size=3, mode="b"),
        TunableSpec("enc", {"node"}, size=9),
    ]
    assert patched[0] is specs[0]
    assert specs == _specs()  # frozen: the inputs are unchanged


def test_unknown_resource_keys_list_what_the_model_declares():
    expected = unknown_overrides_message(["kv", "zz"], ["a", "enc", "pool"])
    with pytest.raises(ValueError, match=re.escape(expected)):
        apply_yaml_overrides(_specs(), {"resources": {"zz": {}, "pool": {}, "kv": {"size": 1}}})


def test_a_spec_refuses_its_unknown_keys_through_the_block():
    with pytest.raises(TypeError, match=r"resource 'pool' .*\['sise'\].*accepts \['size', 'mode'\]"):
        apply_yaml_overrides(_specs(), {"resources": {"pool": {"sise": 3}}})
    with pytest.raises(TypeError, match=r"resource 'a' .*\['size'\].*takes no YAML overrides"):
        apply_yaml_overrides(_specs(), {"resources": {"a": {"size": 3}}})


def test_legacy_top_level_kv_cache_block_raises():
    with pytest.raises(ValueError, match=r"top-level 'kv_cache:' block is no longer read.*resources:"):
        apply_yaml_overrides(_specs(), {"kv_cache": {"max_num_pages": 1024}})
    with pytest.raises(ValueError, match="kv_cache"):
        apply_yaml_overrides(_specs(), {"kv_cache": {}, "resources": {"pool": {"size": 2}}})


def test_inconsistent_specs_raise_when_a_block_applies():
    specs = [plain("a"), plain("a"), plain("b", "missing")]
    with pytest.raises(ValueError, match=r"(?s)key 'a'.*depends on \['missing'\]"):
        apply_yaml_overrides(specs, {"resources": {"a": {}}})


@pytest.mark.parametrize(
    ("model_config", "shown"),
    [({"resources": ["pool"]}, "resources=['pool']"), ({"resources": {"pool": 4}}, "resources.pool=4")],
)
def test_blocks_must_be_mappings(model_config, shown):
    with pytest.raises(ValueError, match=re.escape(shown) + ".*must be a mapping"):
        apply_yaml_overrides(_specs(), model_config)


# --- pytrees and jit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [plain("a", "b"), TunableSpec("pool", ["n"], size=3), CombinedSplit("m", ("p",)), SeededReqConfig(1)],
    ids=["spec", "tunable-spec", "combined-split", "req-config"],
)
def test_declarations_are_static_pytrees(obj):
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    assert leaves == []
    assert jax.tree_util.tree_unflatten(treedef, leaves) == obj
    assert jax.tree_util.tree_structure(obj) == jax.tree_util.tree_structure(dataclasses.replace(obj))


def test_equal_specs_trace_once():
    traces = []

    @jax.jit
    def scale(spec, x):
        traces.append(spec)
        return x * spec.size

    x = np.float32(2.0)
    assert scale(TunableSpec("pool", ["n"], size=3), x) == 6.0
    assert scale(TunableSpec("pool", ("n",), size=3), x) == 6.0  # equal, not identical
    assert len(traces) == 1
    assert scale(TunableSpec("pool", ["n"], size=4), x) == 8.0
    assert len(traces) == 2


def test_spec_as_a_static_argument():
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def scale(split, x):
        traces.append(split)
        return x * split.max_prefill_rows({}, 4)

    x = np.float32(1.0)
    assert scale(CombinedSplit("m", ["p"]), x) == 4.0
    assert scale(CombinedSplit("m", ("p",)), x) == 4.0
    assert len(traces) == 1
