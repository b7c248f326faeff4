"""CPU kernels XLA:CPU has no fast form of, built from C++ on first use and called through `jax.ffi`.

One so far, `screened_argmax`: a greedy decode step's argmax over a tied output projection, read
through an 8-bit copy of its weights (`screen_of`: a quarter of the bytes of the float32 product XLA:CPU
would stream, then a second byte for the few words left) and finished exactly in float32
(`screened_argmax.cc` says how, and why it is exact).

The source is compiled with the host's C++ compiler (`$CXX`, else `c++`) against the XLA FFI headers
jaxlib ships, for the CPU it runs on (`-march=native`), into `$MSTAR_JAX_NATIVE_DIR` (default
`~/.cache/mstar_jax/native`), one library per source, flags, jax version and CPU: about 2 s once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mstar_jax.checks import INT32_MAX, check_int

__all__ = [
    "MAX_WIDTH",
    "RESIDUAL_STEPS",
    "NativeUnavailableError",
    "Screen",
    "abstract_screen",
    "available",
    "build",
    "check_table",
    "screen_of",
    "screened_argmax",
]

_SOURCE = Path(__file__).with_name("screened_argmax.cc")
_TARGET = "mstar_screened_argmax"
# No contraction into fused multiply-adds but the kernel's own: a bound computed twice must be equal.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")


class NativeUnavailableError(RuntimeError):
    """The native kernels cannot be built here (no C++ compiler, or it failed); the message says why."""


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build_dir() -> Path:
    return Path(os.environ.get("MSTAR_JAX_NATIVE_DIR") or Path.home() / ".cache" / "mstar_jax" / "native")


def build() -> str:
    """Build (or find) the kernels' library and register them with XLA; the library's path.

    Raises:
      NativeUnavailableError: with no C++ compiler, or when it fails (its message ends the error's).
    """
    path = _library()
    if isinstance(path, NativeUnavailableError):
        raise NativeUnavailableError(str(path))
    if not _registered:
        # XLA keeps one handler per target name for the process: the first library built serves.
        library = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.MstarScreenedArgmax), platform="cpu")
        _registered.append(path)
    return path


_registered: list[str] = []


@functools.cache
def _library() -> str | NativeUnavailableError:
    """The library's path, built if not yet; or why it cannot be built (kept, so a host without a
    compiler tries once a process, not at every call)."""
    try:
        return _compile()
    except NativeUnavailableError as error:
        return error


def _compile() -> str:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise NativeUnavailableError(f"no C++ compiler {compiler!r} on PATH (set $CXX) to build {_SOURCE}")
    include = jax.ffi.include_dir()
    identity = [_SOURCE.read_text(), compiler, *_FLAGS, jax.__version__, include, _cpu_identity()]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:20]
    directory = _build_dir()
    target = directory / f"screened_argmax-{key}.so"
    if target.exists():
        return str(target)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", str(built)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise NativeUnavailableError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
            os.replace(built, target)  # atomic: a concurrent build finds a whole library or none
    except OSError as error:  # a file where the folder belongs, or no permission
        raise NativeUnavailableError(
            f"MSTAR_JAX_NATIVE_DIR={str(directory)!r} must be a writable folder: {error}"
        ) from error
    return str(target)


def available() -> bool:
    """Whether the native kernels build and load on this host (building them if not yet built)."""
    try:
        build()
    except NativeUnavailableError:
        return False
    return True


RESIDUAL_STEPS = 254
"""Level 2's codes split level 1's rounding step into this many (`screened_argmax.cc`)."""


class Screen(NamedTuple):
    """An output projection's two-level int8 screen, row-major by word (`screen_of`).

    Attributes:
      q: i8[V, E], level 1: `w ~ scales * q`.
      r: i8[V, E], level 2: `w ~ scales * (q + r / 254)`.
      scales: f32[V], each word's step (its largest weight's magnitude / 127).
      slack: f32[2, V], per level and word, the most a logit read at that level can differ from its
        float32 chain, per unit of `sum_e abs(h[e])`.
    """

    q: Any
    r: Any
    scales: Any
    slack: Any


MAX_WIDTH = 2**20
"""The widest hidden state the kernel takes (its int16 codes keep every level-1 sum below 2^31)."""


def check_table(table: Any) -> None:
    """Refuse an output projection the screen cannot serve: not float32 `[E, V]` with 1 <= E <= 2^20 and
    1 <= V < 2^31.

    Raises:
      ValueError: naming the table's shape and dtype and what is allowed.
    """
    shape, dtype = tuple(table.shape), jnp.dtype(table.dtype)
    if (
        len(shape) != 2 or dtype != jnp.float32 or not 1 <= shape[0] <= MAX_WIDTH
        or not 1 <= shape[1] <= INT32_MAX
    ):  # fmt: skip
        raise ValueError(
            f"table of shape {shape} and dtype {dtype} must be float32 [E, V] with E in [1, {MAX_WIDTH}] and "
            f"V in [1, {INT32_MAX}]"
        )


def abstract_screen(words: int, width: int) -> Screen:
    """`screen_of`'s shapes and dtypes (nothing allocated), for a memory budget."""
    codes = jax.ShapeDtypeStruct((words, width), jnp.int8)
    return Screen(
        codes,
        codes,
        jax.ShapeDtypeStruct((words,), jnp.float32),
        jax.ShapeDtypeStruct((2, words), jnp.float32),
    )


