"""Compiling for TPU on a host without one: libtpu's real compiler behind compile-only devices.

`jax.experimental.topologies` gives devices of a TPU topology that exist only to compile for; a program
whose inputs are placed on one of them is lowered and compiled by libtpu exactly as on the chip (Mosaic
layout and VMEM allocation, XLA's layout assignment and the copies it inserts), and nothing runs. The
compiled program's `memory_analysis()`, `cost_analysis()` and optimized HLO (`as_text()`) are what the
tests and `benchmarks/accelerators.py` inspect.

libtpu must be installed at the version the installed jax pins (the `aot` extra). Before libtpu is first
loaded this module sets `TPU_SKIP_MDS_QUERY` (no metadata server to ask) and `ALLOW_MULTIPLE_LIBTPU_LOAD`
(a compile-only client touches no chip, so it need not take libtpu's one-process lock).

A newer libtpu also compiles for jax 0.10.2 when installed on its own, `pip install --no-deps --target
DIR libtpu==0.0.52`. A process loads one libtpu (`libtpu_version` says which), so checks run against the
newer one in a child process whose environment `libtpu_environ(DIR)` gives; `next_libtpu_folder` finds
DIR (`$MSTAR_LIBTPU_NEXT`, or a default such as `libtpu-next` in the environment, where `.ci/run`
installs it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from kernels_pallas.sink_window_attention.tpu_compiler import libtpu_version

__all__ = [
    "GENERATIONS",
    "NEXT_LIBTPU_VAR",
    "TpuGeneration",
    "compile_for_tpu",
    "large_copies",
    "libtpu_environ",
    "libtpu_version",
    "next_libtpu_folder",
    "tpu_device",
    "tpu_toolchain_missing",
]

# Names the folder of a second, newer libtpu (`pip install --no-deps --target`) for `next_libtpu_folder`.
NEXT_LIBTPU_VAR = "MSTAR_LIBTPU_NEXT"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TpuGeneration:
    """A TPU generation as the offline compiler sees it.

    Attributes:
      name: "v4", "v5e", "v5p" or "v6e".
      topology: the smallest topology name `get_topology_desc` accepts for it.
      hbm_bytes_per_s: one chip's HBM bandwidth (public spec sheets), for roofline step times.
    """

    name: str
    topology: str
    hbm_bytes_per_s: float


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(name="v4", topology="v4:2x2x1", hbm_bytes_per_s=1.2e12),
        TpuGeneration(name="v5e", topology="v5e:2x2", hbm_bytes_per_s=819e9),
        TpuGeneration(name="v5p", topology="v5p:2x2x1", hbm_bytes_per_s=2765e9),
        TpuGeneration(name="v6e", topology="v6e:2x2", hbm_bytes_per_s=1640e9),
    )
}

# HLO ops that move a whole buffer: a relayout (copy, transpose) or a memory-space move (copy-start).
# A move may also come as slices (slice-start, whose result names the whole source): those are found by
# the memory space they land in, not by their op.
_MOVING_OPS = ("copy", "transpose", "copy-start")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[\w\-]+)\(")
_ARRAY_SHAPE = re.compile(
    r"\b(?P<dtype>pred|[suf]\d+|bf16|f8\w*)\[(?P<dims>[\d,]*)\](?:\{(?P<layout>[^}]*)\})?"
)
# A layout's memory space, `S(n)`; none is HBM. XLA stages small layers in S(1) (VMEM), on v4 in S(3).
_MEMORY_SPACE = re.compile(r"S\((?P<space>\d+)\)")
_ITEM_BITS = {"pred": 8, "bf16": 16}


def tpu_toolchain_missing() -> str | None:
    """None when libtpu can compile here; else a one-line reason (tests skip with it)."""
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (install the `aot` extra: pip install -e '.[aot]')"
    try:
        tpu_device("v5e")
    except Exception as e:  # libtpu refusing to start, a jax/libtpu version mismatch
        return f"libtpu is installed but cannot compile for TPU here: {type(e).__name__}: {e}"
    return None


def _libtpu_folder(folder: Any, name: str) -> Path:
    """`folder` checked to hold a libtpu installed by `pip install --no-deps --target folder`."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{name}={folder!r} must be a path (str or os.PathLike) to a folder holding libtpu")
    path = Path(folder)
    install = f"install one with: pip install --no-deps --target {path} libtpu==0.0.52"
    if not path.exists():
        raise ValueError(f"{name}={str(path)!r} does not exist; {install}")
    if not path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a file; expected the folder libtpu was installed into")
    if not (path / "libtpu" / "libtpu.so").is_file() or not any(path.glob("libtpu-*.dist-info")):
        raise ValueError(
            f"{name}={str(path)!r} holds no libtpu package (libtpu/libtpu.so and its dist-info); {install}"
        )
    return path.resolve()


