"""Capture and replay: compile a step for every bucket at load time, then run batches padded to a bucket.

`capture` lowers and compiles the step once per `BucketKey` from abstract arguments
(`jax.ShapeDtypeStruct` pytrees: nothing is allocated on the device), the state argument donated, and
returns a `CapturedStep` holding `{BucketKey: jax.stages.Compiled}` plus a `CaptureReport` of compile
time and compiled memory per bucket (`report`). `CapturedStep.replay(bucket, *args)` calls the bucket's
program; a call with the wrong shapes raises `ReplayError` and never compiles (a step is padded to its
bucket before, by `pad_step`).

A second start can skip work two ways. JAX's persistent compilation cache (`enable_persistent_cache`,
or `configure_persistent_cache` from a deployment's `CompileSettings`) skips the XLA compile but still
traces and lowers every bucket; an `ExecutableStore` (`capture(..., store=)`) loads each bucket's
serialized executable and skips all three, falling back to compiling wherever an entry is missing or
does not fit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from tqdm.auto import tqdm

from mstar_jax.checks import check_int, check_number
from mstar_jax.compile.buckets import NoBucketError
from mstar_jax.compile.frozen import FrozenTree, freeze, thaw
from mstar_jax.compile.recompile import count_compilations
from mstar_jax.compile.report import BucketReport, CaptureReport, memory
from mstar_jax.compile.store import ExecutableStore
from mstar_jax.resources.step import BucketKey

__all__ = [
    "CapturedStep",
    "ReplayError",
    "capture",
    "configure_persistent_cache",
    "disable_persistent_cache",
    "enable_persistent_cache",
]


class ReplayError(TypeError):
    """A captured program was called with arguments it was not compiled for (it never recompiles)."""


# -- capture ----------------------------------------------------------------------------------------


def _check_abstract(bucket: BucketKey, args: Any) -> tuple:
    if not isinstance(args, tuple):
        raise TypeError(
            f"abstract_args({bucket}) returned {type(args).__name__}; it must return the step's positional "
            "arguments as a tuple"
        )
    leaves, _ = jax.tree_util.tree_flatten_with_path(args)
    for path, leaf in leaves:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            where = f"args{jax.tree_util.keystr(path)}"
            raise TypeError(
                f"abstract_args({bucket}) gave {where} = {type(leaf).__name__}; every leaf must be a "
                "jax.ShapeDtypeStruct (capture allocates no dummy arrays: use "
                "jax.ShapeDtypeStruct(x.shape, x.dtype)); pass Python constants as static_kwargs"
            )
    return args


def capture(
    fn: Callable[..., Any],
    buckets: Iterable[BucketKey],
    abstract_args: Callable[[BucketKey], tuple],
    *,
    static_kwargs: Mapping[str, Any] | None = None,
    donate_argnums: int | Sequence[int] = (),
    name: str | None = None,
    progress: bool = True,
    max_workers: int = 1,
    store: ExecutableStore | None = None,
    fingerprint: Any = None,
    frozen_argnums: int | Sequence[int] = (),
) -> CapturedStep:
    """Compile `fn` ahead of time for every bucket, or load it from `store`.

    Each bucket runs `jax.jit(fn, donate_argnums=..., static_argnames=...).lower(*abstract_args(bucket),
    **static_kwargs).compile()`.

    Args:
      fn: the pure step, `fn(state, *inputs, **static) -> (state, outputs)`.
      buckets: the buckets to compile (a `BucketSet`, or `Buckets.keys()` filtered to this step's walks).
      abstract_args: bucket -> the positional arguments as `jax.ShapeDtypeStruct` pytrees. Shardings on
        them are compiled in; serving must pass arrays with the same shardings.
      static_kwargs: keyword arguments baked into every program (hashable: configs, flags).
      donate_argnums: the positional arguments whose buffers the step reuses (the cache).
      name: for the progress bar and the report (default: `fn.__name__`).
      progress: show a tqdm progress bar.
      max_workers: compile this many buckets at once on threads (XLA compiles without the GIL).
      store: where to load each bucket's program from, and to save the ones compiled (None: compile).
      fingerprint: for the store's keys, every setting `fn` closes over that its arguments and
        `static_kwargs` do not show (a bound method's instance settings, say), as a value (configs,
        tuples, numbers): programs are told apart by it, so leaving one out would load a program built
        for another setting.
      frozen_argnums: positional arguments (the weights) each program takes as a `FrozenTree`, thawed
        inside the trace: a caller that freezes them once (`freeze`) passes them at no flattening cost
        every step; `replay` freezes any other value passed there, each call.

    Returns:
      The `CapturedStep`.

    Raises:
      ValueError: for no buckets or a bucket given twice.
      TypeError: for abstract arguments that are not `jax.ShapeDtypeStruct` specs.
    """
    keys = tuple(buckets)
    if not keys:
        raise ValueError("buckets is empty; capture needs at least one BucketKey")
    if len(set(keys)) != len(keys):
        raise ValueError(f"buckets names a bucket twice: {[str(k) for k in keys]}")
    check_int("max_workers", max_workers, minimum=1)
    static = dict(static_kwargs or {})
    donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    frozen = (frozen_argnums,) if isinstance(frozen_argnums, int) else tuple(frozen_argnums)
    for i in frozen:
        check_int("frozen_argnums", i, minimum=0)
    if any(i in donated for i in frozen):
        raise ValueError(f"{frozen_argnums=} and {donate_argnums=} name the same argument")
    label = name or getattr(fn, "__name__", "step")
    jitted = jax.jit(_thawing(fn) if frozen else fn, donate_argnums=donated, static_argnames=tuple(static))

    def build(bucket: BucketKey) -> tuple[jax.stages.Compiled, BucketReport]:
        args = _freeze_args(_check_abstract(bucket, abstract_args(bucket)), frozen)
        if store is not None:
            start = time.perf_counter()
            key = store.key(
                fn, bucket, args, static_kwargs=static, donate_argnums=donated, fingerprint=fingerprint
            )
            compiled = None if key is None else store.load(key, args)
            if compiled is not None:
                report = BucketReport(
                    bucket=bucket, lower_secs=0.0, compile_secs=time.perf_counter() - start, from_cache=False,
                    loaded=True, **memory(compiled),
                )  # fmt: skip
                return compiled, report
        with count_compilations(current_thread_only=True) as counter:
            start = time.perf_counter()
            lowered = jitted.lower(*args, **static)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
            done = time.perf_counter()
        report = BucketReport(
            bucket=bucket, lower_secs=lowered_at - start, compile_secs=done - lowered_at,
            from_cache=counter.cache_hits > 0, **memory(compiled),
        )  # fmt: skip
        # A program JAX's persistent cache gave back is not stored: XLA:CPU serializes such an executable
        # without its kernels, and a later start that loads it fails at run time ("NOT_FOUND: Function
        # ... not found"). A start that misses the store loads it from that cache again.
        if store is not None and key is not None and not report.from_cache:
            store.save(key, compiled)
        return compiled, report

    start = time.perf_counter()
    results: dict[BucketKey, tuple[jax.stages.Compiled, BucketReport]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers) if max_workers > 1 else contextlib.nullcontext()
    bar = tqdm(total=len(keys), desc=f"capture {label}", unit="bucket", disable=not progress)
    with bar, pool as executor:
        if executor is None:
            pending = ((key, build(key)) for key in keys)
        else:
            futures = {executor.submit(build, key): key for key in keys}
            pending = ((futures[f], f.result()) for f in concurrent.futures.as_completed(futures))
        for key, result in pending:
            results[key] = result
            bar.set_postfix_str(str(key), refresh=False)
            bar.update()
    report = CaptureReport(
        name=label, buckets=tuple(results[k][1] for k in keys), wall_secs=time.perf_counter() - start
    )
    programs = types.MappingProxyType({k: results[k][0] for k in keys})
    return CapturedStep(
        name=label, programs=programs, report=report, donate_argnums=donated, frozen_argnums=frozen
    )


def _thawing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` taking its `FrozenTree` arguments thawed (its signature kept: jit reads static names in it)."""

    @functools.wraps(fn)
    def thawed(*args, **kwargs):
        return fn(*map(thaw, args), **kwargs)

    return thawed


def _freeze_args(args: tuple, frozen: tuple[int, ...]) -> tuple:
    if not any(i < len(args) and not isinstance(args[i], FrozenTree) for i in frozen):
        return args
    return tuple(freeze(x) if i in frozen else x for i, x in enumerate(args))


# -- replay -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CapturedStep:
    """A step compiled for every bucket.

    Attributes:
      name: the step's name.
      programs: bucket -> compiled program (read-only).
      report: what the capture cost.
      donate_argnums: the positional arguments each call consumes.
      frozen_argnums: the positional arguments its programs take as a `FrozenTree` (`capture`).
    """

    name: str
    programs: Mapping[BucketKey, jax.stages.Compiled]
    report: CaptureReport
    donate_argnums: tuple[int, ...] = ()
    frozen_argnums: tuple[int, ...] = ()

    def __contains__(self, bucket: object) -> bool:
        return bucket in self.programs

    def __len__(self) -> int:
        return len(self.programs)

    @property
    def buckets(self) -> tuple[BucketKey, ...]:
        return tuple(self.programs)

    def replay(self, bucket: BucketKey, *args: Any) -> Any:
        """Run the bucket's program on arguments of exactly its shapes; nothing ever compiles here.

        Raises:
          NoBucketError: for a bucket that was not captured.
          ValueError: when a donated argument was already consumed by an earlier call.
          ReplayError: for arguments of other shapes, dtypes or structure than the bucket's.
        """
        program = self.programs.get(bucket)
        if program is None:
            captured = [str(b) for b in self.programs]
            raise NoBucketError(f"bucket {bucket} was not captured for {self.name}; captured: {captured}")
        for i in self.donate_argnums:
            if i < len(args) and any(
                isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(args[i])
            ):
                raise ValueError(
                    f"{self.name} argument {i} was donated to an earlier step and its buffers are gone; pass "
                    "the state the previous step returned (e.g. cache, out = step.replay(bucket, cache, ...))"
                )
        args = _freeze_args(args, self.frozen_argnums)
        try:
            return program(*args)
        except TypeError as err:
            raise ReplayError(
                f"{self.name} bucket {bucket} was called with arguments it was not compiled for (a captured "
                f"program never recompiles): {err}\nPad the batch to the bucket first (a bounded cache's "
                "step: pad_step, or mstar_jax.serving.declare)."
            ) from None


# -- persistent compilation cache -------------------------------------------------------------------


def _reset_cache() -> None:
    # JAX decides once per process, at the first compile, whether the persistent cache is on; resetting
    # makes a directory set after that compile take effect.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def enable_persistent_cache(
    directory: str, *, min_compile_secs: float = 1.0, min_entry_size_bytes: int = 0
) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (created if missing).

    Args:
      directory: where compiled programs are written and looked up. Trusted: whoever can write there
        can make this process run code.
      min_compile_secs: programs that compiled faster are not written (0 writes every program).
      min_entry_size_bytes: smaller programs are not written (0: JAX's default; -1: no limit).
    """
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"directory={directory!r} must be a non-empty str")
    check_number("min_compile_secs", min_compile_secs, minimum=0, finite=False)
    check_int("min_entry_size_bytes", min_entry_size_bytes, minimum=-1)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_size_bytes)
    _reset_cache()


def disable_persistent_cache() -> None:
    """Turn the persistent compilation cache off and restore JAX's default thresholds."""
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_cache()


def configure_persistent_cache(settings: Any) -> bool:
    """Apply a deployment's `CompileSettings` (`persistent_cache_dir`, `persistent_cache_min_compile_secs`).

    Returns:
      Whether the cache is on (a None directory leaves JAX's configuration untouched).
    """
    if settings.persistent_cache_dir is None:
        return False
    enable_persistent_cache(
        settings.persistent_cache_dir, min_compile_secs=settings.persistent_cache_min_compile_secs
    )
    return True
