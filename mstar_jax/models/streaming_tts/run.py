"""The streaming TTS model's `mstar-jax run` (build the engine of a deployment, serve its synthetic
workload, report) and the engine `mstar-jax serve` serves.

Capture (every bucket, with progress bars), warm-up, voice registration, then the workload in real
time with live progress; finally the summary is printed and `report.json` plus `step_latency.png` are
written to the output directory.

In a multi-process deployment every process runs this with the same deployment: each serves every
`processes`-th request of the one workload (its own share, admitted into its own data shards) and
writes its report under `process-<index>/` of the output directory.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax

from mstar_jax.engine.report import write_report
from mstar_jax.memory import num_sources
from mstar_jax.models.streaming_tts.report import format_summary, summarize
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.models.streaming_tts.workload import drive, register_voices, synthetic_workload

__all__ = ["run_deployment", "serve_engine"]


def run_deployment(
    deployment: Any,
    *,
    output: str | pathlib.Path = "runs/latest",
    progress: bool = True,
    implementation: str = "auto",
    print_fn: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Serve a deployment's workload and report on it.

    Args:
      deployment: a `mstar_jax.deployment.Deployment` of the `streaming_tts` model.
      output: directory for `report.json` and `step_latency.png` (created).
      progress: show progress bars.
      implementation: the attention implementation.
      print_fn: where the summary lines go.

    Returns:
      The report (as written to `report.json`).
    """
    workload = deployment.workload
    start = time.perf_counter()
    engine = Engine.from_deployment(deployment, progress=progress, implementation=implementation)
    capture_secs = time.perf_counter() - start
    warmup = engine.warmup_compilations
    # After warm-up on purpose: adding a voice at run time must compile nothing either (it is counted).
    voices = register_voices(engine, workload.voices, seed=workload.seed)
    arrivals = synthetic_workload(workload, voices, text_vocab=engine.model.config.text_vocab_size)
    output = pathlib.Path(output)
    if engine.lockstep:  # one workload over the processes: each serves its share (module doc)
        arrivals = arrivals[jax.process_index() :: jax.process_count()]
        output = output / f"process-{jax.process_index()}"
    wall = drive(engine, arrivals, progress=progress)
    report = summarize(engine, wall_secs=wall, capture_secs=capture_secs, warmup_compilations=warmup)
    json_path, png_path = write_report(report, engine, output)
    print_fn(format_summary(report))
    print_fn(f"wrote {json_path} and {png_path}")
    return report


def serve_engine(
    deployment: Any, *, progress: bool = True, history: int | None = None, voices: int | None = None
) -> tuple[Engine, Any]:
    """The warmed-up engine `mstar-jax serve` serves, with `voices` random voices registered (None: the
    workload's), and its endpoints (`speech_routes`) speaking those voices by name."""
    count = deployment.workload.voices if voices is None else voices
    engine = Engine.from_deployment(
        deployment, progress=progress, num_voices=max(count, num_sources(deployment)), history=history
    )
    registered = register_voices(engine, count, seed=deployment.workload.seed)
    from mstar_jax.models.streaming_tts.routes import speech_routes  # the `serve` extra's modules

    return engine, speech_routes({f"voice-{v.index}": v for v in registered})
