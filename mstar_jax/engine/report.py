"""What any served model's run reports of the engine: latency percentiles per walk, compilation,
admission, the pipeline, the mesh, and the step-latency plot beside `report.json`.

A model's report (`mstar-jax run`'s summary) adds its own figures to these.
"""

from __future__ import annotations

import collections
import itertools
import json
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "format_mib",
    "format_ms",
    "latency_by_walk",
    "mesh_report",
    "percentiles",
    "plot_step_latency",
    "serving_report",
    "step_latency_figure",
    "write_report",
]


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    if not len(values):
        return {"p50": None, "p99": None, "max": None}
    array = np.asarray(values, np.float64) * scale
    return {
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def latency_by_walk(records) -> dict[str, dict[str, Any]]:
    """Each graph walk's steps and their latency percentiles (ms), from the engine's step records."""
    by_walk = {}
    for walk in sorted({r.walk for r in records}):
        walk_lat = [r.latency for r in records if r.walk == walk]
        by_walk[walk] = {"steps": len(walk_lat), **percentiles(walk_lat, 1e3)}
    return by_walk


def serving_report(engine: Any, *, capture_secs: float, warmup_compilations: int) -> dict[str, Any]:
    """What every model's report says of the engine: compilation, admission and the pipeline."""
    stats = engine.stats
    return {
        "compile": {
            "buckets": sum(len(step) for step in engine.programs.steps.values()),
            "capture_wall_seconds": capture_secs,
            "loaded_from_store": sum(step.report.loaded for step in engine.programs.steps.values()),
            "warmup_compilations": warmup_compilations,
            "compilations_after_warmup": engine.compilations,
        },
        "admission": stats.admission(),
        "pipeline": {"pipelined": engine.pipelined, **stats.pipeline()},
    }


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def format_mib(value: int) -> str:
    return f"{value / 2**20:.3f} MiB" if value >= 2**16 else f"{value / 1024:.1f} KiB"


def plot_step_latency(engine: Any, path: pathlib.Path) -> None:
    """Write `step_latency_figure(engine)` to `path` (PNG)."""
    step_latency_figure(engine).savefig(path)


def step_latency_figure(engine: Any) -> Figure:
    """Scatter of step latency against each row's stream position, one colour per walk.

    The y axis stops at 1.2 x the 99.5th percentile, so that a few first-call outliers do not squash
    the rest; a note in the corner says how many points lie above it and the largest latency.
    Drawn on an Agg canvas of its own, without pyplot: the caller's matplotlib backend is left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for walk in sorted({r.walk for r in engine.records}):
        xs = [p for r in engine.records if r.walk == walk for p in r.positions]
        ys = [r.latency * 1e3 for r in engine.records if r.walk == walk for _ in r.positions]
        ax.scatter(xs, ys, s=6, alpha=0.5, label=walk)
    caches = [(m.spec.resource_key, m.config) for node in engine.nodes.values() for m in node.managers]
    for (key, config), style in zip(caches, itertools.cycle(("--", ":", "-.")), strict=False):
        # Past `slot_tokens` written entries the slot's ring has wrapped at least once.
        ax.axvline(config.slot_tokens, color="grey", linestyle=style, linewidth=1, label=f"{key} ring wraps")
    ax.set_xlabel("stream position (entries the request has written)")
    ax.set_ylabel("step latency (ms)")
    ax.set_title("Engine step latency against stream position")
    ax.legend(loc="upper right", fontsize="small")
    if engine.records:
        latencies = np.asarray([r.latency * 1e3 for r in engine.records])
        top = float(np.percentile(latencies, 99.5)) * 1.2
        ax.set_ylim(0, top)
        # Count points as drawn: a step is one point per row.
        above = [(r.latency * 1e3, len(r.positions)) for r in engine.records if r.latency * 1e3 > top]
        hidden = sum(rows for _, rows in above)
        if hidden:
            ax.text(
                0.01, 0.98,
                f"{hidden} point{'s' if hidden != 1 else ''} above {top:.1f} ms not shown "
                f"(max {max(ms for ms, _ in above):.1f} ms)",
                transform=ax.transAxes, ha="left", va="top", fontsize="small", color="dimgrey",
            )  # fmt: skip
    fig.tight_layout()
    return fig


def write_report(
    report: dict[str, Any], engine: Any, output: pathlib.Path
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write `report.json` and `step_latency.png` into `output` (created); return their paths."""
    output.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output / "report.json", output / "step_latency.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_step_latency(engine, png_path)
    return json_path, png_path


def mesh_report(engine: Any) -> dict[str, Any]:
    """The mesh, each node's bytes of its first cache per device, and the requests each data shard took
    (keyed by node)."""
    mesh = engine.mesh
    shape = {"data": 1, "model": 1} if mesh is None else dict(mesh.shape)
    caches = {}
    for name, node in engine.nodes.items():
        manager = node.manager
        leaves = jax.tree.leaves(manager.cache)
        per_device = collections.Counter()
        for leaf in leaves:
            for shard in leaf.addressable_shards:
                per_device[shard.device.id] += shard.data.nbytes
        caches[name] = {
            "bytes_per_device": sorted(set(per_device.values())),
            "total_bytes": sum(leaf.nbytes for leaf in leaves),
            "requests_per_data_shard": list(manager.placed),
        }
    processes = {
        "processes": jax.process_count(),
        "process": jax.process_index(),
        # Where this process admits: every cache of an engine admits into the same data shards.
        "local_data_shards": list(next(iter(engine.nodes.values())).manager.local_data_shards),
    }
    return {**shape, "devices": shape["data"] * shape["model"], **processes, "caches": caches}
