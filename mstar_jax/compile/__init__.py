"""Bucketed ahead-of-time compilation: buckets, capture and replay, the executable store, and the recompile
guard."""

from mstar_jax.compile.buckets import (
    BatchChunk,
    BatchTooLargeError,
    Buckets,
    BucketSet,
    CombinedRows,
    NoBucketError,
    cap_batch_sizes,
)
from mstar_jax.compile.capture import (
    CapturedStep,
    ReplayError,
    capture,
    configure_persistent_cache,
    disable_persistent_cache,
    enable_persistent_cache,
)
from mstar_jax.compile.frozen import FrozenTree, freeze
from mstar_jax.compile.recompile import (
    CompilationCounter,
    RecompileError,
    RecompileWarning,
    assert_no_compilations,
    count_compilations,
    warn_on_compilations,
)
from mstar_jax.compile.report import BucketReport, CaptureReport
from mstar_jax.compile.store import ExecutableStore, describe

__all__ = [
    "BatchChunk",
    "BatchTooLargeError",
    "BucketReport",
    "BucketSet",
    "Buckets",
    "CaptureReport",
    "CapturedStep",
    "CombinedRows",
    "CompilationCounter",
    "ExecutableStore",
    "FrozenTree",
    "NoBucketError",
    "RecompileError",
    "RecompileWarning",
    "ReplayError",
    "assert_no_compilations",
    "cap_batch_sizes",
    "capture",
    "configure_persistent_cache",
    "count_compilations",
    "describe",
    "disable_persistent_cache",
    "enable_persistent_cache",
    "freeze",
    "warn_on_compilations",
]
