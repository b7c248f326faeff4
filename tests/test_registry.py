"""The model registry: this package's models, a user's through an installed entry point or a reference
as `model.name`, and each bad entry refused by name before anything is built."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mstar_jax import registry
from mstar_jax.deployment import DeploymentError, parse_deployment
from mstar_jax.models.gemma3.deployment import Gemma3DeploymentConfig
from mstar_jax.models.gemma3.entry import ENTRY as GEMMA3_ENTRY
from mstar_jax.models.streaming_tts import StreamingTTSConfig
from mstar_jax.models.streaming_tts.entry import ENTRY as TTS_ENTRY
from mstar_jax.registry import ModelEntry, known_models, model_entry, resolve

REFERENCES = {"run": "m:run", "build": "m:build", "memory": "m:memory"}


def test_this_packages_models_resolve_to_their_entries():
    assert known_models() == ["gemma3", "streaming_tts"]
    tts, gemma = model_entry("streaming_tts"), model_entry("gemma3")
    assert (tts, gemma) == (TTS_ENTRY, GEMMA3_ENTRY)
    assert (tts.name, tts.config, gemma.name, gemma.config) == (
        "streaming_tts", StreamingTTSConfig, "gemma3", Gemma3DeploymentConfig,
    )  # fmt: skip
    for entry in (tts, gemma):  # every reference imports and names a function
        for part in ("run", "build", "memory") + (("check",) if entry.check else ()):
            assert callable(entry.function(part)), (entry.name, part)


def test_a_reference_resolves_dotted_attributes_and_refuses_what_does_not_import():
    assert resolve("mstar_jax.registry:ModelEntry.function") is ModelEntry.function
    with pytest.raises(ValueError, match=r"^'mstar_jax.registry' must be 'module:attribute'$"):
        resolve("mstar_jax.registry")
    with pytest.raises(ValueError, match=r"^':x' must be 'module:attribute'$"):
        resolve(":x")
    with pytest.raises(
        ValueError, match=r"^'no_such_module_here:ENTRY': module 'no_such_module_here' does not"
    ):
        resolve("no_such_module_here:ENTRY")
    with pytest.raises(
        ValueError, match=r"^'mstar_jax.registry:NOPE': module 'mstar_jax.registry' has no 'NOPE'$"
    ):
        resolve("mstar_jax.registry:NOPE")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tts", r"^unknown model 'tts'; known models: \['gemma3', 'streaming_tts'\]$"),
        (3, r"^unknown model 3; known models: "),
        (math.nan, r"^unknown model nan; known models: "),
        (None, r"^unknown model None; known models: "),
        ("mstar_jax.registry:BUILTIN", r"^model 'mstar_jax.registry:BUILTIN' names \{.*\}, not a mstar_jax"),
        (
            "tests.no_such_file:ENTRY",
            r"^'tests.no_such_file:ENTRY': module 'tests.no_such_file' does not import",
        ),
        ("tests/test_registry.py", r"^unknown model 'tests/test_registry.py'; known models: "),
    ],
)
def test_an_unknown_or_wrong_model_is_refused_naming_it(name, message):
    with pytest.raises(ValueError, match=message):
        model_entry(name)


def test_a_deployment_naming_a_bad_model_is_refused_by_the_field():
    with pytest.raises(DeploymentError, match=r"model.name: '.*:ENTRY': module 'nowhere' does not import"):
        parse_deployment({"model": {"name": "nowhere:ENTRY"}})
    with pytest.raises(DeploymentError, match=r"model.name: unknown model 'tts'; known models: "):
        parse_deployment({"model": {"name": "tts"}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": ""}, r"^name='' must be a non-empty str$"),
        ({"name": 7}, r"^name=7 must be a non-empty str$"),
        ({"config": int}, r"^model 'x': config=<class 'int'> must be a dataclass type$"),
        (
            {"config": StreamingTTSConfig()},
            r"^model 'x': config=StreamingTTSConfig\(.*must be a dataclass type$",
        ),
        ({"run": "m.run"}, r"^model 'x': run='m.run' must be a 'module:function' reference$"),
        ({"build": None}, r"^model 'x': build=None must be a 'module:function' reference$"),
        ({"memory": math.nan}, r"^model 'x': memory=nan must be a 'module:function' reference$"),
        ({"check": "a:b:c"}, r"^model 'x': check='a:b:c' must be a 'module:function' reference$"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_field(change, message):
    fields = {"name": "x", "config": StreamingTTSConfig, **REFERENCES, **change}
    with pytest.raises(TypeError, match=message):
        ModelEntry(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TinyConfig:
    def resource_specs(self):
        return StreamingTTSConfig().resource_specs()


TINY = ModelEntry(name="tiny", config=_TinyConfig, **REFERENCES)
"""An entry of another name than the one an entry point registers it under."""


class _Point:
    """An installed entry point, as `importlib.metadata` hands it out."""

    def __init__(self, name: str, value: str, loaded):
        self.name, self.value, self._loaded = name, value, loaded

    def load(self):
        if isinstance(self._loaded, Exception):
            raise self._loaded
        return self._loaded


def test_an_installed_entry_point_registers_a_model_by_its_name(monkeypatch):
    points = [_Point("tiny", "user.pkg:TINY", TINY), _Point("broken", "user.pkg:BROKEN", ImportError("gone"))]
    points.append(_Point("renamed", "user.pkg:TINY", TINY))
    seen = []

    def entry_points(*, group):
        seen.append(group)
        return points

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    assert known_models() == ["broken", "gemma3", "renamed", "streaming_tts", "tiny"]
    assert model_entry("tiny") is TINY
    assert set(seen) == {registry.ENTRY_POINTS}
    with pytest.raises(ValueError, match=r"^model 'broken': entry point 'user.pkg:BROKEN' does not load"):
        model_entry("broken")
    with pytest.raises(ValueError, match=r"^model 'renamed' names the entry of model 'tiny'$"):
        model_entry("renamed")
    # A deployment names it like this package's own, and gets its config class.
    deployment = parse_deployment({"model": {"name": "tiny"}})
    assert isinstance(deployment.model_config, _TinyConfig)


def test_a_reference_as_the_model_name_needs_no_installed_package():
    assert model_entry("tests.test_registry:TINY") is TINY
    deployment = parse_deployment({"model": {"name": "tests.test_registry:TINY"}})
    assert (deployment.model, type(deployment.model_config)) == ("tests.test_registry:TINY", _TinyConfig)
