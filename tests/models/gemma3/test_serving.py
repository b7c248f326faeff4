"""Gemma 3 served by the one engine (`ServingEngine(Gemma3Serving(...))`) against each prompt continued
alone by `Gemma3Streams.greedy`.

The small random-weight model of `test_model` (whose `greedy` matches the float64 oracle there) serves
prompts of different lengths, with fewer slots than prompts so one waits, synchronous and pipelined;
every stream's tokens must be `greedy`'s, after warm-up nothing compiles, and every slot comes back.
A device fault with snapshots is replayed to the same tokens, each delivered once. Every engine test
runs at K = 1, 4, 8 and 32 decode steps per dispatch (`EngineSettings.decode_steps`): the tokens do not
depend on K.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.engine import ServingEngine
from mstar_jax.engine.faults import inject_faults
from mstar_jax.engine.recovery import MAX_STEP_FAULTS
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.serving import GEMMA3, Gemma3Programs, Gemma3Serving, TextRequest
from mstar_jax.models.gemma3.stream import DECODE, Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow
from mstar_jax.serving import gumbel_noise
from mstar_jax.serving.stream import Phase, StateLostError
from mstar_jax.settings import EngineSettings
from tests.models.gemma3.test_model import CONFIG, random_tensors
from tests.serving.live import converse

pytestmark = pytest.mark.slow

RETENTION = SinkWindow(2, 10)
NEW_TOKENS = 20
SLOTS = 3


@pytest.fixture(scope="module")
def model():
    return Gemma3.from_tensors(CONFIG, random_tensors(CONFIG))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [tuple(int(t) for t in rng.integers(0, CONFIG.vocab_size, n)) for n in (5, 19, 1, 12)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, chunk=8)
    return [streams.greedy(prompt, NEW_TOKENS) for prompt in prompts]


DECODE_STEPS = (1, 4, 8, 32)


@pytest.fixture(scope="module", params=DECODE_STEPS, ids=[f"K={k}" for k in DECODE_STEPS])
def programs(model, request):
    """One capture per K for every engine of the module (fresh caches each, the same geometry)."""
    captured = Gemma3Programs.capture(new_streams(model), decode_steps=request.param)
    assert captured.decode_steps == request.param
    return captured


def new_streams(model) -> Gemma3Streams:
    return Gemma3Streams(
        CONFIG, model, global_retention=RETENTION, max_slots=SLOTS, chunk=8, batch_sizes=(1, 2)
    )


def engine_for(model, programs, **settings) -> ServingEngine:
    served = Gemma3Serving(new_streams(model), programs)
    settings = {"decode_steps": programs.decode_steps, **settings}
    engine = ServingEngine(served, settings=EngineSettings(max_batch=SLOTS, **settings))
    engine.warm_up()
    return engine


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_crowd_gets_each_prompts_greedy_tokens(model, programs, prompts, alone, pipelined):
    engine = engine_for(model, programs, pipelined=pipelined)
    heard: dict[str, list[int]] = {}
    streams = []
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        heard[rid] = []
        streams.append(engine.submit(TextRequest(rid, prompt, NEW_TOKENS), on_output=heard[rid].append))
    engine.run_until_idle()
    for stream, want in zip(streams, alone, strict=True):
        assert stream.phase is Phase.DONE, stream.error
        assert stream.tokens == want
        assert heard[stream.request_id] == want  # each token once, in order
    assert engine.stats.holds >= 1  # four prompts, three slots: one waited
    decodes = [r for r in engine.records if r.walk == DECODE]
    assert decodes
    assert {r.bucket.num_tokens for r in decodes} == {programs.decode_steps}
    assert engine.compilations == 0
    served = engine.served.streams
    assert served.local.free_slots == served.global_.free_slots == SLOTS
    if pipelined:
        assert engine.stats.rows_fed_on_device > 0
        assert engine.stats.steps_read_behind["gemma3"] > 0
    else:
        assert engine.stats.rows_fed_on_device == sum(engine.stats.steps_read_behind.values()) == 0


def test_the_engines_stream_iterator_yields_the_greedy_tokens(model, programs, prompts, alone):
    engine = engine_for(model, programs)
    assert list(engine.stream(TextRequest("one", prompts[1], NEW_TOKENS))) == alone[1]


def test_a_stop_token_ends_its_stream_only(model, programs, prompts, alone):
    stop = alone[1][5]
    engine = engine_for(model, programs, pipelined=True)
    streams = [
        engine.submit(TextRequest(f"p{i}", p, NEW_TOKENS, stop_tokens=(stop,))) for i, p in enumerate(prompts)
    ]
    engine.run_until_idle()
    for stream, want in zip(streams, alone, strict=True):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert stream.tokens == want[:cut]
    assert engine.served.streams.local.free_slots == SLOTS


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_with_snapshots_a_lost_cache_is_restored_and_replayed_to_the_same_tokens(
    model, programs, prompts, alone, pipelined
):
    engine = engine_for(model, programs, pipelined=pipelined, snapshot_every=3)
    heard: dict[str, list[int]] = {}
    streams = []
    for i, prompt in enumerate(prompts[:SLOTS]):
        heard[f"p{i}"] = []
        streams.append(
            engine.submit(TextRequest(f"p{i}", prompt, NEW_TOKENS), on_output=heard[f"p{i}"].append)
        )
    faults = (7, 16) if programs.decode_steps == 1 else (3, 5)  # a block is one step: fewer of them
    inject_faults(engine, GEMMA3, lambda n: "after" if n in faults else None)
    delivered = {s.request_id: 0 for s in streams}
    while engine.streams:
        engine.step()
        for stream in streams:  # a rewind never takes back a delivered token
            assert len(stream.tokens) >= delivered[stream.request_id]
            delivered[stream.request_id] = len(stream.tokens)
    assert engine.stats.faults == 2
    assert engine.stats.requests_restored >= 2
    for stream, want in zip(streams, alone[:SLOTS], strict=True):
        assert stream.phase is Phase.DONE, stream.error
        assert stream.tokens == want
        assert heard[stream.request_id] == want  # replayed tokens are not delivered again
    assert engine.compilations == 0


def test_faults_that_are_not_in_a_row_never_fail_a_stream_reading_its_prompt(model, programs, prompts):
    """A step that comes back forgives the failures before it, a prompt's chunk as much as a token's."""
    engine = engine_for(model, programs)
    long_prompt = prompts[1] * 2  # 38 tokens: 5 chunks of 8, each retried once
    stream = engine.submit(TextRequest("long", long_prompt, 4))
    inject_faults(engine, GEMMA3, lambda n: "before" if n % 2 else None)
    engine.run_until_idle()
    assert stream.phase is Phase.DONE, stream.error
    assert engine.stats.faults > MAX_STEP_FAULTS  # more in all than a stream rides out in a row
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, chunk=8)
    assert stream.tokens == streams.greedy(long_prompt, 4)
    assert engine.served.streams.local.free_slots == SLOTS


def test_without_snapshots_a_lost_cache_fails_its_streams_retryably(model, programs, prompts):
    engine = engine_for(model, programs)
    streams = [engine.submit(TextRequest(f"p{i}", p, NEW_TOKENS)) for i, p in enumerate(prompts[:2])]
    # While both hold a slot: a block of 32 steps ends p0 by the fourth step.
    fault = 4 if programs.decode_steps == 1 else 2
    inject_faults(engine, GEMMA3, lambda n: "after" if n == fault else None)
    engine.run_until_idle()
    for stream in streams:
        assert stream.phase is Phase.FAILED
        assert isinstance(stream.failure, StateLostError)
        assert stream.failure.retryable
    assert engine.served.streams.local.free_slots == SLOTS
    again = engine.submit(TextRequest("again", prompts[0], 4))  # serving goes on, on fresh caches
    engine.run_until_idle()
    assert again.phase is Phase.DONE


def sampled_oracle(model, prompt, count: int, temperature: float, seed: int) -> list[int]:
    """The `count` tokens drawn after `prompt` at `temperature` with `seed`, each from the logits of the
    whole text so far recomputed at once (`Gemma3Streams.logits`, not incrementally) and the Gumbel
    noise of its seed at the last token's position."""
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, chunk=64)
    text = list(prompt)
    for _ in range(count):
        logits = streams.logits(text)[-1].astype(np.float64)
        noise = np.asarray(
            gumbel_noise(jnp.array([seed], jnp.uint32), jnp.array([len(text) - 1]), logits.size)
        )
        text.append(int(np.argmax(logits / temperature + noise[0].astype(np.float64))))
    return text[len(prompt) :]


