"""`import mstar_jax`: the names a user starts from, each its home module's object, loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mstar_jax
from mstar_jax import compile as compile_package
from mstar_jax import deployment, settings
from mstar_jax.engine import engine
from mstar_jax.resources.kv.bounded import attention, config, manager, padding
from mstar_jax.serving import model, stream

HOMES = {
    "ServingEngine": engine,
    "EngineSettings": settings,
    "ServedModel": model,
    "Node": model,
    "Stream": stream,
    "BoundedKVManager": manager,
    "BoundedKVSpec": config,
    "BoundedKVConfig": config,
    "SinkWindow": config,
    "attend": attention,
    "pad_step": padding,
    "capture": compile_package,
    "Buckets": compile_package,
    "load_deployment": deployment,
    "Deployment": deployment,
}


def test_every_root_name_is_its_home_modules_object():
    assert sorted(HOMES) == sorted(mstar_jax.__all__)
    for name, home in HOMES.items():
        assert getattr(mstar_jax, name) is getattr(home, name), name
    assert callable(mstar_jax.capture)  # the function, not the module of the same name
    assert set(mstar_jax.__all__) <= set(dir(mstar_jax))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'mstar_jax' has no attribute 'Engine'"):
        _ = mstar_jax.Engine


def test_importing_the_package_loads_neither_jax_nor_the_engine():
    code = (
        "import sys, mstar_jax; "
        "print(sorted(m for m in ('jax', 'mstar_jax.engine', 'mstar_jax.resources') if m in sys.modules))"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]"
