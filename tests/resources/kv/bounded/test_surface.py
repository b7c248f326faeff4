"""The bounded cache's package is its public surface: a serving stack imports the resource and the
per-layer op from `mstar_jax.resources.kv.bounded`, and type checkers read the annotations (PEP 561)."""

from __future__ import annotations

import importlib.resources

import mstar_jax.resources.kv.bounded as bounded
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager


def test_the_manager_and_attend_are_the_packages_own():
    assert bounded.attend is attend
    assert bounded.BoundedKVManager is BoundedKVManager
    for name in bounded.__all__:
        assert getattr(bounded, name).__module__.startswith("mstar_jax.resources.kv.bounded.")


def test_both_packages_are_marked_typed():
    for package in ("mstar_jax", "kernels_pallas"):
        assert importlib.resources.files(package).joinpath("py.typed").is_file()