SAMPLED = 8  # tokens the sampling oracle recomputes from scratch, one whole text each


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_sampled_tokens_follow_the_seed_and_position_alone_or_in_a_crowd(model, programs, prompts, pipelined):
    engine = engine_for(model, programs, pipelined=pipelined)
    sampled = [
        engine.submit(TextRequest(f"s{i}", prompt, SAMPLED, temperature=0.9, seed=11 + i))
        for i, prompt in enumerate(prompts[:2])
    ]
    greedy = engine.submit(TextRequest("g", prompts[2], SAMPLED))  # shares every step with them
    same_seed = engine.submit(TextRequest("again", prompts[0], SAMPLED, temperature=0.9, seed=11))
    engine.run_until_idle()
    for i, stream in enumerate(sampled):
        assert stream.tokens == sampled_oracle(model, prompts[i], SAMPLED, 0.9, 11 + i)
    assert same_seed.tokens == sampled[0].tokens
    assert greedy.tokens == new_streams(model).greedy(prompts[2], SAMPLED)
    assert engine.compilations == 0


@pytest.fixture(scope="module")
def from_scratch(model):
    """The oracles of a whole history, kept per history: every K and mode of a test asks the same ones."""
    streams, known = new_streams(model), {}

    def oracle(history, temperature: float | None = None, seed: int = 0, count: int = NEW_TOKENS):
        key = (tuple(history), temperature, seed, count)
        if key not in known:
            known[key] = (
                streams.greedy(history, count)
                if temperature is None
                else sampled_oracle(model, history, count, temperature, seed)
            )
        return known[key]

    return oracle


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_live_conversation_continues_as_greedy_decoding_of_the_whole_history(
    model, programs, prompts, alone, from_scratch, pipelined
):
    """Three turns of one live stream beside an ordinary one, ended by a stop token where greedy decoding
    meets it (pipelined, a step ran past it; in a decode block, nothing after it is written): each turn's
    tokens are the oracle's greedy decoding of the whole history from scratch, up to the stop token."""
    engine = engine_for(model, programs, pipelined=pipelined)
    stop = (alone[1][5],)
    engine.submit(TextRequest("other", prompts[0], NEW_TOKENS))
    request = TextRequest("chat", prompts[1], NEW_TOKENS, stop_tokens=stop)
    said, before = converse(engine, request, [(prompts[3], NEW_TOKENS), (prompts[2], NEW_TOKENS)])
    assert said[0][-1] in stop
    for i, (turn, history) in enumerate(zip(said, before, strict=True)):
        want = from_scratch(history)
        ends = [j for j, token in enumerate(want) if token in stop]
        assert turn == want[: ends[0] + 1 if ends else NEW_TOKENS], f"turn {i}"
    assert engine.compilations == 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_sampled_live_conversation_draws_what_the_whole_history_draws(
    model, programs, prompts, from_scratch, pipelined
):
    engine = engine_for(model, programs, pipelined=pipelined)
    request = TextRequest("chat", prompts[0], SAMPLED // 2, temperature=0.9, seed=11)
    said, before = converse(engine, request, [(prompts[2], SAMPLED // 2)])
    for turn, history in zip(said, before, strict=True):
        assert turn == from_scratch(history, 0.9, 11, SAMPLED // 2)


def test_a_turn_outside_the_vocabulary_is_refused_naming_its_tokens(model, programs, prompts):
    engine = engine_for(model, programs)
    stream = engine.submit(TextRequest("chat", prompts[2], 2), live=True)
    engine.run_until_idle()
    vocab = CONFIG.vocab_size
    with pytest.raises(
        ValueError, match=rf"'chat': tokens \[{vocab}, -1\] are outside \[0, vocab_size={vocab}\)"
    ):
        engine.append("chat", [3, vocab, -1], max_new_tokens=2)
    assert stream.phase is Phase.IDLE
    assert len(stream.turns) == 1  # the request's own turn only


def test_another_seed_draws_other_tokens_and_a_tiny_temperature_is_greedy(model, programs, prompts, alone):
    engine = engine_for(model, programs)
    seeds = [
        engine.submit(TextRequest(f"s{seed}", prompts[1], SAMPLED, temperature=2.0, seed=seed))
        for seed in range(3)
    ]
    cold = engine.submit(TextRequest("cold", prompts[1], SAMPLED, temperature=1e-6, seed=5))
    engine.run_until_idle()
    assert len({tuple(s.tokens) for s in seeds}) == 3
    assert cold.tokens == alone[1][:SAMPLED]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"temperature": float("nan")}, r"temperature=nan must be a finite number in \[0\.0, 100\.0\]"),
        ({"temperature": -0.5}, r"temperature=-0\.5 must be a finite number in \[0\.0, 100\.0\]"),
        ({"temperature": 101}, r"temperature=101 must be a finite number in"),
        ({"temperature": "hot"}, r"temperature='hot' must be a number in"),
        ({"seed": -1}, r"seed=-1 must be an int in \[0, 4294967295\]"),
        ({"seed": 2**32}, r"seed=4294967296 must be an int in"),
        ({"seed": 1.5}, r"seed=1\.5 must be an int"),
    ],
)
def test_bad_sampling_fields_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        TextRequest("r", (1, 2), 4, **fields)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: TextRequest("r", (), 4), ValueError, r"request 'r': prompt is empty"),
        (
            lambda: TextRequest("r", (1.5, 2), 4),
            ValueError,
            r"prompt=\(1\.5, 2\) must be one sequence of integer",
        ),
        (
            lambda: TextRequest("r", (1, 2), 0),
            ValueError,
            r"max_new_tokens=0 must be an int in \[1, 2147483647\]",
        ),
        (lambda: TextRequest("r", (1, 2), True), ValueError, r"max_new_tokens=True must be an int in \[1, "),
        (
            lambda: TextRequest("r", (1, 2), 2**31),
            ValueError,
            r"max_new_tokens=2147483648 must be an int in \[",
        ),
        (lambda: TextRequest("", (1, 2), 4), ValueError, r"request_id='' must be a non-empty str"),
        (lambda: TextRequest("r", ((1, 2),), 4), ValueError, r"must be one sequence of integer token ids"),
    ],
)
def test_bad_text_requests_name_the_field(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_the_engine_refuses_what_the_model_cannot_serve_before_queueing(model, programs):
    engine = engine_for(model, programs)
    with pytest.raises(
        ValueError, match=r"request 'r': prompt tokens \[64\] are outside \[0, vocab_size=64\)"
    ):
        engine.submit(TextRequest("r", (1, 64), 4))
    with pytest.raises(ValueError, match=r"stop_tokens tokens \[-1\] are outside"):
        engine.submit(TextRequest("r", (1, 2), 4, stop_tokens=(-1,)))
    with pytest.raises(TypeError, match=r"request='hello' must be a TextRequest"):
        engine.submit("hello")
    with pytest.raises(TypeError, match=r"on_output=3 must be callable or None"):
        engine.submit(TextRequest("r", (1, 2), 4), on_output=3)
    assert not engine.streams
    assert engine.served.streams.local.free_slots == SLOTS
    with pytest.raises(TypeError, match=r"streams='gemma' must be a Gemma3Streams"):
        Gemma3Serving("gemma")
    with pytest.raises(TypeError, match=r"programs=\{\} must be a Gemma3Programs"):
        Gemma3Serving(new_streams(model), {})
    with pytest.raises(TypeError, match=r"served=.* must be a ServedModel"):
        ServingEngine(new_streams(model), settings=EngineSettings())


def test_a_paused_stream_is_offloaded_from_both_caches_at_once_and_resumes_exactly(
    model, programs, prompts, alone
):
    engine = engine_for(model, programs)
    # Long enough that none ends before the late one needs p0's slot, whatever K; alone's tokens are
    # their first NEW_TOKENS.
    streams = [engine.submit(TextRequest(f"p{i}", p, 10 * NEW_TOKENS)) for i, p in enumerate(prompts[:SLOTS])]
    while not all(s.tokens for s in streams):
        engine.step()
    engine.pause("p0")
    late = engine.submit(TextRequest("late", prompts[3], NEW_TOKENS))  # no free slot: p0 makes room
    while not late.tokens:
        engine.step()
    served = engine.served.streams
    assert served.local.slot_of("p0") is None
    assert served.global_.slot_of("p0") is None  # both caches at once: one eviction, not two
    assert engine.stats.offloads == 1
    assert engine.is_offloaded("p0")
    engine.resume("p0")
    engine.run_until_idle()
    for stream, want in zip([*streams, late], alone, strict=True):
        assert stream.tokens[:NEW_TOKENS] == want
    assert served.local.free_slots == served.global_.free_slots == SLOTS


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_callback_that_cancels_a_stream_of_the_rounds_next_program_is_honoured(
    model, programs, prompts, alone, pipelined
):
    engine = engine_for(model, programs, pipelined=pipelined)
    long_prompt = engine.submit(TextRequest("long", prompts[1], NEW_TOKENS))  # 19 tokens: three chunks
    seen: list[int] = []

    def cancel_the_long_one(token: int) -> None:
        seen.append(token)
        if len(seen) == 2:  # read in a round whose prefill program carries the long prompt's chunk
            engine.cancel("long")

    short = engine.submit(TextRequest("short", prompts[0], NEW_TOKENS), on_output=cancel_the_long_one)
    engine.run_until_idle()
    assert long_prompt.phase is Phase.CANCELLED
    assert short.tokens == alone[0]
    assert engine.served.streams.local.free_slots == SLOTS
