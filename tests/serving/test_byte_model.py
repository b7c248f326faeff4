"""The byte model of `byte_model.py` served by the one engine: a crowd, synchronous and pipelined, and a
fault replayed from snapshots, each stream's bytes checked against the same request served alone, and
those against an independent float64 NumPy forward pass that attends through the retention's mask.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from mstar_jax.engine import ServingEngine
from mstar_jax.engine.faults import inject_faults
from mstar_jax.serving.stream import Phase
from mstar_jax.settings import EngineSettings
from tests.serving.byte_model import DIM, HEAD_DIM, NODE, RETENTION, ByteRequest, ByteServing, init_params

ROOT = Path(__file__).resolve().parents[2]
SLOTS, NEW = 2, 12
PROMPTS = (b"hello", b"mstar-jax!", b"x", b"bounded caches")  # four prompts, two slots: some wait


@pytest.fixture(scope="module")
def params():
    return init_params(0)


@pytest.fixture(scope="module")
def programs(params):
    """One capture for every engine of the module (fresh caches each, the same geometry)."""
    return ByteServing(params, slots=SLOTS).programs


def engine_for(params, programs, **settings) -> ServingEngine:
    engine = ServingEngine(
        ByteServing(params, slots=SLOTS, programs=programs),
        settings=EngineSettings(max_batch=SLOTS, **settings),
    )
    engine.warm_up()
    return engine


@pytest.fixture(scope="module")
def alone(params, programs):
    """Each prompt's bytes served alone, one request on its own synchronous engine."""
    served = []
    for i, prompt in enumerate(PROMPTS):
        engine = engine_for(params, programs, pipelined=False)
        served.append(list(engine.stream(ByteRequest(f"alone{i}", prompt, NEW))))
    return served