def libtpu_environ(folder: str | os.PathLike, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process whose jax loads the libtpu installed in `folder`.

    `folder` goes first on `PYTHONPATH` (so `import libtpu` and its version find it) and `TPU_LIBRARY_PATH`
    names its library: a parent that has loaded libtpu has set that variable to its own one, which jax
    would otherwise load in the child.

    Args:
      folder: where `pip install --no-deps --target folder libtpu==...` put libtpu.
      environ: the environment to start from; defaults to this process's.

    Raises:
      TypeError: `folder` is not a path, or `environ` not a mapping.
      ValueError: `folder` does not exist, is a file, or holds no libtpu package.
    """
    path = _libtpu_folder(folder, "folder")
    if environ is not None and not isinstance(environ, Mapping):
        raise TypeError(f"environ={environ!r} must be a mapping of variable names to values, or None")
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    env["TPU_LIBRARY_PATH"] = str(path / "libtpu" / "libtpu.so")
    return env


def next_libtpu_folder(default: str | os.PathLike | None = None) -> Path | None:
    """The folder of a second, newer libtpu: `$MSTAR_LIBTPU_NEXT` if set (and not empty), else `default`
    if that exists, else None.

    Raises:
      TypeError, ValueError: as `libtpu_environ`, for the folder named (a variable naming a folder that
        is not there is an error, not an absent compiler).
    """
    if value := os.environ.get(NEXT_LIBTPU_VAR):
        return _libtpu_folder(value, NEXT_LIBTPU_VAR)
    if default is None:
        return None
    if not isinstance(default, (str, os.PathLike)):
        raise TypeError(f"default={default!r} must be a path (str or os.PathLike) or None")
    return _libtpu_folder(default, "default") if Path(default).exists() else None


@functools.cache
def tpu_device(generation: str) -> jax.Device:
    """A compile-only device of `generation` (one of `GENERATIONS`)."""
    if generation not in GENERATIONS:
        raise ValueError(f"{generation=} is not one of {sorted(GENERATIONS)}")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS[generation].topology)
    return topology.devices[0]


def compile_for_tpu(
    fn: Callable[..., Any],
    *specs: Any,
    generation: str = "v5e",
    donate_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **static_kwargs: Any,
) -> jax.stages.Compiled:
    """Compiles `jax.jit(fn)` for one chip of `generation` with libtpu; nothing runs.

    Args:
      fn: the function to compile.
      *specs: its positional arguments as pytrees of `jax.ShapeDtypeStruct` (any sharding is replaced by
        the compile-only device).
      generation: a key of `GENERATIONS`.
      donate_argnums: positional arguments donated (their buffers may be updated in place).
      static_argnames, **static_kwargs: static keyword arguments, as for `jax.jit`.

    Returns:
      The compiled program (inspect it with `memory_analysis`, `cost_analysis`, `as_text`).
    """
    sharding = jax.sharding.SingleDeviceSharding(tpu_device(generation))
    placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs)
    jitted = jax.jit(fn, donate_argnums=donate_argnums, static_argnames=static_argnames)
    return jitted.trace(*placed, **static_kwargs).lower(lowering_platforms=("tpu",)).compile()


def _arrays(shape: str) -> list[tuple[int, int]]:
    """(bytes, memory space) of every array in an HLO shape (a tuple holds several)."""
    arrays = []
    for match in _ARRAY_SHAPE.finditer(shape):
        dtype, dims = match["dtype"], match["dims"]
        bits = _ITEM_BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
        space = _MEMORY_SPACE.search(match["layout"] or "")
        arrays.append((size, int(space["space"]) if space else 0))
    return arrays


def large_copies(compiled: jax.stages.Compiled, min_bytes: int) -> list[str]:
    """The optimized HLO's copies, transposes and memory-space moves of buffers of at least `min_bytes`.

    Scans every computation, fusions included (a relayout usually hides in a `copy` inside a loop fusion),
    and returns each offending instruction as `"op name: shape"`: every copy, transpose and copy-start of
    such a buffer, and every instruction that holds one outside HBM (a layer that XLA's memory-space
    assignment staged in VMEM, whichever ops brought it there: copy-start, or slice-start a slice at a time).
    """
    found = []
    for line in compiled.as_text().splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        large = [space for size, space in _arrays(match["shape"]) if size >= min_bytes]
        if large and (match["op"] in _MOVING_OPS or any(large)):
            found.append(f"{match['op']} {match['name']}: {match['shape'][:120]}")
    return found
