"""The tables `mstar-jax check` prints: a deployment's settings, what each resource costs in device memory,
and the budget against one device."""

from __future__ import annotations

from collections.abc import Callable

from mstar_jax.deployment import Deployment
from mstar_jax.memory import MemoryBudget, ResourceCosts, format_bytes
from mstar_jax.resources.kv.bounded.config import SinkWindow

__all__ = ["format_budget", "format_check"]


def _bytes_cell(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)" if n >= 1024 else format_bytes(n)


def _retention(policy: SinkWindow) -> str:
    return f"sink {policy.sink:,} + window {policy.window:,}"


_RESOURCE_ROWS: tuple[tuple[str, Callable[[ResourceCosts], str]], ...] = (
    ("nodes", lambda c: ", ".join(c.nodes)),
    ("layers", lambda c: f"{c.layers:,}"),
    ("kv heads x head dim", lambda c: f"{c.kv_heads} x {c.head_dim}"),
    ("rows per request", lambda c: f"{c.rows_per_request}"),
    ("dtype", lambda c: c.dtype),
    ("source length", lambda c: f"{c.min_source_len:,}..{c.max_source_len:,}"),
    ("retention at min source", lambda c: _retention(c.retention_at_min)),
    ("retention at max source", lambda c: _retention(c.retention_at_max)),
    ("sink capacity", lambda c: f"{c.sink_capacity:,}"),
    ("window capacity", lambda c: f"{c.window_capacity:,}"),
    ("slot tokens", lambda c: f"{c.slot_tokens:,}"),
    ("max retained", lambda c: f"{c.max_retained:,}"),
    ("max slots", lambda c: f"{c.max_slots:,}"),
    ("bytes per slot", lambda c: _bytes_cell(c.slot_bytes)),
    ("bytes for all slots", lambda c: _bytes_cell(c.all_slots_bytes)),
    ("bytes per source (voice)", lambda c: _bytes_cell(c.source_bytes)),
)


def format_check(deployment: Deployment) -> str:
    """The report `mstar-jax check` prints: the deployment's settings, a table of its resources (one
    column each) and the totals."""
    costs = deployment.costs()
    engine, workload = deployment.engine, deployment.workload
    arrivals = (
        "all at once" if workload.arrival_rate_hz is None else f"Poisson {workload.arrival_rate_hz:g} Hz"
    )
    offload = (
        "never" if engine.offload_idle_after_s is None else f"after {engine.offload_idle_after_s:g} s idle"
    )
    cache = deployment.compile.persistent_cache_dir or "off"
    buckets = f"batch sizes {list(deployment.batch_sizes)}, token counts {list(deployment.token_counts)}"
    lines = [
        f"deployment  {deployment.source}",
        f"model       {deployment.model} ({type(deployment.model_config).__name__})",
        f"compile     {buckets}, persistent cache {cache}",
        f"engine      max batch {engine.max_batch}, hold backoff {engine.hold_backoff_s:g} s, "
        f"offload {offload}, {'pipelined' if engine.pipelined else 'synchronous'} steps",
        f"workload    {workload.streams} streams, {arrivals}, {workload.voices} voices, "
        f"text tokens {workload.min_text_tokens}..{workload.max_text_tokens}, "
        f"frames {workload.min_frames}..{workload.max_frames}",
        "",
    ]
    table = [("resource", *(c.key for c in costs))]
    table += [(label, *(cell(c) for c in costs)) for label, cell in _RESOURCE_ROWS]
    lines += _aligned(table)
    total_slot = sum(c.slot_bytes for c in costs)
    total_all = sum(c.all_slots_bytes for c in costs)
    total_sources = sum(c.source_bytes for c in costs)
    lines += [
        "",
        *_aligned(
            [
                ("total bytes per request (a slot in each)", _bytes_cell(total_slot)),
                ("total bytes for all slots", _bytes_cell(total_all)),
                (
                    f"total bytes for {workload.voices} voices (source bank)",
                    _bytes_cell(total_sources * workload.voices),
                ),
            ]
        ),
    ]
    return "\n".join(lines)


def format_budget(budget: MemoryBudget) -> str:
    """The device-memory table `mstar-jax check` prints: each part, the total and the device's memory."""
    verdict = "fits" if budget.fits else "does NOT fit"
    headroom = budget.device.nbytes - budget.total
    rows = [("device memory budget", "")]
    rows += [(f"  {part.label}", _bytes_cell(part.nbytes)) for part in budget.parts]
    rows += [
        ("  total", _bytes_cell(budget.total)),
        (f"  device memory ({budget.device.source})", _bytes_cell(budget.device.nbytes)),
        (
            f"  {'headroom' if headroom >= 0 else 'over by'} ({verdict})",
            _bytes_cell(abs(headroom)),
        ),
    ]
    return "\n".join(_aligned(rows))


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
