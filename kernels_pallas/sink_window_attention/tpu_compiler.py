"""What the TPU compiler jax loads accepts, told by the version of its libtpu.

The store kernel aliases the cache it writes to its outputs. On a layer small enough for VMEM, XLA's
memory-space assignment moves that layer into VMEM and back around the call every step unless the kernel's
operands are pinned to HBM (`pltpu.with_memory_space_constraint`). libtpu up to 0.0.49 rejects the pin on
an aliased operand that is a program parameter ("Different aliasing shapes", a RET_CHECK of XLA's HLO
verifier after optimization); 0.0.50 and later compile it. Probed with a store-only program on 0.0.42.1,
0.0.47, 0.0.48.1, 0.0.49 (rejected) and 0.0.50, 0.0.51, 0.0.52 (compiled).

The rejection comes from the compiler, after tracing, so the kernel cannot try the pin and fall back: it
decides while tracing, from the version of the libtpu jax will load (or has loaded). jax loads the library
named by `TPU_LIBRARY_PATH` if that is a file, else the `libtpu` package's; the version is that of the
package installed beside the library. Where none is found (no libtpu, a library outside a package), the
store is not pinned, as before the newer compilers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

from jax.experimental.pallas import tpu as pltpu

__all__ = ["PIN_ALIASED_MIN_LIBTPU", "libtpu_version", "pins_aliased_operands"]

# The first libtpu release found to compile an aliased Mosaic operand pinned to HBM (see above).
PIN_ALIASED_MIN_LIBTPU = (0, 0, 50)


def _library_path() -> str | None:
    """The libtpu shared library jax loads, chosen as jax's `get_tpu_library_path` chooses it."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and os.path.isfile(path):
        return path
    spec = importlib.util.find_spec("libtpu")
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "libtpu.so")


def libtpu_version() -> str | None:
    """The version of the libtpu package whose library jax loads, or None where there is none."""
    path = _library_path()
    if path is None:
        return None
    # A package installs `<site>/libtpu/libtpu.so` and `<site>/libtpu-<version>.dist-info`.
    site = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    for dist in importlib.metadata.distributions(name="libtpu", path=[site]):
        return dist.version
    return None


def _release(version: str) -> tuple[int, ...]:
    """'0.0.52' -> (0, 0, 52); a pre-release or local suffix ('0.0.53.dev20260101') is dropped."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match[0].split(".")) if match else ()


def pins_aliased_operands() -> bool:
    """Whether kernels pin aliased operands to HBM: the loaded libtpu accepts it and this JAX has the pin."""
    version = libtpu_version()
    return (
        version is not None
        and _release(version) >= PIN_ALIASED_MIN_LIBTPU
        and hasattr(pltpu, "with_memory_space_constraint")
    )
