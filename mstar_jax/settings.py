"""The run settings of a deployment: what is compiled, how the engine runs, the workload `mstar-jax run`
drives, and the device mesh. Frozen and validated at construction; `deployment.parse_deployment` builds
them from YAML and names the file and section of any refusal.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from mstar_jax.checks import INT32_MAX, brief, check_bool, check_int, check_number

__all__ = [
    "MAX_DECODE_STEPS", "MAX_STREAMS", "MAX_WAIT_S", "CompileSettings", "EngineSettings", "MeshSettings",
    "WorkloadSettings",
]  # fmt: skip

MAX_DECODE_STEPS = 256
"""The most decode steps one program may run (a block's plan holds a table per step)."""
MAX_STREAMS = 10_000_000
"""The most streams a synthetic workload draws (its arrivals and lengths are arrays in host memory)."""
MAX_WAIT_S = 3600.0
"""The longest a setting may make the engine or the workload sleep at once (a backoff, an arrival gap)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompileSettings:
    """What is compiled ahead of time, and where compiled programs persist between starts.

    Attributes:
      batch_sizes: request-count buckets, strictly increasing; None derives them from `min_batch` up
        to the engine's `max_batch` (see `resolved_batch_sizes`).
      token_counts: per-row step-token buckets, strictly increasing; None derives them from
        `min_tokens` up to `max_tokens`.
      min_batch: smallest derived batch bucket (only with `batch_sizes` None).
      min_tokens: smallest derived token bucket (only with `token_counts` None).
      max_tokens: largest derived token bucket (only with `token_counts` None).
      persistent_cache_dir: directory of JAX's persistent compilation cache and, in its `executables`
        folder, of the engine's `ExecutableStore` (a second start loads every program); None: neither.
      persistent_cache_min_compile_secs: programs that compiled faster than this are not persisted.
    """

    batch_sizes: tuple[int, ...] | None = None
    token_counts: tuple[int, ...] | None = None
    min_batch: int = 1
    min_tokens: int = 1
    max_tokens: int = 16
    persistent_cache_dir: str | None = None
    persistent_cache_min_compile_secs: float = 1.0

    def __post_init__(self):
        for name in ("batch_sizes", "token_counts"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _increasing_ints(name, getattr(self, name)))
        for name in ("min_batch", "min_tokens", "max_tokens"):
            check_int(name, getattr(self, name), minimum=1)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name, derives in (
            ("batch_sizes", ("min_batch",)),
            ("token_counts", ("min_tokens", "max_tokens")),
        ):
            ineffective = [
                f"{d}={getattr(self, d)}" for d in derives if getattr(self, d) != _default(self, d)
            ]
            if getattr(self, name) is not None and ineffective:
                raise ValueError(
                    f"{', '.join(ineffective)} has no effect when {name}={list(getattr(self, name))} is "
                    f"given (it only shapes derived buckets); drop one of them"
                )
        if self.persistent_cache_dir is not None and (
            not isinstance(self.persistent_cache_dir, str) or not self.persistent_cache_dir
        ):
            raise ValueError(
                f"persistent_cache_dir={self.persistent_cache_dir!r} must be a non-empty str or null (off)"
            )
        check_number("persistent_cache_min_compile_secs", self.persistent_cache_min_compile_secs, minimum=0.0)

    def resolved_batch_sizes(self, max_batch: int) -> tuple[int, ...]:
        """`batch_sizes`, or `min_batch`, the powers of two between, and `max_batch`."""
        return self.batch_sizes if self.batch_sizes is not None else _doubling(self.min_batch, max_batch)

    def resolved_token_counts(self) -> tuple[int, ...]:
        """`token_counts`, or `min_tokens`, the powers of two between, and `max_tokens`."""
        if self.token_counts is not None:
            return self.token_counts
        return _doubling(self.min_tokens, self.max_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """How the engine loop batches and holds requests.

    Attributes:
      max_batch: most requests in one step; at most every resource's `max_slots` (a request in a
        batch holds a slot in each) and at most the largest batch bucket.
      hold_backoff_s: seconds a request refused for lack of a slot waits before admission is retried
        (at most `MAX_WAIT_S`).
      offload_idle_after_s: seconds a request may sit idle before its slots move to host memory;
        None never offloads.
      snapshot_every: steps between host snapshots of the caches, which let a device fault cost a
        replay instead of the requests it reached; None takes none.
      pipelined: dispatch each step before reading the previous one's outputs, so host work overlaps
        the device's (one device only).
      decode_steps: K, the one-token decode steps one dispatched program runs (`mstar_jax.serving.steps`):
        the host admits, plans and commits them as one block, and a stream joins or leaves decoding at a
        block's boundary. Part of the decode walk's bucket, so the programs are captured for it; every
        output is the same whatever K.
    """

    max_batch: int = 4
    hold_backoff_s: float = 0.005
    offload_idle_after_s: float | None = None
    snapshot_every: int | None = None
    pipelined: bool = False
    decode_steps: int = 1

    def __post_init__(self):
        check_int("max_batch", self.max_batch, minimum=1)
        check_number("hold_backoff_s", self.hold_backoff_s, minimum=0.0, maximum=MAX_WAIT_S)
        if self.offload_idle_after_s is not None:
            check_number("offload_idle_after_s", self.offload_idle_after_s, minimum=0.0)
        if self.snapshot_every is not None:
            check_int("snapshot_every", self.snapshot_every, minimum=1)
        check_bool("pipelined", self.pipelined)
        check_int("decode_steps", self.decode_steps, minimum=1, maximum=MAX_DECODE_STEPS)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSettings:
    """The synthetic workload `mstar-jax run` drives the engine with.

    Attributes:
      streams: requests in the run (at most `MAX_STREAMS`).
      arrival_rate_hz: mean arrivals per second of a Poisson process (at least one per `MAX_WAIT_S`);
        None starts every stream at once.
      voices: distinct voice prompts (shared source prefixes) the streams draw from.
      min_text_tokens: fewest text tokens a stream's prompt has.
      max_text_tokens: most text tokens a stream's prompt has.
      min_frames: fewest codec frames a stream generates (a speech model).
      max_frames: most codec frames a stream generates (a speech model).
      min_new_tokens: fewest tokens a stream generates (a text model).
      max_new_tokens: most tokens a stream generates (a text model).
      seed: seed of the arrivals, lengths and voices drawn.
    """

    streams: int = 6
    arrival_rate_hz: float | None = 4.0
    voices: int = 2
    min_text_tokens: int = 8
    max_text_tokens: int = 24
    min_frames: int = 24
    max_frames: int = 64
    min_new_tokens: int = 16
    max_new_tokens: int = 64
    seed: int = 0

    def arrival_times(self, rng: np.random.Generator) -> np.ndarray:
        """f64[streams]: when each stream arrives, in seconds: a Poisson process of `arrival_rate_hz`
        from 0, or all at 0 when it is None."""
        if self.arrival_rate_hz is None:
            return np.zeros(self.streams)
        gaps = rng.exponential(1.0 / self.arrival_rate_hz, self.streams - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])

    def __post_init__(self):
        check_int("streams", self.streams, minimum=1, maximum=MAX_STREAMS)
        counts = ("voices", "min_text_tokens", "max_text_tokens", "min_frames", "max_frames")
        for name in (*counts, "min_new_tokens", "max_new_tokens"):
            check_int(name, getattr(self, name), minimum=1, maximum=INT32_MAX)
        check_int("seed", self.seed, minimum=0)
        if self.arrival_rate_hz is not None:  # its mean gap is slept: at most MAX_WAIT_S
            check_number("arrival_rate_hz", self.arrival_rate_hz, minimum=1 / MAX_WAIT_S)
        bounds = ("min_text_tokens", "max_text_tokens"), ("min_frames", "max_frames")
        for low, high in (*bounds, ("min_new_tokens", "max_new_tokens")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low}={getattr(self, low)} must be <= {high}={getattr(self, high)}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeshSettings:
    """The device mesh a deployment serves on (docs/design.md §10).

    Attributes:
      data: data shards: independent slot pools, a request on one for its whole life.
      model: model shards: the KV heads (and the query heads that share them) split across devices.
    """

    data: int = 1
    model: int = 1

    def __post_init__(self):
        check_int("data", self.data, minimum=1)
        check_int("model", self.model, minimum=1)

    @property
    def devices(self) -> int:
        return self.data * self.model

    def check_devices(self, available: int, platform: str) -> None:
        """Refuse a mesh larger than the devices present (a smaller one takes the first devices).

        Raises:
          ValueError: naming the mesh, the devices it needs and the devices present.
        """
        if self.devices > available:
            hint = (
                " (on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{self.devices} simulates {self.devices} devices)"
                if platform == "cpu"
                else ""
            )
            raise ValueError(
                f"mesh data={self.data} x model={self.model} needs {self.devices} devices; "
                f"{available} {platform} device(s) are present{hint}"
            )


def _default(obj: Any, name: str) -> Any:
    return next(field.default for field in dataclasses.fields(obj) if field.name == name)


# -- checks -----------------------------------------------------------------------------------------


def _increasing_ints(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, str) or not isinstance(values, tuple | list):
        raise ValueError(f"{name}={brief(values)} must be a list of ints >= 1, or null")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name}=[] must list at least one bucket, or be null to derive them")
    for i, value in enumerate(values):
        check_int(f"{name}[{i}]", value, minimum=1)
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name}={list(values)} must be strictly increasing")
    return values


def _doubling(low: int, high: int) -> tuple[int, ...]:
    """`low`, every power of two strictly between, then `high` (one bucket when they are equal)."""
    buckets = [low]
    power = 1 << low.bit_length()  # the smallest power of two above `low`
    while power < high:
        buckets.append(power)
        power *= 2
    if high > low:
        buckets.append(high)
    return tuple(buckets)
