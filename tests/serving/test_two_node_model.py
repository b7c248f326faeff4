"""The two-node model of `two_node_model.py` served by the one engine through the node library: each
stream's bytes are a float64 oracle's greedy choices and its floats the oracle's chunk attention over
them; a crowd, pipelined, in decode blocks of K = 8, through faults on either node, an offload and a
stop token gets what each request gets alone; the registry serves it by `mstar-jax run`, `check` and
`serve`, and a mesh in `test_two_node_mesh.py`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mstar_jax.engine import ServingEngine
from mstar_jax.engine.faults import inject_faults
from mstar_jax.serving.chunks import ChunkNode
from mstar_jax.serving.nodes import NodeGraph
from mstar_jax.serving.stream import Phase
from mstar_jax.settings import EngineSettings
from tests.serving.test_byte_model import logits_reference
from tests.serving.two_node_model import (
    BYTES,
    CHUNK,
    CHUNK_RETENTION,
    CHUNKS,
    HEAD_DIM,
    TwoNodeConfig,
    TwoNodeRequest,
    TwoNodeServing,
    init_chunk_params,
    init_params,
)

NEW = 11  # bytes a stream generates: two whole chunks of 4, then a last one of 3
PROMPTS = (b"hello", b"mstar-jax!", b"x", b"two nodes")


def requests(prefix: str = "r", new: int = NEW) -> list[TwoNodeRequest]:
    return [TwoNodeRequest(f"{prefix}{i}", prompt, new) for i, prompt in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def served() -> TwoNodeServing:
    """K = 1: one capture for every engine of the module (each engine leaves every slot free)."""
    return TwoNodeServing(TwoNodeConfig(slots=2))


@pytest.fixture(scope="module")
def blocks() -> TwoNodeServing:
    """K = 8: decode blocks of eight one-token steps in one program."""
    return TwoNodeServing(TwoNodeConfig(slots=2), decode_steps=8)


def engine_for(served: TwoNodeServing, **settings) -> ServingEngine:
    engine = ServingEngine(served, settings=EngineSettings(max_batch=2, **settings))
    engine.warm_up()
    return engine


def serve(engine: ServingEngine, batch: list[TwoNodeRequest]) -> dict[str, list]:
    """Every request's outputs as its `on_output` heard them, each checked against its stream's."""
    heard = {r.request_id: [] for r in batch}
    streams = [engine.submit(r, on_output=heard[r.request_id].append) for r in batch]
    engine.run_until_idle()
    for stream in streams:
        assert stream.phase is Phase.DONE, stream.error
        assert stream.outputs == heard[stream.request_id]  # each output once, in order
    assert all(m.free_slots == m.config.max_slots for m in engine.served.managers)  # nothing leaked
    return heard


@pytest.fixture(scope="module")
def alone(served) -> dict[str, list]:
    """Each request served alone, on a synchronous engine."""
    engine = engine_for(served, pipelined=False)
    return {r.request_id: serve(engine, [r])[r.request_id] for r in requests()}


def assert_same(got: dict[str, list], want: dict[str, list]) -> None:
    """The same chunks, token for token and bit for bit (requests matched by their index)."""
    assert len(got) == len(want)
    for outputs, expected in zip(got.values(), want.values(), strict=True):
        assert [o.start for o in outputs] == [o.start for o in expected]
        for o, e in zip(outputs, expected, strict=True):
            np.testing.assert_array_equal(o.tokens, e.tokens)
            np.testing.assert_array_equal(o.values, e.values)


def chunk_reference(params: dict, tokens) -> np.ndarray:
    """f64[n, OUT]: the chunk node's floats for `tokens`, densely: query i sees key j when j <= i and
    (j < sink or i - j <= window)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n = len(tokens)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = (j <= i) & ((j < CHUNK_RETENTION.sink) | (i - j <= CHUNK_RETENTION.window))
    angles = np.arange(n, dtype=np.float64)[:, None] / 4.0
    x = p["embed"][np.asarray(tokens)] * np.cos(angles) + np.sin(angles)
    q = (x @ p["wq"]).reshape(n, -1, HEAD_DIM)  # [n, 2, D]: both query heads read the one KV head
    k, v = x @ p["wk"], x @ p["wv"]
    scores = np.where(mask[None], np.einsum("ihd,jd->hij", q, k) / math.sqrt(HEAD_DIM), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.tanh(np.einsum("hij,jd->ihd", probs, v).reshape(n, -1) @ p["out"])


def test_alone_each_byte_is_the_oracles_greedy_choice_and_each_float_its_chunk_attention(alone):
    decoder, chunks = init_params(0), init_chunk_params(0)
    for request, outputs in zip(requests(), alone.values(), strict=True):
        assert [(o.start, len(o.tokens)) for o in outputs] == [(0, 4), (4, 4), (8, 3)]
        tokens = np.concatenate([o.tokens for o in outputs])
        logits = logits_reference(decoder, [*request.prompt, *tokens[:-1]])[len(request.prompt) - 1 :]
        np.testing.assert_array_less(logits.max(axis=1) - logits[np.arange(NEW), tokens], 1e-4)
        values = np.concatenate([o.values for o in outputs])
        np.testing.assert_allclose(values, chunk_reference(chunks, tokens), rtol=1e-5, atol=1e-5)


def test_the_chunk_oracles_window_matters_past_the_retained_entries(alone):
    """The last query sees the sink and the last `window + 1` positions only: a byte between them changes
    nothing of its floats, one inside changes them."""
    tokens = np.concatenate([o.tokens for o in next(iter(alone.values()))])
    params = init_chunk_params(0)
    bounded = chunk_reference(params, tokens)
    changed = tokens.copy()
    changed[2] = (changed[2] + 1) % 256  # neither the sink nor within the last query's band
    assert CHUNK_RETENTION.window < NEW - 1 - 2
    np.testing.assert_allclose(chunk_reference(params, changed)[-1], bounded[-1], rtol=1e-12, atol=1e-12)
    changed[NEW - 2] = (changed[NEW - 2] + 1) % 256
    assert np.abs(chunk_reference(params, changed)[-1] - bounded[-1]).max() > 1e-3


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_crowd_gets_what_each_request_gets_alone(served, alone, pipelined):
    engine = engine_for(served, pipelined=pipelined)
    assert_same(serve(engine, requests("c")), alone)
    assert engine.stats.holds >= 1  # four requests, two slots: some waited
    assert engine.compilations == 0
    if pipelined:
        assert engine.stats.rows_fed_on_device > 0
        assert engine.stats.steps_read_behind[CHUNKS] + engine.stats.steps_read_behind[BYTES] > 0


def test_decode_blocks_of_eight_steps_give_the_same_outputs(blocks, alone):
    engine = engine_for(blocks, pipelined=True, decode_steps=8)
    assert_same(serve(engine, requests("k")), alone)
    walks = {r.walk for r in engine.records}
    assert {"decode", "prefill", CHUNKS} <= walks
    assert engine.compilations == 0


@pytest.mark.parametrize("node", [BYTES, CHUNKS])
@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_fault_on_either_node_is_replayed_to_the_same_outputs(served, alone, node, pipelined):
    engine, programs = engine_for(served, pipelined=pipelined, snapshot_every=3), served.programs
    inject_faults(engine, node, lambda n: "after" if n in (3, 7) else None)  # into the model's programs
    try:
        assert_same(serve(engine, requests("f")), alone)  # replayed chunks are not delivered again
    finally:
        served.programs = programs  # the module's other engines serve the same model
    assert engine.stats.faults == 2
    assert engine.compilations == 0


def test_an_offloaded_stream_resumes_where_it_stood(served, alone):
    engine = engine_for(served, pipelined=True)
    heard = []
    stream = engine.submit(requests("o")[3], on_output=heard.append)
    while len(heard) < 1:
        engine.step()
    engine.pause(stream.request_id)
    engine.drain()  # nothing in flight: its caches hold what it has written
    assert engine.offload(stream.request_id) > 0
    assert engine.is_offloaded(stream.request_id)
    engine.resume(stream.request_id)
    engine.run_until_idle()
    assert stream.phase is Phase.DONE, stream.error
    assert_same({"o": heard}, {"o": alone["r3"]})


def test_a_stop_token_ends_the_decoder_and_the_chunk_node_flushes_what_it_read(served, alone):
    want = alone["r1"]
    tokens = np.concatenate([o.tokens for o in want])
    at = 5  # the sixth byte stops the stream (kept as its last), mid-chunk
    stop = int(tokens[at])
    first = int(np.flatnonzero(tokens == stop)[0])
    engine = engine_for(served, pipelined=True)
    heard = serve(engine, [TwoNodeRequest("s", PROMPTS[1], NEW, stop_tokens=(stop,))])["s"]
    got = np.concatenate([o.tokens for o in heard])
    np.testing.assert_array_equal(got, tokens[: first + 1])
    values = np.concatenate([o.values for o in want])[: first + 1]
    np.testing.assert_array_equal(np.concatenate([o.values for o in heard]), values)
    assert heard[-1].start == (first // CHUNK) * CHUNK  # the last chunk is the short one the stop left


@pytest.mark.parametrize(
    ("request_", "error", "match"),
    [
        ("hello", TypeError, r"request='hello' must be a TwoNodeRequest"),
        (TwoNodeRequest("a", b"", 3), ValueError, r"prompt=b'' must be non-empty bytes"),
        (TwoNodeRequest("a", "text", 3), ValueError, r"prompt='text' must be non-empty bytes"),
        (TwoNodeRequest("a", b"x", 0), ValueError, r"request 'a': max_new_tokens=0 must be an int >= 1"),
        (TwoNodeRequest("a", b"x", math.nan), ValueError, r"request 'a': max_new_tokens=nan must be an int"),
        (TwoNodeRequest("a", b"x", "3"), ValueError, r"request 'a': max_new_tokens='3' must be an int"),
        (
            TwoNodeRequest("a", b"x", 3, stop_tokens=("a",)),
            TypeError,
            r"stop_tokens=\('a',\) must be a tuple",
        ),
        (TwoNodeRequest("a", b"x", 3, stop_tokens=7), TypeError, r"stop_tokens=7 must be a tuple of ints"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field_and_queues_nothing(served, request_, error, match):
    engine = engine_for(served)
    with pytest.raises(error, match=match):
        engine.submit(request_)
    assert not engine.streams


def test_a_bad_graph_or_chunk_node_is_refused_naming_it(served):
    decoder, chunker = served.served[BYTES], served.served[CHUNKS]
    with pytest.raises(ValueError, match=r"nodes \['bytes', 'bytes'\] must have distinct names"):
        NodeGraph((decoder, decoder))
    for chunk in (0, CHUNK + 1):
        with pytest.raises(
            ValueError, match=rf"chunk={chunk} must be in \[1, {CHUNK}\], its bucket's tokens"
        ):
            ChunkNode(
                chunker.node, decoder, buckets=chunker.buckets, chunk=chunk, progress_of=chunker.progress_of
            )


def test_a_live_stream_is_refused_while_a_graph_of_several_nodes_serves_none(served):
    """Live streams (tests/serving/test_live_streams.py) need a model of one final decoder node for now."""
    engine = engine_for(served)
    assert not served.live_streams
    with pytest.raises(ValueError, match=r"live=True: TwoNodeServing serves no live streams"):
        engine.submit(requests()[0], live=True)
    assert not engine.streams
