"""Compilation counting: prove that serving compiles nothing once every bucket was captured.

JAX reports each XLA compilation through its public monitoring hooks (`jax.monitoring`) as the
duration event `/jax/core/compile/backend_compile_duration`, recorded around every backend compile:
a `jit` cache miss, an eager op on a new shape, an ahead-of-time `.compile()`, and a program loaded
from the persistent compilation cache (which also records `/jax/compilation_cache/cache_hits`). A
call to an already compiled program, `jax.stages.Compiled` included, records nothing.

One listener is registered once per process and fans events out to the counters that are open, so
opening a counter per engine step costs a list append. Counters see every thread's compilations
unless opened with `current_thread_only=True`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator

import jax

__all__ = [
    "BACKEND_COMPILE_EVENT",
    "PERSISTENT_CACHE_HIT_EVENT",
    "CompilationCounter",
    "RecompileError",
    "RecompileWarning",
    "assert_no_compilations",
    "count_compilations",
    "warn_on_compilations",
]

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""JAX's duration event around each backend compile (`jax._src.dispatch.BACKEND_COMPILE_EVENT`)."""
PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""JAX's event for a program loaded from the persistent compilation cache instead of compiled."""


class RecompileError(RuntimeError):
    """Something compiled where nothing may (`assert_no_compilations`)."""


class RecompileWarning(RuntimeWarning):
    """Serving compiled a program: a shape, dtype or sharding no captured bucket covers."""


@dataclasses.dataclass(eq=False)
class CompilationCounter:
    """Compilations seen while the counter was open.

    Attributes:
      count: backend compilations (persistent-cache loads included).
      cache_hits: how many of them were loaded from the persistent compilation cache.
      seconds: their total duration.
      names: the compiled functions' names, in order (e.g. "jit(step)").
      thread: the only thread counted, or None for every thread.
    """

    count: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    names: list[str] = dataclasses.field(default_factory=list)
    thread: int | None = None

    def summary(self) -> str:
        """One line naming what compiled, for messages."""
        shown = ", ".join(self.names[:8]) + (", ..." if len(self.names) > 8 else "")
        return f"{self.count} compilation(s) in {self.seconds:.3f} s: {shown or '-'}"


_lock = threading.Lock()
_open: list[CompilationCounter] = []
_registered = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    name, ident = str(kwargs.get("fun_name", "?")), threading.get_ident()
    with _lock:
        for counter in _open:
            if counter.thread in (None, ident):
                counter.count += 1
                counter.seconds += duration
                counter.names.append(name)


def _on_event(event: str, **kwargs) -> None:
    if event != PERSISTENT_CACHE_HIT_EVENT:
        return
    ident = threading.get_ident()
    with _lock:
        for counter in _open:
            if counter.thread in (None, ident):
                counter.cache_hits += 1


def _ensure_listeners() -> None:
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _registered = True


@contextlib.contextmanager
def count_compilations(*, current_thread_only: bool = False) -> Iterator[CompilationCounter]:
    """Count the XLA compilations inside the `with` block.

    Args:
      current_thread_only: count only compilations run by the calling thread (e.g. to attribute
        compile time per bucket while other threads compile too).

    Yields:
      a `CompilationCounter`, updated live and final when the block exits.
    """
    _ensure_listeners()
    counter = CompilationCounter(thread=threading.get_ident() if current_thread_only else None)
    with _lock:
        _open.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _open.remove(counter)


@contextlib.contextmanager
def assert_no_compilations(what: str = "this block") -> Iterator[CompilationCounter]:
    """Raise `RecompileError` when the block compiled anything (tests, and engines that must not).

    Raises:
      RecompileError: on exit, naming what compiled; the block's own exception wins if it raised.
    """
    with count_compilations() as counter:
        yield counter
    if counter.count:
        raise RecompileError(
            f"{what} compiled {counter.summary()}. After capture nothing may compile: a step's inputs "
            "must have exactly a captured bucket's shapes, dtypes and shardings (pad them with the "
            "bucket's padding helpers), and eager jnp ops on new shapes compile too (use numpy on the host)"
        )


@contextlib.contextmanager
def warn_on_compilations(what: str = "serving") -> Iterator[CompilationCounter]:
    """Warn with a `RecompileWarning` when the block compiled anything; serving goes on."""
    with count_compilations() as counter:
        yield counter
    if counter.count:
        warnings.warn(
            f"{what} compiled {counter.summary()}; a captured bucket should have covered it "
            "(check the step's shapes, dtypes and shardings against its bucket)",
            RecompileWarning,
            stacklevel=3,
        )
