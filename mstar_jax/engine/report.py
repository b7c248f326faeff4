"""What a run measured: the summary `mstar-jax run` prints, `report.json`, and the step-latency plot.

Definitions (streaming TTS convention, see the survey's metrics section):

- audio seconds: codec frames decoded to audio, over the frame rate (12.5 Hz);
- real-time factor (RTF): serving wall time over audio seconds generated, all streams together
  (below 1: faster than real time);
- time to first audio (TTFA): from a request's submission to its first audio chunk;
- step latency: one engine step, from forming its batch to its outputs on the host;
- memory per stream: the device bytes a stream's caches hold (one slot of each), fixed whatever the
  stream's length, beside what a dense cache would hold at the longest stream of the run.
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

from mstar_jax.engine.request import Phase
from mstar_jax.engine.tts import Engine
from mstar_jax.models.streaming_tts.model import FRAME_RATE_HZ

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "format_mib",
    "format_ms",
    "format_summary",
    "latency_by_walk",
    "percentiles",
    "plot_step_latency",
    "serving_report",
    "step_latency_figure",
    "summarize",
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


def _dense_bytes(engine: Engine, stream_entries: int, voice_entries: int, frames: int) -> int:
    """What dense caches (every entry kept) would hold for one stream at its end."""
    talker, flow = engine.talker.config, engine.flow.config
    per_entry = lambda c: c.num_layers * c.rows_per_request * c.num_heads * 2 * c.head_dim * c.dtype.itemsize  # noqa: E731
    return per_entry(talker) * stream_entries + per_entry(flow) * (voice_entries + frames)


def summarize(
    engine: Engine, *, wall_secs: float, capture_secs: float, warmup_compilations: int
) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict.

    Args:
      engine: the engine after the run (its finished streams and step records).
      wall_secs: serving wall time (first arrival to last stream finished).
      capture_secs: wall time of capturing every bucket.
      warmup_compilations: what `warm_up()` compiled.
    """
    streams = list(engine.finished.values()) + list(engine.streams.values())
    done = [s for s in streams if s.phase is Phase.DONE]
    frames = sum(s.flow_written for s in streams)
    audio_secs = frames / FRAME_RATE_HZ
    ttfa = [s.first_audio_at - s.submitted_at for s in streams if s.first_audio_at is not None]
    latencies = [r.latency for r in engine.records]
    slot_bytes = engine.talker.config.slot_bytes + engine.flow.config.slot_bytes
    longest = max(streams, key=lambda s: s.talker_written + s.request.frames, default=None)
    dense = 0
    if longest is not None:
        voice = longest.request.voice.frames
        dense = _dense_bytes(
            engine, voice + longest.prompt_len + longest.request.frames, voice, longest.request.frames
        )
    talker_kv = engine.talker.config
    flow_kv = engine.flow.config
    return {
        "streams": {
            "submitted": len(streams),
            "done": len(done),
            "failed": sum(s.phase is Phase.FAILED for s in streams),
            "cancelled": sum(s.phase is Phase.CANCELLED for s in streams),
            "longest_frames": max((s.request.frames for s in streams), default=0),
            # Past `slot_tokens` written entries a slot's ring has wrapped at least once.
            "wrapped_talker_ring": sum(s.talker_written > talker_kv.slot_tokens for s in streams),
            "wrapped_flow_ring": sum(s.flow_written > flow_kv.slot_tokens for s in streams),
        },
        "audio_seconds": audio_secs,
        "wall_seconds": wall_secs,
        "real_time_factor": wall_secs / audio_secs if audio_secs else None,
        "frames_per_second": frames / wall_secs if wall_secs else None,
        "time_to_first_audio_ms": percentiles(ttfa, 1e3),
        "step_latency_ms": percentiles(latencies, 1e3),
        "step_latency_ms_by_walk": latency_by_walk(engine.records),
        "steps": len(engine.records),
        "mesh": _mesh_report(engine),
        "memory": {
            "bytes_per_stream": slot_bytes,
            "talker_slot_bytes": talker_kv.slot_bytes,
            "flow_slot_bytes": flow_kv.slot_bytes,
            "dense_bytes_longest_stream": dense,
            "talker_slot_tokens": talker_kv.slot_tokens,
            "flow_slot_tokens": flow_kv.slot_tokens,
        },
        **serving_report(engine, capture_secs=capture_secs, warmup_compilations=warmup_compilations),
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
    return {
        "compile": {
            "buckets": sum(len(step) for step in engine.programs.steps.values()),
            "capture_wall_seconds": capture_secs,
            "loaded_from_store": sum(step.report.loaded for step in engine.programs.steps.values()),
            "warmup_compilations": warmup_compilations,
            "compilations_after_warmup": engine.compilations,
        },
        "admission": dict(engine.counters),
        "pipeline": {"pipelined": engine.pipelined, **engine.overlap},
    }


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def format_mib(value: int) -> str:
    return f"{value / 2**20:.3f} MiB" if value >= 2**16 else f"{value / 1024:.1f} KiB"


def _pipeline_line(pipeline: dict[str, Any]) -> str:
    if not pipeline["pipelined"]:
        return "pipeline             off: each step read back before the next"
    return (
        f"pipeline             {pipeline.get('rows_fed_on_device', 0)} decode rows fed on the device; "
        f"{pipeline.get('talker_steps_read_behind', 0)} talker and "
        f"{pipeline.get('flow_steps_read_behind', 0)} flow steps read back behind the next"
    )


def format_summary(report: dict[str, Any]) -> str:
    """The summary `mstar-jax run` prints."""
    ms, mib = format_ms, format_mib
    s, m, c = report["streams"], report["memory"], report["compile"]
    rtf = report["real_time_factor"]
    ttfa, lat = report["time_to_first_audio_ms"], report["step_latency_ms"]
    lines = [
        f"streams              {s['done']}/{s['submitted']} done, {s['failed']} failed, "
        f"{s['cancelled']} cancelled; rings wrapped: talker {s['wrapped_talker_ring']} "
        f"({m['talker_slot_tokens']} entries), flow {s['wrapped_flow_ring']} ({m['flow_slot_tokens']})",
        f"audio generated      {report['audio_seconds']:.1f} s in {report['wall_seconds']:.1f} s of serving",
        f"real-time factor     {rtf:.3f} ({1 / rtf:.2f}x real time)" if rtf else "real-time factor     -",
        f"time to first audio  p50 {ms(ttfa['p50'])}, p99 {ms(ttfa['p99'])}",
        f"step latency         p50 {ms(lat['p50'])}, p99 {ms(lat['p99'])} over {report['steps']} steps",
    ]
    for walk, stats in report["step_latency_ms_by_walk"].items():
        lines.append(
            f"  {walk:<18} {stats['steps']:>5} steps, p50 {ms(stats['p50'])}, p99 {ms(stats['p99'])}"
        )
    fps = report["frames_per_second"]
    lines += [
        f"frames per second    {fps:.1f}" if fps else "frames per second    -",
        f"memory per stream    {mib(m['bytes_per_stream'])} (talker slot {mib(m['talker_slot_bytes'])} "
        f"+ flow slot {mib(m['flow_slot_bytes'])}), fixed; a dense cache would hold "
        f"{mib(m['dense_bytes_longest_stream'])} at the longest stream",
        f"compilation          {c['buckets']} buckets captured in {c['capture_wall_seconds']:.1f} s "
        f"({c['loaded_from_store']} loaded from the executable store); "
        f"{c['compilations_after_warmup']} compilations after warm-up",
        f"admission            {report['admission'] or 'no refusals'}",
        _pipeline_line(report["pipeline"]),
    ]
    mesh = report["mesh"]
    if mesh["devices"] > 1:
        caches = mesh["caches"]
        lines.append(
            f"mesh                 data {mesh['data']} x model {mesh['model']} ({mesh['devices']} devices); "
            f"cache bytes per device: talker {mib(max(caches['talker']['bytes_per_device']))}, flow "
            f"{mib(max(caches['flow']['bytes_per_device']))}; requests per data shard: talker "
            f"{caches['talker']['requests_per_data_shard']}, flow {caches['flow']['requests_per_data_shard']}"
            + (
                f"; process {mesh['process']} of {mesh['processes']} serves data shards "
                f"{mesh['local_data_shards']}"
                if mesh["processes"] > 1
                else ""
            )
        )
    return "\n".join(lines)


def plot_step_latency(engine: Engine, path: pathlib.Path) -> None:
    """Write `step_latency_figure(engine)` to `path` (PNG)."""
    step_latency_figure(engine).savefig(path)


def step_latency_figure(engine: Engine) -> Figure:
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
    report: dict[str, Any], engine: Engine, output: pathlib.Path
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write `report.json` and `step_latency.png` into `output` (created); return their paths."""
    output.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output / "report.json", output / "step_latency.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_step_latency(engine, png_path)
    return json_path, png_path


def _mesh_report(engine: Engine) -> dict[str, Any]:
    """The mesh, each device's bytes of every cache, and the requests each data shard took."""
    mesh = engine.mesh
    shape = {"data": 1, "model": 1} if mesh is None else dict(mesh.shape)
    caches = {}
    for name, manager in (("talker", engine.talker), ("flow", engine.flow)):
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
        "local_data_shards": list(engine.talker.local_data_shards),  # where this process admits
    }
    return {**shape, "devices": shape["data"] * shape["model"], **processes, "caches": caches}
