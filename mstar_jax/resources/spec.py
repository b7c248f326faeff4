"""Resource declarations models hand to the engine.

The engine builds each node's resources once, at load time, from these specs. A spec names what to
build and its parameters; the model declares, the engine constructs. Specs are frozen dataclasses
registered as (leafless) pytrees, hashable so they can be static `jit` arguments. Where the original
engine patches a spec in place (`apply_yaml_overrides`), these return the patched spec instead.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from mstar_jax.checks import check_int

if TYPE_CHECKING:
    from mstar_jax.resources.base import Resource

__all__ = [
    "CombinedSplit",
    "NodeResourceSpec",
    "ResourceReqConfig",
    "apply_yaml_overrides",
    "register_static_pytree",
    "resolve_spec_dependencies",
    "spec_dependency_problems",
    "unknown_overrides_message",
]


def register_static_pytree(cls: type) -> type:
    """Register `cls` as a pytree with no leaves: the whole (hashable, frozen) object is static."""
    jax.tree_util.register_pytree_node(cls, lambda obj: ((), obj), lambda obj, _: obj)
    return cls


@dataclasses.dataclass(frozen=True)
class NodeResourceSpec(abc.ABC):
    """What a model declares for one resource: its key, the graph nodes that use it, its parameters.

    `nodes` accepts any iterable of names and is stored as a frozenset so the spec stays hashable.
    Subclasses list the YAML keys they accept in `YAML_KEYS` and implement `apply_yaml_overrides`.
    """

    resource_key: str
    nodes: frozenset[str]

    YAML_KEYS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_static_pytree(cls)

    def __post_init__(self):
        if not isinstance(self.resource_key, str) or not self.resource_key:
            raise ValueError(f"resource_key={self.resource_key!r} must be a non-empty str")
        if isinstance(self.nodes, str) or not isinstance(self.nodes, Iterable):
            raise TypeError(f"nodes={self.nodes!r} must be an iterable of node names, not a single str")
        nodes = tuple(self.nodes)
        if not all(isinstance(node, str) for node in nodes):
            raise TypeError(f"nodes={self.nodes!r} must be an iterable of node names, each a str")
        object.__setattr__(self, "nodes", frozenset(nodes))

    @property
    @abc.abstractmethod
    def resource_class(self) -> type[Resource]:
        """What builds this spec. Imported inside the property, so declaring a resource stays free
        of the manager and its kernels."""

    def depends_on(self) -> set[str]:
        """Keys of the specs this one builds against (default: none)."""
        return set()

    def apply_yaml_overrides(self, **kwargs: Any) -> NodeResourceSpec:
        """Return this spec patched from its resource's YAML block.

        The model declares shapes that suit the model; a deployment tunes what suits the box it runs
        on. The block is scoped to this spec's `resource_key`, so an unrecognised key is a typo, not
        another resource's setting: subclasses name exactly what they accept (`YAML_KEYS`) and let the
        rest raise. The base accepts nothing.

        Raises:
          TypeError: for any key not in `YAML_KEYS`, naming the resource and the keys it accepts.
        """
        self._reject_unknown_yaml_keys(kwargs)
        return self

    def _reject_unknown_yaml_keys(self, kwargs: Mapping[str, Any]) -> None:
        unknown = sorted(set(kwargs) - set(self.YAML_KEYS), key=str)  # a YAML key may be an int
        if unknown:
            accepted = (
                f"it accepts {list(self.YAML_KEYS)}" if self.YAML_KEYS else "it takes no YAML overrides"
            )
            raise TypeError(f"resource {self.resource_key!r} got unknown YAML key(s) {unknown}; {accepted}")


@dataclasses.dataclass(frozen=True)
class ResourceReqConfig:
    """Per-request parameters for one resource, carried on the request and handed to that resource
    at ingest. Keyed by resource key, so it needs no tag of its own: a marker base, with no contract
    beyond the hooks below."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_static_pytree(cls)

    def apply_conductor_config(self, **kwargs: Any) -> ResourceReqConfig:
        """Return this config with the conductor's settings applied (the base ignores them all).

        Subclasses pick the keys they know and ignore the rest; frozen, so they return a new config.
        """
        del kwargs
        return self

    def loop_room(self, spec: NodeResourceSpec | None = None) -> dict[str, int]:
        """The most iterations each loop can run before the request outgrows the resource built from
        `spec`. A loop the resource doesn't bound is left out (a bounded cache bounds none)."""
        del spec
        return {}

    def validate(self, spec: NodeResourceSpec | None = None) -> None:
        """Raise ValueError if a client-supplied value is out of range, or one the resource built
        from `spec` cannot honour. Called at intake, before any device work."""
        del spec


register_static_pytree(ResourceReqConfig)


