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

from typing import Any

from mstar_jax.engine.report import (
    format_mib,
    format_ms,
    latency_by_walk,
    mesh_report,
    percentiles,
    serving_report,
)
from mstar_jax.models.streaming_tts.model import FRAME_RATE_HZ
from mstar_jax.models.streaming_tts.request import Phase
from mstar_jax.models.streaming_tts.serving import Engine

__all__ = ["format_summary", "summarize"]


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
        "mesh": mesh_report(engine),
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
