"""`StreamingTTSSettings`: what the model's steps are compiled for, checked, compared and named."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from mstar_jax.compile import describe
from mstar_jax.models.streaming_tts import StreamingTTSSettings
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from tests.engine.support import CONFIG


@pytest.fixture(scope="module")
def model() -> StreamingTTSModel:
    return StreamingTTSModel(CONFIG)


def test_a_model_exposes_its_settings_and_reads_its_attributes_from_them(model):
    settings = model.settings
    assert settings == StreamingTTSSettings(
        config=CONFIG, talker_kv=CONFIG.talker_kv_config, flow_kv=CONFIG.flow_kv_config
    )
    assert (model.config, model.talker_kv, model.flow_kv) == (CONFIG, settings.talker_kv, settings.flow_kv)
    assert (model.implementation, model.interpret, model.temperature, model.mesh) == (
        "auto",
        False,
        1.0,
        None,
    )
    # Another instance has equal settings, so it shares programs (a jit static argument's hash and eq).
    again = StreamingTTSModel(CONFIG, temperature=1)
    assert again.settings == settings
    assert hash(again.settings) == hash(settings)
    assert describe(again.settings) == describe(settings)  # the executable store's key: 1 and 1.0 agree
    assert isinstance(again.settings.temperature, float)


@pytest.mark.parametrize("name", ["temperature", "implementation", "config", "mesh"])
def test_a_models_settings_cannot_be_assigned(model, name):
    """A compiled step would not see the new value, so the attribute is read-only."""
    with pytest.raises(AttributeError):
        setattr(model, name, getattr(model, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(model.settings, name, getattr(model.settings, name))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"temperature": -0.5}, ValueError, r"temperature=-0\.5 must be a finite number >= 0"),
        ({"temperature": float("nan")}, ValueError, r"temperature=nan must be a finite number >= 0"),
        ({"temperature": True}, ValueError, r"temperature=True must be a number >= 0"),
        ({"interpret": {"detect_races": True}}, TypeError, r"interpret=.* must be hashable"),
        ({"implementation": None}, TypeError, r"implementation=None must be a str"),
        ({"config": dataclasses.asdict(CONFIG)}, TypeError, r"config=.* must be a StreamingTTSConfig"),
        ({"talker_kv": None}, TypeError, r"talker_kv=None must be a BoundedKVConfig"),
        ({"mesh": "data"}, TypeError, r"mesh='data' must be a jax.sharding.Mesh or None"),
    ],
)
def test_settings_check_their_fields(model, change, error, match):
    with pytest.raises(error, match=match):
        dataclasses.replace(model.settings, **change)


def test_differences_name_each_differing_setting_with_both_values(model):
    settings = model.settings
    assert settings.differences(settings) == ()
    other = dataclasses.replace(
        settings, config=dataclasses.replace(CONFIG, seed=3), temperature=0.7, implementation="xla"
    )
    assert settings.differences(other) == (
        ("config.seed", 0, 3),
        ("implementation", "auto", "xla"),
        ("temperature", 1.0, 0.7),
    )
    # A cache config's retention is a new callable each time; only the field that differs is named.
    slots = dataclasses.replace(settings, talker_kv=dataclasses.replace(CONFIG, max_slots=3).talker_kv_config)
    assert settings.differences(slots) == (("talker_kv.max_slots", 2, 3),)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert settings.differences(dataclasses.replace(settings, mesh=mesh)) == (("mesh", None, mesh),)
    with pytest.raises(TypeError, match="must be a StreamingTTSSettings"):
        settings.differences(model)
