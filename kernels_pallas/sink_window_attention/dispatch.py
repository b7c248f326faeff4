"""How the public ops reach their Pallas kernels: imported on use, jitted once per shape, picked by platform.

Shared by `sink_window_attention` and `store_step`, which differ only in their kernels and settings.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

__all__ = ["by_lowering_platform", "jitted_kernel"]


@functools.cache
def jitted_kernel(module: str, function: str, static_argnames: tuple[str, ...]) -> Callable[..., Any]:
    """`kernels_pallas.sink_window_attention.<module>.<function>`, jitted so a model's layers trace it once.

    Imported on use, so the package imports without the Pallas kernels (and their lowering stacks). "auto"
    traces the TPU and the GPU kernel for every call (only the lowering platform's is lowered): without the
    inner `jit` that is two kernel traces per layer and step function.
    """
    kernel = getattr(importlib.import_module(f"kernels_pallas.sink_window_attention.{module}"), function)
    return jax.jit(kernel, static_argnames=static_argnames)


def by_lowering_platform(
    *arrays: Any, tpu: Callable[..., Any], cuda: Callable[..., Any], default: Callable[..., Any]
) -> Any:
    """`tpu(*arrays)` or `cuda(*arrays)` by the platform the program is lowered for, else `default(*arrays)`.

    A kernel that declines the case (NotImplementedError, raised while tracing) gives way to `default`.
    Every branch is traced, only the lowering platform's is lowered: a program compiled or exported ahead of
    time on a CPU host for TPU or CUDA carries the Pallas kernel.
    """

    def or_default(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*arrays: Any) -> Any:
            try:
                return kernel(*arrays)
            except NotImplementedError:
                return default(*arrays)

        return run

    return lax.platform_dependent(*arrays, tpu=or_default(tpu), cuda=or_default(cuda), default=default)
