"""Gemma 3 with its greedy tokens through the bfloat16 screen (`Gemma3Streams(greedy_screen=True)`).

Greedy decoding continues as the float64 oracle of `test_model` ranks; the one engine serves a crowd
with the screen at K = 1 and 8, synchronous and pipelined, each stream's tokens those of the prompt
continued alone without the screen; sampled rows beside greedy ones draw what they draw without it.
The constructor refuses what the screen cannot serve, by name, before anything is built."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax import native
from mstar_jax.engine import ServingEngine
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.serving import Gemma3Programs, Gemma3Serving, TextRequest
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow
from mstar_jax.serving.stream import Phase
from mstar_jax.settings import EngineSettings
from tests.models.gemma3.test_model import CONFIG, oracle_log_softmax, random_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.available(), reason="no C++ compiler to build mstar_jax.native"),
]

RETENTION = SinkWindow(2, 10)
NEW_TOKENS = 16
SLOTS = 3


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CONFIG, seed=4)


@pytest.fixture(scope="module")
def model(tensors):
    return Gemma3.from_tensors(CONFIG, tensors)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(8)
    return [tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, n)) for n in (6, 17, 1, 11)]


def streams(model, *, screen: bool, **kwargs) -> Gemma3Streams:
    return Gemma3Streams(CONFIG, model, global_retention=RETENTION, chunk=8, greedy_screen=screen, **kwargs)


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt continued alone, without the screen."""
    unscreened = streams(model, screen=False)
    return [unscreened.greedy(prompt, NEW_TOKENS) for prompt in prompts]


def test_screened_greedy_decoding_continues_as_the_float64_oracle_ranks(tensors, model, prompts):
    prompt = list(prompts[1])
    continuation = streams(model, screen=True).greedy(prompt, NEW_TOKENS)
    ranked = oracle_log_softmax(CONFIG, tensors, np.asarray(prompt + continuation, np.int32), RETENTION)
    assert continuation == [int(np.argmax(ranked[len(prompt) - 1 + step])) for step in range(NEW_TOKENS)]


@pytest.fixture(scope="module", params=(1, 8), ids=("K=1", "K=8"))
def programs(model, request):
    served = streams(model, screen=True, max_slots=SLOTS, batch_sizes=(1, 2))
    return Gemma3Programs.capture(served, decode_steps=request.param)


def engine_for(model, programs, **settings) -> ServingEngine:
    served = Gemma3Serving(streams(model, screen=True, max_slots=SLOTS, batch_sizes=(1, 2)), programs)
    settings = {"decode_steps": programs.decode_steps, "max_batch": SLOTS, **settings}
    engine = ServingEngine(served, settings=EngineSettings(**settings))
    engine.warm_up()
    return engine


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_screened_crowd_gets_each_prompts_unscreened_tokens(model, programs, prompts, alone, pipelined):
    engine = engine_for(model, programs, pipelined=pipelined)
    served = [engine.submit(TextRequest(f"p{i}", p, NEW_TOKENS)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    for stream, want in zip(served, alone, strict=True):
        assert stream.phase is Phase.DONE, stream.error
        assert stream.tokens == want
    assert engine.compilations == 0
    assert engine.served.streams.local.free_slots == SLOTS


def test_sampled_rows_beside_screened_ones_draw_what_they_draw_without_it(model, programs, prompts, alone):
    def serve(screen: bool) -> list[list[int]]:
        served = Gemma3Streams(
            CONFIG, model, global_retention=RETENTION, chunk=8, max_slots=SLOTS, batch_sizes=(1, 2),
            greedy_screen=screen,
        )  # fmt: skip
        captured = programs if screen else Gemma3Programs.capture(served, decode_steps=programs.decode_steps)
        settings = EngineSettings(max_batch=SLOTS, decode_steps=programs.decode_steps)
        engine = ServingEngine(Gemma3Serving(served, captured), settings=settings)
        engine.warm_up()
        out = [
            engine.submit(TextRequest(f"s{i}", p, 8, temperature=0.8, seed=21 + i))
            for i, p in enumerate(prompts[:2])
        ]
        out.append(engine.submit(TextRequest("g", prompts[3], 8)))
        engine.run_until_idle()
        return [stream.tokens for stream in out]

    screened = serve(True)
    assert screened == serve(False)
    assert screened[2] == alone[3][:8]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("yes", ValueError, r"greedy_screen='yes' must be a bool"),
        (1, ValueError, r"greedy_screen=1 must be a bool"),
        (float("nan"), ValueError, r"greedy_screen=nan must be a bool"),
        (None, ValueError, r"greedy_screen=None must be a bool"),
    ],
)
def test_a_greedy_screen_that_is_not_a_bool_is_refused(model, value, error, match):
    with pytest.raises(error, match=match):
        streams(model, screen=value)


def test_the_screen_refuses_weights_that_are_not_float32(tensors):
    model = Gemma3.from_tensors(CONFIG, tensors, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="greedy_screen=True needs float32 weights; these are bfloat16"):
        streams(model, screen=True)


def test_without_a_compiler_the_screen_is_refused_with_why(model, monkeypatch, tmp_path):
    native._library.cache_clear()
    monkeypatch.setenv("MSTAR_JAX_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    try:
        with pytest.raises(native.NativeUnavailableError, match="no-such-compiler"):
            streams(model, screen=True)
    finally:
        native._library.cache_clear()