def screen_of(table: Any, *, chunk: int = 8192) -> Screen:
    """The screen of an output projection held `[E, V]` (float32), computed on the host in float64.

    Each word's slack at each level is its largest quantisation error over e, plus the float32 rounding
    of a sum of E products of either kind (`2.02 (E + 1) 2^-24` of the word's largest magnitude, the
    standard bound), rounded up to float32. A word with a weight that is not finite gets an infinite
    slack (every row then computes every word exactly).
    """
    table = np.asarray(table)
    check_table(table)
    width, words = table.shape
    rounding = 2.02 * (width + 1) * 2.0**-24 + 2.0**-30
    q = np.empty((words, width), np.int8)
    r = np.empty((words, width), np.int8)
    scales = np.empty(words, np.float32)
    slack = np.empty((2, words), np.float64)
    for start in range(0, words, chunk):
        w = table[:, start : start + chunk].T.astype(np.float64)
        finite = np.isfinite(w).all(axis=1)
        w = np.where(finite[:, None], w, 0.0)
        magnitude = np.abs(w).max(axis=1)
        step = (magnitude / 127).astype(np.float32).astype(np.float64)
        step = np.where(step > 0, step, 1.0)  # a word of zeros, or one so small its step rounds to 0
        first = np.clip(np.rint(w / step[:, None]), -127, 127)
        second = np.clip(np.rint((w - step[:, None] * first) * RESIDUAL_STEPS / step[:, None]), -127, 127)
        levels = (step[:, None] * first, step[:, None] * (first + second / RESIDUAL_STEPS))
        for level, approximation in enumerate(levels):
            error = np.abs(w - approximation).max(axis=1)
            slack[level, start : start + chunk] = np.where(
                finite, error + rounding * (magnitude + error), np.inf
            )
        q[start : start + chunk], r[start : start + chunk] = first, second
        scales[start : start + chunk] = step
    rounded = slack.astype(np.float32)
    rounded = np.where(rounded < slack, np.nextafter(rounded, np.float32(np.inf)), rounded)
    return Screen(jnp.asarray(q), jnp.asarray(r), jnp.asarray(scales), jnp.asarray(rounded))


def screened_argmax(
    hidden: jax.Array, screen: Screen, table: jax.Array, *, threads: int | None = None
) -> jax.Array:
    """i32[...]: for each row of `hidden` [..., E], the word v with the largest float32 logit
    `sum_e hidden[e] * table[e, v]` (one fused multiply-add chain in e order; ties to the lowest v, a NaN
    as `jnp.argmax` takes it), read through `screen` = `screen_of(table)`. CPU only.

    Raises:
      ValueError: for arrays of the wrong shape or dtype, naming which.
      NativeUnavailableError: where the kernel cannot be built.
    """
    check_int("threads", threads, minimum=1, allow_none=True, type_error=True)
    if hidden.ndim < 1 or not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise ValueError(f"hidden of shape {hidden.shape} and dtype {hidden.dtype} must be floats [..., E]")
    width = hidden.shape[-1]
    check_table(table)
    if table.shape[0] != width:
        raise ValueError(f"table of shape {table.shape} must be [{width}, V]: hidden rows hold {width}")
    words = table.shape[1]
    want = abstract_screen(words, width)
    for name, got, shape in zip(Screen._fields, screen, want, strict=True):
        if got.shape != shape.shape or got.dtype != shape.dtype:
            raise ValueError(
                f"screen.{name} of shape {got.shape} and dtype {got.dtype} must be {shape.dtype} "
                f"{list(shape.shape)} (screen_of(table))"
            )
    build()
    lead = hidden.shape[:-1]
    rows = hidden.reshape(-1, width).astype(jnp.float32)
    result = jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32)
    call = jax.ffi.ffi_call(_TARGET, result, vmap_method="sequential")
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return call(rows, *screen, table, threads=threads).reshape(lead)
