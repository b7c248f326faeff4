"""The one registry of models a deployment names, this package's and the user's own.

A model registers one `ModelEntry`: its deployment config class, and where its deployment is run
(`mstar-jax run`), its engine built (`mstar-jax serve`) and its device memory counted (`check`, `run`).
Those three are `"module:function"` references, imported only when called, so checking a deployment
loads neither the engine nor the model's modules.

A deployment's `model.name` is looked up, in order, among:

1. this package's models (`BUILTIN`);
2. the `mstar_jax.models` entry points of installed packages: in a user's `pyproject.toml`,
   `[project.entry-points."mstar_jax.models"] my_model = "my_package.serving:ENTRY"`;
3. a reference `"package.module:ENTRY"` itself, for a model not installed as a package.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "BUILTIN",
    "ENTRY_POINTS",
    "ModelCommand",
    "ModelEntry",
    "known_models",
    "model_commands",
    "model_config",
    "model_entry",
    "resolve",
]

ENTRY_POINTS = "mstar_jax.models"
"""The entry-point group an installed package registers its models in."""

BUILTIN: Mapping[str, str] = {
    "streaming_tts": "mstar_jax.models.streaming_tts.entry:ENTRY",
    "gemma3": "mstar_jax.models.gemma3.entry:ENTRY",
}
"""This package's models: name -> its entry's reference."""


def resolve(reference: str) -> Any:
    """The object a `"module:attribute"` reference names (the module imported now).

    Raises:
      ValueError: a reference without one `:`, a module that does not import, or a missing attribute.
    """
    module_name, colon, attribute = reference.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{reference!r} must be 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{reference!r}: module {module_name!r} does not import ({err})") from err
    try:
        return functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"{reference!r}: module {module_name!r} has no {attribute!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCommand:
    """A subcommand of `mstar-jax` a model adds (Gemma 3's `generate`).

    Attributes:
      name: the subcommand.
      help: the one-line description `mstar-jax -h` lists.
      add_arguments: `add_arguments(parser)`, its arguments, with nothing heavier than argparse imported.
      run: `run(args, error) -> exit status`; `error(message)` is the exception a refused argument raises.
    """

    name: str
    help: str
    add_arguments: Callable[..., None]
    run: Callable[..., int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """What `run`, `check`, `serve` and the memory budget know of a model.

    Attributes:
      name: the name deployments give as `model.name`.
      config: its deployment config class: a frozen `kw_only` dataclass whose fields are
        `model.config`'s settings, with `resource_specs()` (the caches the engine builds), and
        optionally `UNREAD_WORKLOAD` / `UNREAD_COMPILE` (settings it refuses because it does not read
        them).
      run: `run(deployment, *, output, progress, implementation, print_fn) -> report`: serve the
        deployment's synthetic workload, print its summary, write its report (`mstar-jax run`).
      build: `build(deployment, *, progress, history, voices) -> (engine, routes)`: the warmed-up engine
        `mstar-jax serve` serves and its endpoints (`mstar_jax.server.routes.ModelRoutes`; `voices` is
        the server's `--voices`, None where not given).
      memory: `memory(deployment, device) -> MemoryBudget`: one device's memory for the deployment.
      check: `check(deployment)`, raising `ValueError` for settings the model cannot run together (run
        when a deployment is made, after every generic check); None: none.
      serve_check: `serve_check(deployment)`, raising `ValueError` for what the model's endpoints cannot
        serve (run by `serve` before it binds or writes anything); None: none.
      commands: the subcommands it adds to `mstar-jax`, each a `ModelCommand`.

    The report `run` returns is a JSON-ready dict with at least `streams: {submitted, done}`
    (`mstar-jax run` exits 1 unless every stream submitted is done).
    """

    name: str
    config: type
    run: str
    build: str
    memory: str
    check: str | None = None
    serve_check: str | None = None
    commands: tuple[ModelCommand, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name={self.name!r} must be a non-empty str")
        if not isinstance(self.config, type) or not dataclasses.is_dataclass(self.config):
            raise TypeError(f"model {self.name!r}: config={self.config!r} must be a dataclass type")
        for field in ("run", "build", "memory", "check", "serve_check"):
            value = getattr(self, field)
            if field in ("check", "serve_check") and value is None:
                continue
            if not isinstance(value, str) or value.count(":") != 1:
                raise TypeError(
                    f"model {self.name!r}: {field}={value!r} must be a 'module:function' reference"
                )
        if not isinstance(self.commands, tuple) or not all(
            isinstance(c, ModelCommand) for c in self.commands
        ):
            raise TypeError(
                f"model {self.name!r}: commands={self.commands!r} must be a tuple of ModelCommand"
            )

    def function(self, part: str) -> Callable[..., Any]:
        """The function `part` ("run", "build", "memory", "check" or "serve_check") names, imported now."""
        return resolve(getattr(self, part))


def _entry_points() -> dict[str, Any]:
    return {point.name: point for point in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def known_models() -> list[str]:
    """The names `model.name` may take (besides a `module:ENTRY` reference), sorted."""
    return sorted({*BUILTIN, *_entry_points()})


def model_entry(name: Any) -> ModelEntry:
    """The entry of the model called `name` (module doc).

    Raises:
      ValueError: an unknown name (listing the known ones), or a reference or entry point that does not
        load a `ModelEntry` of that name.
    """
    if not isinstance(name, str):
        raise ValueError(f"unknown model {name!r}; known models: {known_models()}")
    if name in BUILTIN:
        entry = resolve(BUILTIN[name])
    elif (point := _entry_points().get(name)) is not None:
        try:
            entry = point.load()
        except Exception as err:  # a user's package: whatever it raises, say which entry point
            raise ValueError(f"model {name!r}: entry point {point.value!r} does not load ({err!r})") from err
    elif ":" in name:
        entry = resolve(name)
    else:
        raise ValueError(f"unknown model {name!r}; known models: {known_models()}")
    if not isinstance(entry, ModelEntry):
        raise ValueError(f"model {name!r} names {entry!r}, not a mstar_jax.registry.ModelEntry")
    if ":" not in name and entry.name != name:
        raise ValueError(f"model {name!r} names the entry of model {entry.name!r}")
    return entry


def model_commands() -> dict[str, ModelCommand]:
    """Every subcommand this package's models and the installed ones add, by name.

    Raises:
      ValueError: two models adding one name.
    """
    commands: dict[str, tuple[str, ModelCommand]] = {}
    for name in known_models():
        for command in model_entry(name).commands:
            if command.name in commands:
                raise ValueError(
                    f"models {commands[command.name][0]!r} and {name!r} both add the command {command.name!r}"
                )
            commands[command.name] = (name, command)
    return {name: command for name, (_, command) in commands.items()}


def model_config(name: str, settings: Mapping[str, Any] | None = None) -> Any:
    """Build the config of the model called `name` from its settings.

    Args:
      name: a model's name (`model_entry`).
      settings: keyword arguments of that model's config class; absent ones take their defaults.

    Returns:
      The frozen, validated config.

    Raises:
      ValueError: for an unknown model (listing the known ones), a setting the config does not have
        (listing those it has), or a value the config refuses.
    """
    cls = model_entry(name).config
    settings = {} if settings is None else settings
    if not isinstance(settings, Mapping):
        raise ValueError(f"settings={settings!r} for model {name!r} must be a mapping of setting to value")
    accepted = [field.name for field in dataclasses.fields(cls) if field.init]
    unknown = sorted(set(settings) - set(accepted), key=str)
    if unknown:
        raise ValueError(f"model {name!r} has no setting(s) {unknown}; it accepts {accepted}")
    return cls(**settings)
