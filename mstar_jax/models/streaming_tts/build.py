"""Building the streaming TTS model's `Engine` from a `Deployment`: the caches (on the deployment's mesh,
if any), the model, every bucket's captured program, then warm-up."""

from __future__ import annotations

import os
from typing import Any

from mstar_jax.checks import check_int
from mstar_jax.compile import ExecutableStore, cap_batch_sizes, configure_persistent_cache
from mstar_jax.distributed import manager_shards
from mstar_jax.engine.build import EXECUTABLES, deployment_mesh
from mstar_jax.memory import num_sources
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.models.streaming_tts.programs import TTSPrograms, tts_buckets
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import place_on_mesh

__all__ = ["build_from_deployment"]


def build_from_deployment(
    cls: type,
    deployment: Any,
    *,
    progress: bool,
    implementation: str,
    interpret: Any,
    max_workers: int | None,
    num_voices: int | None,
    max_prefill_rows_in_combined: int | None,
    history: int | None,
) -> Any:
    """`Engine.from_deployment` (its arguments are documented there); `cls` is the engine class."""
    # Refused before the caches are made and every bucket compiles (tens of seconds), not after.
    check_int("num_voices", num_voices, minimum=1, allow_none=True)
    check_int("max_workers", max_workers, minimum=1, allow_none=True)
    check_int("max_prefill_rows_in_combined", max_prefill_rows_in_combined, minimum=0, allow_none=True)
    check_int("history", history, minimum=1, allow_none=True)
    config = deployment.model_config
    sources = num_sources(deployment) if num_voices is None else num_voices
    mesh = deployment_mesh(deployment)
    shards = {} if mesh is None else manager_shards(mesh)  # a process's own data shards: lockstep.py
    local = shards.get("local_data_shards")
    talker = BoundedKVManager(deployment.spec(TALKER_KV), num_sources=sources, **shards)
    flow = BoundedKVManager(deployment.spec(FLOW_KV), num_sources=sources, **shards)
    if mesh is not None:
        place_on_mesh(talker, mesh)
        place_on_mesh(flow, mesh)
    model = StreamingTTSModel(
        config,
        talker_kv=talker.config,
        flow_kv=flow.config,
        implementation=implementation,
        interpret=interpret,
        mesh=mesh,
    )
    max_batch = deployment.engine.max_batch
    buckets = tts_buckets(
        batch_sizes=cap_batch_sizes(deployment.batch_sizes, max_batch),
        token_counts=deployment.token_counts,
        flow_chunk=config.flow_chunk,
        max_prefill_rows_in_combined=max_prefill_rows_in_combined,
        combined=deployment.engine.decode_steps == 1,
        decode_steps=deployment.engine.decode_steps,
    )
    configure_persistent_cache(deployment.compile)
    cache_dir = deployment.compile.persistent_cache_dir
    # A job of many processes compiles: untested there, a loaded program could pair with other devices.
    stored = cache_dir is not None and local is None
    store = ExecutableStore(os.path.join(cache_dir, EXECUTABLES)) if stored else None
    workers = max_workers or max(1, min(8, os.cpu_count() or 1))
    programs = TTSPrograms.capture(
        model, buckets, talker=talker, flow=flow, progress=progress, max_workers=workers, store=store
    )
    engine = cls(
        model, talker=talker, flow=flow, programs=programs, settings=deployment.engine, history=history
    )
    engine.warm_up()
    return engine
