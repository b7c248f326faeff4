"""Compiled programs kept on disk, so that a second start loads every bucket's executable instead of
tracing, lowering and compiling it again.

JAX's persistent compilation cache saves only the XLA compile: a start still traces and lowers every
bucket to find the cache key. An `ExecutableStore` keys a program by what it is built from, known
before tracing: the software and hardware (jax and jaxlib versions, backend, platform version, device
kinds), the JAX settings that change a trace (x64, matmul precision, random bits) and the compilers'
flags (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`), the code (a digest of this library's sources and of the
step's package's, or its module's outside a package), the step's name, the caller's `fingerprint` of
whatever the step closes over (and of helpers it imports from other packages), the static keyword
arguments, the donated arguments, and the bucket's abstract arguments (tree, shapes, dtypes,
shardings). Any difference is another key, so the program is compiled and stored anew; an entry that
cannot be read, loads with other arguments, or fails to deserialize is compiled too.
Nothing here ever raises for a bad entry.

Keys must be the same in every process, so values are described (`describe`) rather than `repr`'d:
functions (a retention policy inside a config) by module, name, bytecode, names, defaults, closure
and defining file, not by address; arrays by a digest of their elements, not a `repr` that elides them.
A program something can only be described by its address (a callable object, say) gets no key: it is
compiled every start and never stored (`unkeyed`).

Entries are pickles of serialized executables with their key (an entry copied onto another key's
file is refused) and the ids of the devices each was compiled for, in its device order, which it is
loaded onto again. Loading one runs code, so the directory must be as
trusted as the code itself.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
import pathlib
import pickle
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

__all__ = ["ExecutableStore", "check_directory", "describe", "environment"]

_SUFFIX = ".executable"
_PACKAGES = ("mstar_jax", "kernels_pallas")


# Settings that change what a traced program computes or how it is partitioned, though its arguments
# and code are the same. Settings that only check a trace (promotion rules, debug checks) are left out:
# a program traced without them is the program a trace with them would give, or an error.
_JAX_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_use_shardy_partitioner",
)
_COMPILER_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def environment() -> dict[str, Any]:
    """What a compiled program depends on outside the program: software, backend and devices, the JAX
    settings that change what is traced (`_JAX_FLAGS`), and the compilers' own flags."""
    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "platform_version": devices[0].client.platform_version,
        "device_kinds": sorted({d.device_kind for d in devices}),
        "devices": len(devices),
        "processes": jax.process_count(),
        "jax_flags": {name: str(jax.config.values.get(name)) for name in _JAX_FLAGS},
        "compiler_flags": {name: os.environ.get(name) for name in _COMPILER_VARIABLES},
    }


@functools.cache
def _source_digest(files: tuple[str, ...]) -> str:
    """The files' names (relative to the folder holding them all: the same code in another checkout or
    on another host has the same digest) and bytes."""
    digest = hashlib.sha256()
    base = os.path.commonpath([os.path.dirname(name) for name in files])
    for name in files:
        digest.update(os.path.relpath(name, base).encode())
        digest.update(pathlib.Path(name).read_bytes())
    return digest.hexdigest()


@functools.cache
def _library_files() -> tuple[str, ...]:
    files = []
    for package in _PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        files.extend(str(p) for p in sorted(root.rglob("*.py")))
    return tuple(files)


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.unwrap(fn)


@functools.cache
def _step_files(module: str, own: str) -> tuple[str, ...]:
    """The sources of the top-level package `module` belongs to (its helpers are part of the program),
    or `own` alone for a module outside a package with an `__init__.py`."""
    package = sys.modules.get(module.split(".")[0])
    init = getattr(package, "__file__", None)
    if not init or pathlib.Path(init).name != "__init__.py":
        return (own,)
    return tuple(sorted({own, *(str(p) for p in pathlib.Path(init).parent.rglob("*.py"))}))