def logits_reference(params, tokens, *, window: bool = True) -> np.ndarray:
    """f64[n, 256]: the next-byte logits after each prefix of `tokens`, densely, from an explicit mask:
    query i sees key j when j <= i and (j < sink or i - j <= window) (every j <= i without `window`)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "layers"}
    layers = [{k: np.asarray(v, np.float64) for k, v in layer.items()} for layer in params["layers"]]
    norm = lambda x: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    n = len(tokens)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = (j <= i) & (((j < RETENTION.sink) | (i - j <= RETENTION.window)) if window else True)
    freqs = np.exp(-np.log(1e4) * np.arange(DIM // 2) / (DIM // 2))
    angles = np.arange(n)[:, None] * freqs[None, :]
    x = p["embed"][np.asarray(tokens)] + np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    for w in layers:
        h = norm(x)
        q = (h @ w["wq"]).reshape(n, -1, HEAD_DIM)  # [n, H, D]
        k, v = h @ w["wk"], h @ w["wv"]  # [n, D]: one KV head for every query head
        scores = np.einsum("ihd,jd->hij", q, k) / np.sqrt(HEAD_DIM)
        scores = np.where(mask[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hij,jd->ihd", probs, v).reshape(n, -1) @ w["wo"]
        x = x + np.maximum(norm(x) @ w["w1"], 0) @ w["w2"]
    return norm(x) @ p["head"]


def test_served_alone_each_byte_is_the_float64_oracles_greedy_choice(params, alone):
    for prompt, out in zip(PROMPTS, alone, strict=True):
        assert len(out) == NEW
        logits = logits_reference(params, [*prompt, *out[:-1]])[len(prompt) - 1 :]
        chosen = logits[np.arange(NEW), out]
        # The argmax, up to float32 rounding of a near tie (the test's seed has none closer than this).
        np.testing.assert_array_less(logits.max(axis=1) - chosen, 1e-4)


def test_the_oracles_mask_matters_past_the_retained_window(params, alone):
    tokens = [*PROMPTS[3], *alone[3]]  # 26 bytes, well past the 2 + 6 retained
    bounded, dense = logits_reference(params, tokens), logits_reference(params, tokens, window=False)
    limit = RETENTION.sink + RETENTION.window + 1
    np.testing.assert_allclose(bounded[:limit], dense[:limit], rtol=1e-12, atol=1e-12)
    assert np.abs(bounded[limit:] - dense[limit:]).max() > 1e-2


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_crowd_gets_the_bytes_each_prompt_gets_alone(params, programs, alone, pipelined):
    engine = engine_for(params, programs, pipelined=pipelined)
    heard = {f"p{i}": [] for i in range(len(PROMPTS))}
    streams = [
        engine.submit(ByteRequest(rid, prompt, NEW), on_output=heard[rid].append)
        for rid, prompt in zip(heard, PROMPTS, strict=True)
    ]
    engine.run_until_idle()
    for stream, want in zip(streams, alone, strict=True):
        assert stream.phase is Phase.DONE, stream.error
        assert stream.tokens == heard[stream.request_id] == want  # each byte once, in order
    assert engine.stats.holds >= 1  # four prompts, two slots: some waited
    assert engine.compilations == 0
    assert engine.served.manager.free_slots == SLOTS
    if pipelined:
        assert engine.stats.rows_fed_on_device > 0
        assert engine.stats.steps_read_behind[NODE] > 0
    else:
        assert engine.stats.rows_fed_on_device == sum(engine.stats.steps_read_behind.values()) == 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_fault_is_restored_from_a_snapshot_and_replayed_to_the_same_bytes(
    params, programs, alone, pipelined
):
    engine = engine_for(params, programs, pipelined=pipelined, snapshot_every=3)
    heard = {f"p{i}": [] for i in range(len(PROMPTS))}
    streams = [
        engine.submit(ByteRequest(rid, prompt, NEW), on_output=heard[rid].append)
        for rid, prompt in zip(heard, PROMPTS, strict=True)
    ]
    inject_faults(engine, NODE, lambda n: "after" if n in (5, 13) else None)
    engine.run_until_idle()
    assert engine.stats.faults == 2
    assert engine.stats.requests_restored >= 2
    for stream, want in zip(streams, alone, strict=True):
        assert stream.phase is Phase.DONE, stream.error
        assert stream.tokens == heard[stream.request_id] == want  # replayed bytes are not delivered again
    assert engine.compilations == 0
    assert engine.served.manager.free_slots == SLOTS


def test_the_engines_stats_count_how_its_streams_ended(params, programs):
    """`engine.stats` against the finished streams themselves: one done, one failed by its callback, one
    cancelled; the record is frozen, and a new one is made each time."""
    engine = engine_for(params, programs)

    def gone(token: int) -> None:
        raise RuntimeError("the listener went away")

    engine.submit(ByteRequest("done", b"hello", NEW))
    engine.submit(ByteRequest("raises", b"x", NEW), on_output=gone)
    engine.submit(ByteRequest("cancelled", b"abc", NEW))
    engine.cancel("cancelled")
    engine.run_until_idle()
    ended = collections.Counter(s.phase for s in engine.finished.values())
    stats = engine.stats
    assert (stats.done, stats.failed, stats.cancelled) == (1, 1, 1)
    assert ended == {Phase.DONE: 1, Phase.FAILED: 1, Phase.CANCELLED: 1}
    assert stats.admission()["failed"] == 1
    assert stats.faults == 0
    assert stats.pipeline() == {"rows_fed_on_device": 0}  # synchronous: nothing read behind
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.done = 0
    assert engine.stats == stats
    assert engine.stats is not stats


@pytest.mark.parametrize(
    ("request_", "error", "match"),
    [
        (ByteRequest("r", b"", 4), ValueError, r"request 'r': prompt=b'' must be non-empty bytes"),
        (ByteRequest("r", "text", 4), ValueError, r"prompt='text' must be non-empty bytes"),
        (ByteRequest("r", b"a", 0), ValueError, r"max_new_tokens=0 must be an int >= 1"),
        ("hello", TypeError, r"request='hello' must be a ByteRequest"),
    ],
)
def test_the_engine_refuses_what_the_model_cannot_serve_before_queueing(
    params, programs, request_, error, match
):
    engine = engine_for(params, programs)
    with pytest.raises(error, match=match):
        engine.submit(request_)
    assert not engine.streams
    assert engine.served.manager.free_slots == SLOTS


def test_the_engine_guides_walkthrough_shows_the_steps_code_as_it_is():
    guide = (ROOT / "docs" / "guides" / "engine.md").read_text()
    section = guide[guide.index("### A model in one file") :]
    shown = section[section.index("```py\n") + len("```py\n") : section.index("```\n")]
    source = {
        line.strip() for line in (ROOT / "tests" / "serving" / "byte_model.py").read_text().splitlines()
    }
    assert [line for line in shown.splitlines() if line.strip() not in source] == []


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_a_stream_a_callback_cancels_mid_round_is_offered_no_further_row(params, alone, pipelined):
    # One row a program, three streams with rows in a round: the first stream's first byte comes back
    # while the round's later programs are still to run, and its callback cancels the third stream. The
    # engine must not offer the ended stream's row to admission (which would refuse it: work for nothing).
    engine = ServingEngine(
        ByteServing(params, slots=3), settings=EngineSettings(max_batch=1, pipelined=pipelined)
    )
    engine.warm_up()
    offered, admit = [], engine._admission.admit

    def recording_admit(node, rows, bucket=None):
        offered.extend((row.stream.request_id, row.stream.phase) for row in rows)
        return admit(node, rows, bucket)

    engine._admission.admit = recording_admit
    formed, rows_of = set(), engine.served.rows

    def recording_rows(*args, **kwargs):
        programs = rows_of(*args, **kwargs)
        formed.update(row.stream.request_id for rows, _ in programs for row in rows)
        return programs

    engine.served.rows = recording_rows
    heard = []

    def first_cancels_third(byte: int) -> None:
        heard.append(byte)
        if len(heard) == 1:
            engine.cancel("third")

    first = engine.submit(ByteRequest("first", PROMPTS[2], NEW), on_output=first_cancels_third)
    second = engine.submit(ByteRequest("second", PROMPTS[0], NEW))
    third = engine.submit(ByteRequest("third", PROMPTS[1], NEW))
    engine.run_until_idle()
    assert (first.phase, second.phase, third.phase) == (Phase.DONE, Phase.DONE, Phase.CANCELLED)
    assert "third" in formed  # a round formed its row (the cancel came before its program ran)
    assert not [rid for rid, phase in offered if phase.finished]
    assert first.tokens == heard == alone[2]
    assert second.tokens == alone[0]
    assert engine.served.manager.free_slots == 3
