"""A deployment: which model, how its resources are tuned, what gets compiled, how the engine runs.

YAML stays at this edge: `load_deployment(path)` (or `parse_deployment(mapping)`) turns a file into
a frozen `Deployment` of typed settings, and nothing past it takes a raw dict. Every mistake is
refused here, naming the file, the section, the key, the value and what is allowed: an unknown key
anywhere (it would otherwise be a silently ineffective setting), a duplicate key, a wrong type, a
value out of range, or settings that contradict each other. The format is described, key by key, in
`configs/README.md`; `DEFAULT_CONFIG` is the embedded CPU-sized default.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import io
import os
from collections.abc import Mapping, Sequence
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from mstar_jax.checks import brief
from mstar_jax.errors import DeploymentError, DeploymentTypeError
from mstar_jax.memory import resource_costs
from mstar_jax.registry import model_config, model_entry
from mstar_jax.resources.kv.bounded.config import BoundedKVSpec
from mstar_jax.resources.spec import NodeResourceSpec, apply_yaml_overrides
from mstar_jax.settings import CompileSettings, EngineSettings, MeshSettings, WorkloadSettings

__all__ = [
    "DEFAULT_CONFIG",
    "CompileSettings",
    "Deployment",
    "DeploymentError",
    "DeploymentTypeError",
    "EngineSettings",
    "WorkloadSettings",
    "load_deployment",
    "parse_deployment",
]

DEFAULT_CONFIG: Path = Path(str(importlib.resources.files("mstar_jax") / "configs" / "streaming_tts.yaml"))
"""The embedded default deployment: the streaming TTS model sized to run on a CPU in seconds."""


# -- the deployment ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Deployment:
    """A validated deployment: the model's config, its tuned resource specs and the run settings.

    Attributes:
      model: the model's name in the registry (`mstar_jax.registry.model_entry`).
      model_config: that model's frozen config.
      specs: the model's `resource_specs()` with the `resources:` block applied.
      compile: bucket and compilation-cache settings.
      engine: engine loop settings.
      workload: the workload `mstar-jax run` drives.
      mesh: the device mesh (data and model shards).
      source: where the deployment came from (a path, or "<string>").
    """

    model: str
    model_config: Any
    specs: tuple[NodeResourceSpec, ...]
    compile: CompileSettings = dataclasses.field(default_factory=CompileSettings)
    engine: EngineSettings = dataclasses.field(default_factory=EngineSettings)
    workload: WorkloadSettings = dataclasses.field(default_factory=WorkloadSettings)
    mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
    source: str = "<string>"

    def __post_init__(self):
        object.__setattr__(self, "specs", tuple(self.specs))
        for node in sorted({node for spec in self.specs for node in spec.nodes}):
            # A stream of the node holds one slot of each of its caches: one count serves them all.
            slots = {s.resource_key: s.config.max_slots for s in self.specs if node in s.nodes}
            if len(set(slots.values())) > 1:
                raise ValueError(
                    f"resources: {slots} must give the caches of node {node!r} the same max_slots (a "
                    "stream holds a slot of each)"
                )
        max_batch = self.engine.max_batch
        if self.compile.batch_sizes is None and self.compile.min_batch > max_batch:
            raise ValueError(
                f"compile.min_batch={self.compile.min_batch} must be <= engine.max_batch={max_batch}"
            )
        # On a mesh a batch bucket counts one data shard's rows.
        largest = self.compile.resolved_batch_sizes(max_batch)[-1] * self.mesh.data
        if largest < max_batch:
            raise ValueError(
                f"engine.max_batch={max_batch} exceeds the largest compiled batch, compile.batch_sizes="
                f"{list(self.compile.batch_sizes or ())}: a full batch would fit no bucket; add {max_batch} "
                "to compile.batch_sizes or lower engine.max_batch"
            )
        for spec in self.specs:
            if not isinstance(spec, BoundedKVSpec):
                continue
            cfg, data, model = spec.config, self.mesh.data, self.mesh.model
            if cfg.max_slots % data:
                raise ValueError(
                    f"resources.{spec.resource_key}.max_slots={cfg.max_slots} must split evenly over "
                    f"mesh.data={data} slot pools; use a multiple of {data}"
                )
            if cfg.num_heads % model and model % cfg.num_heads:
                raise ValueError(
                    f"mesh.model={model} must divide {spec.resource_key}'s {cfg.num_heads} KV heads, or be a "
                    "multiple of them (each shard then holds a copy of one head)"
                )
            if spec.config.max_slots < max_batch:
                raise ValueError(
                    f"engine.max_batch={max_batch} exceeds resources.{spec.resource_key}.max_slots="
                    f"{spec.config.max_slots}: every request in a batch holds a slot, so such a batch "
                    "never forms; raise max_slots or lower engine.max_batch"
                )
        entry = model_entry(self.model)
        if entry.check is not None:  # what only the model knows it cannot run
            entry.function("check")(self)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch buckets compiled: explicit, or derived up to `engine.max_batch`."""
        return self.compile.resolved_batch_sizes(self.engine.max_batch)

    @property
    def token_counts(self) -> tuple[int, ...]:
        """The token buckets compiled."""
        return self.compile.resolved_token_counts()

    def check_devices(self, devices: Sequence[Any] | None = None) -> None:
        """Refuse a mesh larger than `devices` (default: `jax.devices()`, every process's).

        Raises:
          DeploymentError: naming the source, the mesh and the devices present.
        """
        if self.mesh.devices == 1:
            return  # every host has a device; and checking needs no backend then
        if devices is None:
            import jax  # only here: loading and checking a deployment needs no backend

            devices = jax.devices()
        platform = devices[0].platform if devices else "no"
        try:
            self.mesh.check_devices(len(devices), platform)
        except ValueError as err:
            raise DeploymentError(f"{self.source}: mesh: {err}") from None

    def spec(self, resource_key: str) -> NodeResourceSpec:
        """The spec declared under `resource_key`.

        Raises:
          KeyError: naming the key and the keys declared.
        """
        for spec in self.specs:
            if spec.resource_key == resource_key:
                return spec
        raise KeyError(f"no resource {resource_key!r}; declared: {[s.resource_key for s in self.specs]}")

    def costs(self) -> tuple[Any, ...]:
        """`memory.resource_costs` of every spec, in declaration order."""
        return tuple(resource_costs(spec) for spec in self.specs)


