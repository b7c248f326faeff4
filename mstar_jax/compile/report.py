"""What capturing cost: per bucket (`BucketReport`) and per captured step (`CaptureReport`, whose `str` is
a table): lowering and compile time, where each program came from, and its compiled memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax

from mstar_jax.resources.step import BucketKey

__all__ = ["BucketReport", "CaptureReport", "memory"]

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BucketReport:
    """What capturing one bucket cost.

    Attributes:
      bucket: the bucket.
      lower_secs: tracing and lowering to StableHLO (0 for a program loaded from a store).
      compile_secs: the XLA compile, or the load from the persistent cache or the store.
      from_cache: whether the program came from JAX's persistent compilation cache.
      loaded: whether the program was loaded from an `ExecutableStore` (nothing traced or compiled).
      argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes: the compiled
        program's `memory_analysis()`, or None where the backend does not report it. Aliased bytes
        are outputs that reuse a donated argument's buffer; temp bytes are allocated while it runs.
    """

    bucket: BucketKey
    lower_secs: float
    compile_secs: float
    from_cache: bool
    loaded: bool = False
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None


def memory(compiled: jax.stages.Compiled) -> dict[str, int | None]:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # backends without the analysis raise (UNIMPLEMENTED) rather than return None
        stats = None
    return {ours: getattr(stats, theirs, None) for ours, theirs in _MEMORY_FIELDS.items()}


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _total(values: Iterable[int | None], combine: Callable[[list[int]], int]) -> int | None:
    known = [v for v in values if v is not None]
    return combine(known) if known else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CaptureReport:
    """Every bucket's `BucketReport`, with totals; `str(report)` is a table.

    Attributes:
      name: the captured step's name.
      buckets: one report per bucket, in capture order.
      wall_secs: wall time of the whole capture (less than the sum when compiling on threads).
    """

    name: str
    buckets: tuple[BucketReport, ...]
    wall_secs: float

    @property
    def lower_secs(self) -> float:
        return sum(b.lower_secs for b in self.buckets)

    @property
    def compile_secs(self) -> float:
        return sum(b.compile_secs for b in self.buckets)

    @property
    def cache_hits(self) -> int:
        return sum(b.from_cache for b in self.buckets)

    @property
    def loaded(self) -> int:
        """Programs loaded from an `ExecutableStore`."""
        return sum(b.loaded for b in self.buckets)

    @property
    def compiled(self) -> int:
        """Programs traced and compiled (from JAX's persistent cache or not)."""
        return len(self.buckets) - self.loaded

    @property
    def generated_code_bytes(self) -> int | None:
        """Code of every program: they stay loaded together."""
        return _total((b.generated_code_bytes for b in self.buckets), sum)

    @property
    def max_temp_bytes(self) -> int | None:
        """The largest scratch one step needs: programs run one at a time."""
        return _total((b.temp_bytes for b in self.buckets), max)

    @property
    def max_argument_bytes(self) -> int | None:
        return _total((b.argument_bytes for b in self.buckets), max)

    def table(self) -> str:
        """A plain-text table: one line per bucket, then the totals."""
        head = ("bucket", "lower s", "compile s", "cache", "args", "out", "alias", "temp", "code")
        rows = [
            (
                str(b.bucket),
                f"{b.lower_secs:.3f}",
                f"{b.compile_secs:.3f}",
                "loaded" if b.loaded else "hit" if b.from_cache else "",
                *(_size(getattr(b, field)) for field in _MEMORY_FIELDS),
            )
            for b in self.buckets
        ]
        total = (
            f"{len(self.buckets)} buckets (wall {self.wall_secs:.2f} s)",
            f"{self.lower_secs:.3f}",
            f"{self.compile_secs:.3f}",
            f"{self.cache_hits} hits, {self.loaded} loaded",
            f"max {_size(self.max_argument_bytes)}",
            "",
            "",
            f"max {_size(self.max_temp_bytes)}",
            _size(self.generated_code_bytes),
        )
        widths = [max(len(r[i]) for r in (head, *rows, total)) for i in range(len(head))]

        def line(r):
            cells = (
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            return "  ".join(cells)

        rule = "-" * len(line(head))
        return "\n".join([f"capture of {self.name}", line(head), rule, *map(line, rows), rule, line(total)])

    def __str__(self) -> str:
        return self.table()
