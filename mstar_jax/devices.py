"""One device's memory, and sizes in bytes as people write them: what `mstar-jax check` budgets against.

`device_memory()` reads the accelerator's allocator `bytes_limit` where it reports one, else the host's
RAM (where a CPU device allocates); `parse_size` reads `--device-memory` values such as `16GiB`.
"""

from __future__ import annotations

import dataclasses
import fractions
import os
import re
from pathlib import Path

from mstar_jax.checks import brief
from mstar_jax.errors import DeploymentError

__all__ = ["DeviceMemory", "DeviceMemoryError", "device_memory", "format_bytes", "host_memory", "parse_size"]


class DeviceMemoryError(DeploymentError):
    """A deployment that does not fit its device's memory, or a device whose memory cannot be read."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMemory:
    """The memory of the device a deployment runs on.

    Attributes:
      nbytes: bytes a deployment may allocate there.
      source: where the number comes from, e.g. `host RAM` or `--device-memory`.
    """

    nbytes: int
    source: str


def device_memory() -> DeviceMemory:
    """The memory of the device the engine would run on (JAX's default device).

    An accelerator's allocator `bytes_limit` where it reports one (what JAX may allocate there, after
    its reserved fraction), else the host's RAM (`host_memory`), where a CPU device allocates.

    Raises:
      DeviceMemoryError: when JAX cannot start its backend (the device busy, say); the message says
        to give the size with `--device-memory`.
    """
    import jax

    try:
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
    except RuntimeError as err:
        raise DeviceMemoryError(
            f"cannot read the device's memory ({err}); give it with --device-memory, e.g. 16GiB"
        ) from None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        return DeviceMemory(nbytes=int(limit), source=f"{device.device_kind} bytes_limit")
    return DeviceMemory(nbytes=host_memory(), source="host RAM")


def host_memory() -> int:
    """The host's RAM in bytes, or the container's cgroup memory limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # cgroup v2 writes "max" for no limit
            total = min(total, int(text))
    return total


_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes of a size such as `16GiB`, `1.5 TiB`, `80GB` or `1073741824` (binary or decimal units).

    Raises:
      ValueError: naming the text and the units allowed, for anything else or a size below 1 byte.
    """
    # 40 digits: far past any device (10**40 bytes), short of Python's int-parsing limit
    match = re.fullmatch(r"\s*(\d{1,40}(?:\.\d{0,40})?)\s*([A-Za-z]*)\s*", text)
    if match is None or match[2].lower() not in _UNITS:
        raise ValueError(
            f"size={brief(text)} must be a number of at most 40 digits with an optional unit (B, KiB, MiB, "
            "GiB, TiB, PiB, or kB, MB, GB, TB, PB), e.g. 16GiB"
        )
    nbytes = int(fractions.Fraction(match[1]) * _UNITS[match[2].lower()])
    if nbytes < 1:
        raise ValueError(f"size={text!r} must be at least 1 byte")
    return nbytes


# -- helpers ----------------------------------------------------------------------------------------

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """`n` bytes in binary units with one decimal, e.g. `1.5 MiB`; below 1 KiB, exact (`512 B`)."""
    if n < 1024:
        return f"{n} B"
    unit = 0
    value = float(n)
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_BYTE_UNITS[unit]}"