# -- loading ----------------------------------------------------------------------------------------

_TOP_LEVEL = ("model", "resources", "compile", "engine", "workload", "mesh")
_MODEL_KEYS = ("name", "config")
_SETTINGS = {
    "compile": CompileSettings,
    "engine": EngineSettings,
    "workload": WorkloadSettings,
    "mesh": MeshSettings,
}


def load_deployment(path: str | os.PathLike[str] | Traversable = DEFAULT_CONFIG) -> Deployment:
    """Read and validate the deployment in the YAML file at `path`.

    Raises:
      DeploymentError: for an empty path, a missing or unreadable file, invalid YAML (a duplicate key
        included), or anything `parse_deployment` refuses; the message starts with the path.
      TypeError: for a `path` that is neither a path nor a `Traversable`.
    """
    if not isinstance(path, str | os.PathLike) and not hasattr(path, "read_text"):
        raise TypeError(f"path={path!r} must be a str, an os.PathLike or a Traversable")
    source = os.fspath(path) if isinstance(path, str | os.PathLike) else str(path)
    if not source:  # Path("") is the working directory
        raise DeploymentError("path='' is empty; it must name a deployment YAML file")
    file = Path(source) if isinstance(path, str | os.PathLike) else path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeploymentError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise DeploymentError(f"{source}: cannot read it: {err}") from None
    try:
        mapping = yaml.load(_NamedText(text, source), Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as err:
        raise DeploymentError(f"{source}: invalid YAML: {err}") from None
    if mapping is None:
        raise DeploymentError(f"{source}: the file is empty; a deployment needs at least a 'model:' section")
    return parse_deployment(mapping, source=source)


def parse_deployment(mapping: Mapping[str, Any], source: str = "<string>") -> Deployment:
    """Validate a deployment given as the mapping a YAML file parses to.

    Args:
      mapping: `{model: {name, config}, resources: {key: {...}}, compile: {...}, engine: {...},
        workload: {...}}`; only `model.name` is required.
      source: where the mapping came from, for messages.

    Raises:
      DeploymentError: naming `source`, the section and the key, for an unknown key in any section,
        a missing model name, a wrong type or a value out of range, or settings that contradict each
        other. `DeploymentTypeError` for an unknown key in a resource's block.
    """
    if not isinstance(mapping, Mapping):
        raise DeploymentError(f"{source}: a deployment must be a mapping of sections, got {_brief(mapping)}")
    # 'kv_cache' is refused below with a note on where its settings moved.
    _reject_unknown(source, "the top level", mapping, _TOP_LEVEL, ignore=("kv_cache",))
    if "model" not in mapping:
        raise DeploymentError(f"{source}: missing the 'model:' section (with at least 'name:')")
    name, config = _parse_model(source, mapping["model"])
    try:
        specs = config.resource_specs()
    except ValueError as err:  # a cache the model's geometry cannot build
        raise DeploymentError(f"{source}: model.config: {err}") from None
    if "kv_cache" in mapping:
        raise DeploymentError(f"{source}: kv_cache: {_legacy_kv_cache_hint(mapping['kv_cache'], specs)}")
    specs = _apply_resources(source, specs, mapping)
    for section in _UNREAD:
        _refuse_unread(source, name, config, section, mapping.get(section))
    settings = {section: _parse_settings(source, section, mapping.get(section)) for section in _SETTINGS}
    try:
        return Deployment(model=name, model_config=config, specs=specs, source=source, **settings)
    except ValueError as err:
        raise DeploymentError(f"{source}: {err}") from None


# section: the model config's class attribute naming the section's settings its model never reads.
_UNREAD = {"workload": "UNREAD_WORKLOAD", "compile": "UNREAD_COMPILE"}


def _refuse_unread(source: str, name: str, config: Any, section: str, block: Any) -> None:
    """Refuse a `section` setting the model never reads (a speech model's `max_frames` in a text model's
    workload, a text model's `token_counts` in its compile, say): given, it would be silently ignored.
    Checked before the section is parsed, and the value shown cut short (`brief`)."""
    unread = getattr(type(config), _UNREAD[section], ())
    given = sorted((key for key in block if key in unread), key=str) if isinstance(block, Mapping) else []
    if given:
        read = [f.name for f in dataclasses.fields(_SETTINGS[section]) if f.name not in unread]
        raise DeploymentError(
            f"{source}: {section}: {given[0]}={brief(block[given[0]])} is not read by model {name!r}; its "
            f"{section} reads {read}"
        )


def _parse_model(source: str, block: Any) -> tuple[str, Any]:
    if not isinstance(block, Mapping):
        raise DeploymentError(
            f"{source}: model: must be a mapping with 'name' (and 'config'), got {_brief(block)}"
        )
    _reject_unknown(source, "'model'", block, _MODEL_KEYS)
    if "name" not in block:
        raise DeploymentError(f"{source}: model: missing 'name'")
    name, settings = block["name"], block.get("config")
    settings = {} if settings is None else settings  # an empty 'config:'; `false` or `[]` is refused below
    try:
        model_entry(name)
    except ValueError as err:
        raise DeploymentError(f"{source}: model.name: {err}") from None
    if not isinstance(settings, Mapping):
        raise DeploymentError(
            f"{source}: model.config: must be a mapping of setting to value, got {_brief(settings)}"
        )
    try:
        return name, model_config(name, settings)
    except (TypeError, ValueError) as err:
        raise DeploymentError(f"{source}: model.config: {err}") from None


def _legacy_kv_cache_hint(block: Any, specs: list[NodeResourceSpec]) -> str:
    """Where a legacy `kv_cache:` block's settings go now, as a one-line YAML snippet that loads."""
    # The block's settings each resource accepts, or its declared max_slots: a snippet that parses.
    settings = dict(block) if isinstance(block, Mapping) else {}
    resources = {}
    for spec in specs:
        kept = {key: value for key, value in settings.items() if key in spec.YAML_KEYS}
        if not kept and "max_slots" in spec.YAML_KEYS:
            kept = {"max_slots": spec.config.max_slots}
        resources[spec.resource_key] = kept
    snippet = yaml.safe_dump(resources, default_flow_style=True, sort_keys=False, width=1 << 16).strip()
    keys = ", ".join(spec.resource_key for spec in specs)
    return (
        "this top-level block is no longer read; tune each cache under 'resources:', keyed by the resource "
        f"keys the model declares ({keys}), e.g. resources: {snippet}"
    )


def _apply_resources(
    source: str, specs: list[NodeResourceSpec], mapping: Mapping[str, Any]
) -> list[NodeResourceSpec]:
    # One resource at a time, so a message names the block it came from.
    blocks = mapping.get("resources")
    blocks = {} if blocks is None else blocks  # `false` or `[]` is no mapping: refused below
    scoped = [("resources", mapping)]
    if isinstance(blocks, Mapping):
        scoped = [(f"resources.{key}", {"resources": {key: block}}) for key, block in blocks.items()]
    for where, overrides in scoped:
        try:
            specs = apply_yaml_overrides(specs, overrides)
        except TypeError as err:
            raise DeploymentTypeError(f"{source}: {where}: {err}") from None
        except ValueError as err:
            raise DeploymentError(f"{source}: {where}: {err}") from None
    return specs


def _parse_settings(source: str, section: str, block: Any) -> Any:
    cls = _SETTINGS[section]
    if block is None:
        return cls()
    if not isinstance(block, Mapping):
        raise DeploymentError(
            f"{source}: {section}: must be a mapping of setting to value, got {_brief(block)}"
        )
    _reject_unknown(source, f"{section!r}", block, [field.name for field in dataclasses.fields(cls)])
    values = {key: tuple(value) if isinstance(value, list) else value for key, value in block.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise DeploymentError(f"{source}: {section}: {err}") from None


def _reject_unknown(
    source: str, where: str, block: Mapping[Any, Any], allowed: Any, ignore: tuple[str, ...] = ()
) -> None:
    unknown = sorted((key for key in block if key not in allowed and key not in ignore), key=str)
    if unknown:
        noun = "key" if len(unknown) == 1 else "keys"
        shown = ", ".join(repr(key) for key in unknown)
        raise DeploymentError(f"{source}: unknown {noun} {shown} in {where}; allowed: {list(allowed)}")


class _NamedText(io.StringIO):
    """Text with a `name`, which PyYAML's error marks show instead of "<unicode string>"."""

    def __init__(self, text: str, name: str):
        super().__init__(text)
        self.name = name


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (it would keep the last one silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping refuses it with its own message
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _brief(value: Any) -> str:
    return f"{type(value).__name__} {brief(value)}"