def _code_digest(fn: Callable[..., Any]) -> str | None:
    """The library's sources and the step's package (or its own module): an edit to any is another
    program. Helpers the step imports from outside its package are not read, nor values a module
    computes when imported (from the environment, a file): name them (or their version) in the
    capture's `fingerprint`.

    A step defined where no file holds it (a notebook cell, `python -c`) is keyed by its own source;
    None for one whose source cannot be read at all (it cannot be keyed, so it always compiles).
    """
    library = _source_digest(_library_files())
    step = _unwrap(fn)
    try:
        own = inspect.getfile(step)
    except TypeError:  # a builtin or a callable object without a file: nothing more to digest
        return library
    if own in _library_files():
        return library
    if os.path.isfile(own):
        return library + _source_digest(_step_files(getattr(step, "__module__", None) or "", own))
    try:
        return library + hashlib.sha256(inspect.getsource(step).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def describe(value: Any) -> str:
    """`value` as text that is the same in every process: `repr`, but functions (a retention policy in a
    config, say) by module, name, code, defaults, closure and the file that defines them rather than by
    address, bound methods by their function alone, meshes by their devices too, arrays by their bytes'
    digest, and sets in sorted order. A value whose description still holds an address
    (`<object at 0x...>`) cannot be keyed (`_ADDRESS`)."""
    if isinstance(value, functools.partial):
        bound = [describe(a) for a in value.args]
        bound += [f"{k}={describe(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({describe(value.func)}, {', '.join(bound)})"
    if inspect.ismethod(value):  # what its instance holds is the caller's `fingerprint` to describe
        return f"method {describe(value.__func__)}"
    if inspect.isfunction(value):
        cells = ", ".join(describe(cell.cell_contents) for cell in value.__closure__ or ())
        defaults = describe((value.__defaults__, value.__kwdefaults__))
        return (
            f"{value.__module__}.{value.__qualname__}[{_code_hash(value.__code__)}{_file_digest(value)}]"
            f"({cells}; defaults={defaults})"
        )
    if isinstance(value, jax.sharding.Mesh):  # its repr names its axes but not its devices
        ids = [d.id for d in value.devices.flat]
        return f"Mesh({dict(value.shape)}, axis_types={value.axis_types}, devices={ids})"
    if isinstance(value, np.ndarray | jax.Array):
        return _describe_array(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({', '.join(map(describe, value))})"
    if isinstance(value, set | frozenset):  # iteration order follows hashes, which differ per process
        return f"{type(value).__name__}({', '.join(sorted(map(describe, value)))})"
    if isinstance(value, dict):
        items = sorted((describe(k), describe(v)) for k, v in value.items())
        return f"dict({', '.join(f'{k}: {v}' for k, v in items)})"
    return repr(value)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe_array(array: np.ndarray | jax.Array) -> str:
    """Shape, dtype and a digest of every element: a `repr` elides the middle of a large array."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        # Its bytes are spread over processes: only its address describes it here, so it has no key.
        return f"<array {array.shape} {array.dtype} at 0x{id(array):x}>"
    host = np.ascontiguousarray(np.asarray(array))
    if host.dtype.hasobject:  # its bytes are pointers: another process's differ
        return f"<array {host.shape} of objects at 0x{id(array):x}>"
    return f"array({host.shape}, {host.dtype}, sha256={hashlib.sha256(host.tobytes()).hexdigest()[:16]})"


def _file_digest(fn: Callable[..., Any]) -> str:
    """The digest of the file defining `fn` outside this library (its globals and helpers live there);
    empty for the library's own (digested whole) and for functions with no file (a notebook's)."""
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return ""
    if not path or not os.path.isfile(path) or path in _library_files():
        return ""
    return f", file={_source_digest((path,))[:16]}"


def _code_hash(code: Any) -> str:
    """A function's bytecode with the names, constants and signature it reads, nested functions' code
    included (whose repr is an address): two lambdas differing in one global they call differ here."""
    consts = [_constant(c) for c in code.co_consts]
    shape = (
        code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
        code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
    )  # fmt: skip
    return hashlib.sha256(code.co_code + repr((consts, shape)).encode()).hexdigest()[:16]


def _constant(value: Any) -> str:
    """A code object's constant as `_code_hash` reads it: nested code by its hash, and the frozensets
    `x in {...}` compiles to in sorted order (their repr follows string hashes, which differ per process)."""
    if inspect.iscode(value):
        return _code_hash(value)
    if isinstance(value, frozenset):
        return f"frozenset({sorted(map(_constant, value))})"
    if isinstance(value, tuple):
        return f"({', '.join(map(_constant, value))},)"
    return repr(value)


def check_directory(path: Any, name: str = "directory", *, create: bool = False) -> pathlib.Path:
    """`path` as a `Path`, checked to be a directory that exists or can be created, and written.

    Args:
      path: the directory.
      name: what the messages call it (an argument, a flag such as `--executable-store`, a setting).
      create: make it (and its parents) now, so that what only trying foresees (a read-only or virtual
        file system, where root's access checks pass) refuses it here.

    Raises:
      ValueError: naming `name` and the path, for one that is not a non-empty path, an existing file (or
        anything but a directory), one under a file, or one that cannot be written or created.
    """
    allowed = "it must be a directory (existing or not yet) that can be written"
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ValueError(f"{name}={path!r} must be a non-empty path; {allowed}")
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is an existing file, not a directory; {allowed}")
    existing = path
    while not existing.exists() and existing != existing.parent:  # what `mkdir(parents=True)` builds on
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name}={str(path)!r} is under {str(existing)!r}, a file; {allowed}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={str(path)!r}: {str(existing)!r} is not writable; {allowed}")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()  # an existing directory on a read-only mount
        except OSError as error:
            raise ValueError(
                f"{name}={str(path)!r} cannot be created or written: {error.strerror}; {allowed}"
            ) from None
    return path


def _describe_leaf(leaf: jax.ShapeDtypeStruct) -> list[str]:
    described = [str(tuple(leaf.shape)), str(leaf.dtype), repr(leaf.sharding)]
    if isinstance(leaf.sharding, jax.sharding.NamedSharding):  # its repr leaves the mesh's devices out
        described.append(describe(leaf.sharding.mesh))
    return described


class ExecutableStore:
    """A directory of compiled programs, one file per program key (see the module docstring).

    Args:
      directory: created if missing. Trusted: whoever can write there can make this process run code.

    Raises:
      ValueError: naming `directory`, for a path that is not a directory that exists or can be created
        and written (`check_directory`): an existing file, a path under a file, an empty path.

    Attributes:
      loaded, saved, rejected: programs loaded, programs written, and entries found but not usable
        (unreadable, failed to load, or taking other arguments), since the store was made.
      unkeyed: programs compiled without the store, because no stable key describes them (`key`).
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = check_directory(directory, create=True)
        self.loaded = self.saved = self.rejected = self.unkeyed = 0
        self._lock = threading.Lock()  # capture loads and saves on worker threads

    def __repr__(self) -> str:
        return f"ExecutableStore({str(self.directory)!r})"

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def key(
        self,
        fn: Callable[..., Any],
        bucket: Any,
        args: tuple,
        *,
        static_kwargs: Mapping[str, Any],
        donate_argnums: Sequence[int],
        fingerprint: Any = None,
    ) -> str | None:
        """The program's key: a digest of everything the module docstring lists; None where something
        can only be described by an object's address (a new value each start), so no key would match."""
        code = _code_digest(fn)
        leaves, tree = jax.tree.flatten(args)
        described = json.dumps({
            "environment": environment(),
            "function": describe(fn),
            "fingerprint": describe(fingerprint),
            "bucket": repr(bucket),
            "static": [[name, describe(value)] for name, value in sorted(static_kwargs.items())],
            "donated": list(donate_argnums),
            "tree": str(tree),
            "leaves": [_describe_leaf(leaf) for leaf in leaves],
        }, sort_keys=True)  # fmt: skip
        if code is None or _ADDRESS.search(described):
            self._count("unkeyed")
            return None
        return hashlib.sha256((code + described).encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}{_SUFFIX}"

    def load(self, key: str, args: tuple) -> jax.stages.Compiled | None:
        """The stored program for `key`, checked to take exactly `args`; None where there is none usable."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            stored_key, payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            if stored_key != key:  # an entry copied or renamed onto this key: another program
                raise ValueError("stored under another key")
            local = {device.id: device for device in jax.local_devices()}
            # On the devices it was compiled for, in their order: by default a program is loaded onto
            # every local device, which fails a one-device program on a host of several and aborts
            # the process for a mesh whose devices are not in id order.
            devices = [local[i] for i in device_ids]
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=devices
            )
            expected = [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(args)]
            taken = [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(compiled.args_info[0])]
            if in_tree != jax.tree.structure((args, {})) or taken != expected:
                raise ValueError("stored program takes other arguments")
        except Exception:  # any unusable entry means: compile
            self._count("rejected")
            return None
        self._count("loaded")
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write `compiled` under `key` (atomically); False where the backend cannot serialize it, or the
        entry cannot be written (a directory in its place, a full disk): the program is then compiled
        again next time, as for any entry that cannot be used."""
        try:
            devices = [device.id for device in compiled.runtime_executable().local_devices()]
            payload = pickle.dumps((key, *serialize_executable.serialize(compiled), devices))
        except Exception:  # e.g. programs with constants, or a backend without serialization
            return False
        path = self._path(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            partial.write_bytes(payload)
            os.replace(partial, path)
        except OSError:
            partial.unlink(missing_ok=True)
            return False
        self._count("saved")
        return True

    def entries(self) -> list[pathlib.Path]:
        """The stored programs' files."""
        return sorted(self.directory.glob(f"*{_SUFFIX}"))
