"""One tiny speech engine for the package (captured once, its programs kept in an executable store the
`mstar-jax serve` subprocess of test_shutdown loads instead of compiling), served by apps over it."""

from __future__ import annotations

import pytest

from tests import extras

extras.skip_module_without("serve")  # before the server modules import FastAPI

from mstar_jax.compile import disable_persistent_cache
from mstar_jax.deployment import load_deployment
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.models.streaming_tts.workload import register_voices
from tests.server.support import TTS_YAML


@pytest.fixture(scope="package")
def tts_config(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    (directory / "cache").mkdir()
    path = directory / "tts.yaml"
    path.write_text(TTS_YAML.format(cache=directory / "cache"))
    return path


@pytest.fixture(scope="package")
def tts(tts_config):
    """`(engine, voices by name)`: the tiny deployment's engine, warmed up, with voice-0 and voice-1.

    The deployment turns JAX's persistent compilation cache on; it is turned off after the package, so
    the tests a worker runs next compile as they would alone."""
    engine = Engine.from_deployment(load_deployment(tts_config), progress=False, max_workers=2)
    voices = register_voices(engine, 2, seed=0)
    yield engine, {f"voice-{v.index}": v for v in voices}
    disable_persistent_cache()
