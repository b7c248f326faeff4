"""One set of captured programs for every engine test in this package (they depend only on the caches'
geometry), kept in the executable store the CLI test's deployment names, so it loads them instead of
compiling again."""

from __future__ import annotations

import os

import pytest

from mstar_jax.compile import ExecutableStore, disable_persistent_cache, enable_persistent_cache
from mstar_jax.engine.build import EXECUTABLES
from mstar_jax.models.streaming_tts import TTSPrograms, tts_buckets
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from tests.engine.support import BATCH_SIZES, CONFIG, TOKEN_COUNTS, managers


@pytest.fixture(scope="package")
def cache_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("xla-cache"))
    enable_persistent_cache(directory, min_compile_secs=0.0)
    yield directory
    disable_persistent_cache()


@pytest.fixture(scope="package")
def programs(cache_dir):
    model = StreamingTTSModel(CONFIG)
    talker, flow = managers()
    buckets = tts_buckets(batch_sizes=BATCH_SIZES, token_counts=TOKEN_COUNTS, flow_chunk=CONFIG.flow_chunk)
    store = ExecutableStore(os.path.join(cache_dir, EXECUTABLES))
    captured = TTSPrograms.capture(
        model, buckets, talker=talker, flow=flow, progress=False, max_workers=2, store=store
    )
    return model, captured


@pytest.fixture(params=[False, True], ids=["synchronous", "pipelined"])
def pipelined(request) -> bool:
    """Whether the engine under test is pipelined (`EngineSettings(pipelined=True)`); references never are."""
    return request.param
