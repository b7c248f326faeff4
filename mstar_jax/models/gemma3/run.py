"""A text model's deployment on the one engine: Gemma 3 built from a deployment, its synthetic workload,
and its report (the same summary, `report.json` and plot `mstar-jax run` writes for the TTS model).

The workload draws `workload.streams` prompts of random token ids, `[min_text_tokens, max_text_tokens]`
long, each continued for `[min_new_tokens, max_new_tokens]` greedy tokens, arriving as a Poisson process.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from mstar_jax.compile import ExecutableStore, cap_batch_sizes, configure_persistent_cache
from mstar_jax.engine import report as engine_report
from mstar_jax.engine.build import EXECUTABLES, deployment_mesh
from mstar_jax.engine.engine import ServingEngine
from mstar_jax.errors import DeploymentError
from mstar_jax.models.gemma3.serving import Gemma3Programs, Gemma3Serving, TextRequest, TextStream
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.serving.stream import Phase
from mstar_jax.settings import EngineSettings

__all__ = [
    "TextArrival",
    "build_text_engine",
    "run_text_deployment",
    "serve_engine",
    "summarize_text",
    "text_engine",
    "text_workload",
]


def build_text_engine(
    deployment: Any, *, progress: bool = True, implementation: str = "auto", interpret: Any = False
) -> ServingEngine:
    """Load the deployment's Gemma 3, capture every bucket, warm up (its two caches have one `max_slots`:
    the deployment refuses otherwise)."""
    import jax.numpy as jnp

    from mstar_jax.models.gemma3 import load_gguf, open_gguf, read_config
    from mstar_jax.models.gemma3.model import Gemma3

    config = deployment.model_config
    slots = {spec.resource_key: spec.config.max_slots for spec in deployment.specs}
    mesh = deployment_mesh(deployment)  # before the weights load: a mesh's devices are checked first
    reader = open_gguf(config.path)
    _check_geometry(deployment, read_config(reader))  # before the weights load
    geometry, tensors = load_gguf(reader)
    model = Gemma3.from_tensors(geometry, tensors, dtype=jnp.dtype(config.dtype))
    configure_persistent_cache(deployment.compile)
    cache_dir = deployment.compile.persistent_cache_dir
    streams = Gemma3Streams(
        geometry, model, global_retention=config.retention, max_slots=next(iter(slots.values())),
        chunk=config.chunk, batch_sizes=cap_batch_sizes(deployment.batch_sizes, deployment.engine.max_batch),
        implementation=implementation, interpret=interpret,
        store=None if cache_dir is None else ExecutableStore(os.path.join(cache_dir, EXECUTABLES)),
        mesh=mesh, greedy_screen=config.greedy_screen,
    )  # fmt: skip
    return text_engine(streams, deployment.engine, progress=progress)


def _check_geometry(deployment: Any, found: Any) -> None:
    """Refuse a model file whose geometry is not the one the deployment's caches were declared from (the
    `gemma` extra's file, checked without it, declares Gemma 3 270M's).

    Raises:
      DeploymentError: naming the file and the first field that differs.
    """
    declared = deployment.model_config.geometry()
    for field in dataclasses.fields(declared):
        want, got = getattr(declared, field.name), getattr(found, field.name)
        if want != got:
            raise DeploymentError(
                f"{deployment.source}: model.config.gguf: {deployment.model_config.path} has "
                f"{field.name}={got!r}, where the deployment declares {want!r}"
            )


def text_engine(streams: Gemma3Streams, settings: EngineSettings, *, progress: bool = True) -> ServingEngine:
    """`streams` (a `Gemma3Streams`) served by the engine under `settings` (`EngineSettings`): every
    bucket's program captured (or loaded from `streams`' executable store), the engine warmed up."""
    programs = Gemma3Programs.capture(streams, progress=progress, decode_steps=settings.decode_steps)
    served = Gemma3Serving(streams, programs)
    engine = ServingEngine(served, settings=settings)
    engine.warm_up()
    return engine


@dataclasses.dataclass(frozen=True)
class TextArrival:
    """A text request and when it arrives, in seconds after the run starts."""

    at: float
    request: TextRequest


def text_workload(settings: Any, *, vocab_size: int) -> list[TextArrival]:
    """Draw the requests of a `WorkloadSettings` for a text model (module doc), in time order."""
    rng = np.random.default_rng(settings.seed)
    n, times = settings.streams, settings.arrival_times(rng)
    lengths = rng.integers(settings.min_text_tokens, settings.max_text_tokens + 1, n)
    new = rng.integers(settings.min_new_tokens, settings.max_new_tokens + 1, n)
    return [
        TextArrival(
            float(times[i]), TextRequest(f"t{i:04d}", rng.integers(0, vocab_size, lengths[i]), int(new[i]))
        )
        for i in range(n)
    ]


def drive_text(engine: ServingEngine, arrivals: Sequence[TextArrival], *, progress: bool = True) -> float:
    """Serve `arrivals` in real time: submit each when its time comes, step until every stream is done
    (in a multi-process deployment, until every process's are: each calls `step` as often).

    Returns:
      Serving wall time in seconds.
    """
    pending = collections.deque(arrivals)
    start = time.perf_counter()
    total = sum(a.request.max_new_tokens for a in arrivals)
    with tqdm(total=total, desc="serving", unit="token", disable=not progress) as bar:
        while engine.busy_anywhere(bool(pending or engine.streams)):
            now = time.perf_counter() - start
            while pending and pending[0].at <= now:
                engine.submit(pending.popleft().request, on_output=lambda _: bar.update())
            if not engine.step():
                if engine.idle and pending:
                    time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
                elif not engine.idle:
                    time.sleep(engine.hold_backoff_s)
    return time.perf_counter() - start


def summarize_text(
    engine: ServingEngine, *, wall_secs: float, capture_secs: float, warmup_compilations: int
) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (the TTS report's shape, with tokens for audio)."""
    streams: list[TextStream] = list(engine.finished.values()) + list(engine.streams.values())
    tokens = sum(len(s.tokens) for s in streams)
    ttft = [s.first_token_at - s.submitted_at for s in streams if s.first_token_at is not None]
    latencies = [r.latency for r in engine.records]
    managers = [m for node in engine.nodes.values() for m in node.managers]
    return {
        "streams": {
            "submitted": len(streams),
            "done": sum(s.phase is Phase.DONE for s in streams),
            "failed": sum(s.phase is Phase.FAILED for s in streams),
            "cancelled": sum(s.phase is Phase.CANCELLED for s in streams),
            "longest_tokens": max((len(s.request.prompt) + len(s.tokens) for s in streams), default=0),
        },
        "tokens_generated": tokens,
        "prompt_tokens": sum(s.prefilled for s in streams),
        "wall_seconds": wall_secs,
        "tokens_per_second": tokens / wall_secs if wall_secs else None,
        "time_to_first_token_ms": engine_report.percentiles(ttft, 1e3),
        "step_latency_ms": engine_report.percentiles(latencies, 1e3),
        "step_latency_ms_by_walk": engine_report.latency_by_walk(engine.records),
        "steps": len(engine.records),
        "memory": {
            "bytes_per_stream": sum(m.config.slot_bytes for m in managers),
            **{f"{m.spec.resource_key}_slot_tokens": m.config.slot_tokens for m in managers},
        },
        **engine_report.serving_report(
            engine, capture_secs=capture_secs, warmup_compilations=warmup_compilations
        ),
    }


def format_text_summary(report: dict[str, Any]) -> str:
    """The summary `mstar-jax run` prints for a text model."""
    ms = engine_report.format_ms
    s, m, c = report["streams"], report["memory"], report["compile"]
    ttft, lat, rate = report["time_to_first_token_ms"], report["step_latency_ms"], report["tokens_per_second"]
    lines = [
        f"streams              {s['done']}/{s['submitted']} done, {s['failed']} failed, {s['cancelled']} "
        f"cancelled; longest stream {s['longest_tokens']} tokens",
        f"tokens generated     {report['tokens_generated']} in {report['wall_seconds']:.1f} s of serving "
        f"({report['prompt_tokens']} prompt tokens read)",
        f"tokens per second    {rate:.1f}" if rate else "tokens per second    -",
        f"time to first token  p50 {ms(ttft['p50'])}, p99 {ms(ttft['p99'])}",
        f"step latency         p50 {ms(lat['p50'])}, p99 {ms(lat['p99'])} over {report['steps']} steps",
    ]
    for walk, stats in report["step_latency_ms_by_walk"].items():
        lines.append(
            f"  {walk:<18} {stats['steps']:>5} steps, p50 {ms(stats['p50'])}, p99 {ms(stats['p99'])}"
        )
    pipeline = report["pipeline"]
    lines += [
        f"memory per stream    {engine_report.format_mib(m['bytes_per_stream'])} (both caches' slots), fixed",
        f"compilation          {c['buckets']} buckets captured in {c['capture_wall_seconds']:.1f} s "
        f"({c['loaded_from_store']} loaded from the executable store); "
        f"{c['compilations_after_warmup']} compilations after warm-up",
        f"admission            {report['admission'] or 'no refusals'}",
        "pipeline             off: each step read back before the next" if not pipeline["pipelined"] else
        f"pipeline             {pipeline.get('rows_fed_on_device', 0)} decode rows fed on the device; "
        f"{pipeline.get('gemma3_steps_read_behind', 0)} steps read back behind the next",
    ]  # fmt: skip
    return "\n".join(lines)


def run_text_deployment(
    deployment: Any,
    *,
    output: str | pathlib.Path = "runs/latest",
    progress: bool = True,
    implementation: str = "auto",
    print_fn: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`run_deployment` for a text model: serve its workload, print the summary, write the report."""
    start = time.perf_counter()
    engine = build_text_engine(deployment, progress=progress, implementation=implementation)
    capture_secs = time.perf_counter() - start
    vocab = engine.served.streams.config.vocab_size
    arrivals = text_workload(deployment.workload, vocab_size=vocab)
    output = pathlib.Path(output)
    if engine.lockstep:  # one workload over the processes: each serves its share (run.py)
        arrivals = arrivals[jax.process_index() :: jax.process_count()]
        output = output / f"process-{jax.process_index()}"
    wall = drive_text(engine, arrivals, progress=progress)
    report = summarize_text(
        engine, wall_secs=wall, capture_secs=capture_secs, warmup_compilations=engine.warmup_compilations
    )
    json_path, png_path = engine_report.write_report(report, engine, output)
    print_fn(format_text_summary(report))
    print_fn(f"wrote {json_path} and {png_path}")
    return report


def serve_engine(
    deployment: Any, *, progress: bool = True, history: int | None = None, voices: int | None = None
) -> tuple[ServingEngine, Any]:
    """The warmed-up engine `mstar-jax serve` serves, and its completion endpoints (`text_routes`) in
    the model file's vocabulary. A text model has no voices (`serve` refuses `--voices` for it) and keeps
    the engine's default history."""
    from mstar_jax.models.gemma3.chat import TextTokenizer
    from mstar_jax.models.gemma3.routes import text_routes  # the `serve` extra's modules

    engine = build_text_engine(deployment, progress=progress)
    return engine, text_routes(TextTokenizer.from_gguf(deployment.model_config.path))