@dataclasses.dataclass(frozen=True)
class CombinedSplit:
    """A combined walk run on two kernels: decode for one-token rows, prefill for the rows of
    `prefill_walks`, compiled for as many as `max_rows_in_combined` lets in (an uncapped walk: the
    bucket's rows)."""

    combined_walk: str
    prefill_walks: tuple[str, ...]

    def __post_init__(self):
        if isinstance(self.prefill_walks, str) or not isinstance(self.prefill_walks, Iterable):
            raise TypeError(
                f"prefill_walks={self.prefill_walks!r} must be a sequence of walk names (not a str)"
            )
        object.__setattr__(self, "prefill_walks", tuple(self.prefill_walks))
        if len(set(self.prefill_walks)) != len(self.prefill_walks):
            raise ValueError(f"prefill_walks={self.prefill_walks!r} names a walk twice")
        if not self.prefill_walks:
            raise ValueError(f"CombinedSplit({self.combined_walk!r}) needs at least one prefill walk")

    def max_prefill_rows(self, max_rows_in_combined: Mapping[str, int | None], bucket_rows: int) -> int:
        """Prefill rows the compiled program makes room for: `min(bucket_rows, sum of caps)`, where a
        walk's cap is `max_rows_in_combined[walk]`, or `bucket_rows` when that is None or absent."""
        check_int("bucket_rows", bucket_rows, minimum=0, numpy=True)
        total = 0
        for walk in self.prefill_walks:
            cap = max_rows_in_combined.get(walk)
            check_int(f"max_rows_in_combined[{walk!r}]", cap, minimum=0, allow_none=True, numpy=True)
            total += bucket_rows if cap is None else cap
        return min(bucket_rows, total)


register_static_pytree(CombinedSplit)


def spec_dependency_problems(specs: Sequence[NodeResourceSpec]) -> list[str]:
    """Every duplicate resource key and undeclared `depends_on` in `specs`, all at once."""
    problems, seen = [], set()
    for spec in specs:
        if spec.resource_key in seen:
            problems.append(f"two resources declared under the key {spec.resource_key!r}")
        seen.add(spec.resource_key)
    declared = sorted(seen)
    for spec in specs:
        missing = sorted(spec.depends_on() - seen)
        if missing:
            problems.append(
                f"resource {spec.resource_key!r} depends on {missing}, which this model does not declare; "
                f"available: {declared}"
            )
    return problems


def resolve_spec_dependencies(specs: Sequence[NodeResourceSpec]) -> dict[str, NodeResourceSpec]:
    """Index specs by resource key, checking uniqueness and `depends_on`.

    Raises:
      ValueError: listing every problem `spec_dependency_problems` finds.
    """
    problems = spec_dependency_problems(specs)
    if problems:
        raise ValueError("resource specs are inconsistent:\n  " + "\n  ".join(problems))
    return {spec.resource_key: spec for spec in specs}


def unknown_overrides_message(unknown: list[str], declared: Collection[str]) -> str:
    """The error for a `resources:` block naming resources the model does not declare."""
    return (
        f"serving config overrides unknown resource(s) {sorted(unknown, key=str)}; "
        f"this model declares {sorted(declared)}"
    )


def apply_yaml_overrides(
    specs: Sequence[NodeResourceSpec], model_config: Mapping[str, Any]
) -> list[NodeResourceSpec]:
    """Apply a deployment's `resources:` block to the specs it names; return the patched specs.

    `resources: {<resource_key>: {...}}`, one block per resource, so a model with two pools of the
    same kind can have each tuned on its own. Specs are frozen: the patched list is returned in the
    input order, and the inputs are unchanged.

    Raises:
      ValueError: for a legacy top-level `kv_cache:` block, a block that is not a mapping, inconsistent
        specs, or a resource the model does not declare (the message lists what it declares).
      TypeError: from a spec, for a key its resource does not accept.
    """
    if "kv_cache" in model_config:
        raise ValueError(
            "the top-level 'kv_cache:' block is no longer read; move it under 'resources:' keyed by the "
            "resource name, e.g.\nresources:\n  kv_cache:\n    max_slots: 64"
        )
    overrides = model_config.get("resources")
    overrides = {} if overrides is None else overrides  # an empty 'resources:'; `false` or `[]` is refused
    if not isinstance(overrides, Mapping):
        raise ValueError(f"resources={overrides!r} must be a mapping of resource key to settings")
    by_key = resolve_spec_dependencies(specs)
    unknown = sorted(set(overrides) - set(by_key), key=str)  # a YAML key may be an int
    if unknown:
        raise ValueError(unknown_overrides_message(unknown, by_key))
    patched = dict(by_key)
    for key, block in overrides.items():
        block = {} if block is None else block
        if not isinstance(block, Mapping):
            raise ValueError(f"resources.{key}={block!r} must be a mapping of settings")
        if not all(isinstance(name, str) for name in block):
            by_key[key]._reject_unknown_yaml_keys(block)  # names the key `**block` would refuse unnamed
        patched[key] = by_key[key].apply_yaml_overrides(**block)
    return [patched[spec.resource_key] for spec in specs]
