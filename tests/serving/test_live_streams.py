"""Live streams on the byte model (`byte_model.py`): one stream takes more input after each turn, in the
same slot, and every turn's bytes are those of a fresh stream fed the whole history with the same
retention, and the float64 oracle's greedy choices. Barge-in (`interrupt`) cuts a turn at what was
delivered; stop tokens end turns, also when a pipelined step ran past them; replays after a fault
reproduce every turn; an idle live stream is offloaded and comes back when input arrives.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mstar_jax.engine import ServingEngine
from mstar_jax.engine.faults import inject_faults
from mstar_jax.resources.step import UnknownRequestError
from mstar_jax.serving.stream import Phase
from mstar_jax.settings import EngineSettings
from tests.serving.byte_model import NODE, ByteRequest, ByteServing, init_params
from tests.serving.live import converse
from tests.serving.test_byte_model import logits_reference

SLOTS = 2
TURNS = ((b"hello", 5), (b" and", 4), (b", then more of it", 6), (b"!", 3))
"""A conversation: each turn's input and the bytes it asks for; 41 bytes in all, well past the 2 + 6
the cache retains."""
MODES = [False, True]
MODE_IDS = ["synchronous", "pipelined"]


class StoppingBytes(ByteServing):
    """The byte model with stop bytes: a turn ends after generating any of `STOPS` (kept as its last)."""

    STOPS = ()

    def stop_tokens(self, stream):
        return self.STOPS


@pytest.fixture(scope="module")
def params():
    return init_params(0)


@pytest.fixture(scope="module")
def programs(params):
    return ByteServing(params, slots=SLOTS).programs


def engine_for(params, programs, served=ByteServing, **settings) -> ServingEngine:
    engine = ServingEngine(
        served(params, slots=SLOTS, programs=programs), settings=EngineSettings(max_batch=SLOTS, **settings)
    )
    engine.warm_up()
    return engine


def fresh(params, programs, history: list[int], new: int, served=ByteServing) -> list[int]:
    """What a new, ordinary stream fed `history` generates: the oracle a live turn must equal."""
    engine = engine_for(params, programs, served)
    return list(engine.stream(ByteRequest("fresh", bytes(history), new)))


def chat(engine: ServingEngine, turns=TURNS, *, between=None) -> tuple[list, list]:
    """`turns` as one live stream (`live.converse`): each turn's bytes and the history before it."""
    (first, new), *rest = turns
    return converse(engine, ByteRequest("chat", first, new), rest, between=between)


def assert_fresh(params, programs, said, before, served=ByteServing) -> None:
    for i, (turn, history) in enumerate(zip(said, before, strict=True)):
        assert turn == fresh(params, programs, history, len(turn), served), f"turn {i}"


def test_each_turn_is_a_fresh_stream_fed_the_whole_history_and_the_float64_oracles_choice(params, programs):
    engine = engine_for(params, programs)
    said, before = chat(engine)
    assert [len(turn) for turn in said] == [new for _, new in TURNS]
    assert_fresh(params, programs, said, before)
    for turn, history in zip(said, before, strict=True):
        logits = logits_reference(params, [*history, *turn[:-1]])[len(history) - 1 :]
        np.testing.assert_array_less(logits.max(axis=1) - logits[np.arange(len(turn)), turn], 1e-4)
    assert len(before[-1]) + len(said[-1]) > 2 * (2 + 6)  # the ring wrapped, more than once
    assert engine.served.manager.free_slots == SLOTS - 1  # idle, it kept its slot
    assert engine.served.history(engine.streams["chat"]) == len(before[-1]) + len(said[-1])
    engine.close("chat")
    assert engine.finished["chat"].phase is Phase.DONE
    assert engine.served.manager.free_slots == SLOTS
    assert engine.compilations == 0


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_a_live_stream_beside_others_hears_what_it_hears_alone(params, programs, pipelined):
    alone = chat(engine_for(params, programs))[0]
    engine = engine_for(params, programs, pipelined=pipelined)

    def crowd(engine, i):  # a new ordinary stream at every turn, wanting the other slot
        engine.submit(ByteRequest(f"other{i}", b"mstar-jax!"[: i + 2], 7))

    assert chat(engine, between=crowd)[0] == alone
    assert engine.compilations == 0


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_input_given_before_a_turn_ends_starts_when_it_does(params, programs, pipelined):
    """Every turn given at once: each starts where the last ended, as if given one by one."""
    alone = chat(engine_for(params, programs))[0]
    engine = engine_for(params, programs, pipelined=pipelined)
    heard: list[int] = []
    engine.submit(ByteRequest("chat", *TURNS[0]), on_output=heard.append, live=True)
    engine.step()
    for text, new in TURNS[1:]:
        engine.append("chat", list(text), max_new_tokens=new)
    engine.run_until_idle()
    assert heard == [byte for turn in alone for byte in turn]
    assert engine.streams["chat"].phase is Phase.IDLE


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_a_turn_ended_by_a_stop_byte_goes_on_from_it(params, programs, pipelined):
    """Turns end on a stop byte, kept as their last; the next turn reads it first. Pipelined, the step
    dispatched before the stop byte was read wrote it already: nothing is written twice."""
    plain = chat(engine_for(params, programs))[0]
    StoppingBytes.STOPS = (plain[0][2], plain[1][1])  # bytes the conversation generates mid-turn
    try:
        engine = engine_for(params, programs, StoppingBytes, pipelined=pipelined)
        said, before = chat(engine)
        assert any(len(turn) < new for turn, (_, new) in zip(said, TURNS, strict=True))
        for turn in said:
            assert turn[-1] in StoppingBytes.STOPS or not set(turn) & set(StoppingBytes.STOPS)
        assert_fresh(params, programs, said, before, StoppingBytes)
    finally:
        StoppingBytes.STOPS = ()


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_an_interrupted_turn_keeps_what_it_delivered_and_the_next_goes_on_from_there(
    params, programs, pipelined
):
    engine = engine_for(params, programs, pipelined=pipelined)
    heard: list[int] = []
    engine.submit(ByteRequest("chat", b"tell me a long story", 40), on_output=heard.append, live=True)
    while len(heard) < 5:
        engine.step()
    engine.append("chat", list(b"never read"), max_new_tokens=3)  # queued: dropped by the interrupt
    held = engine.interrupt("chat")
    kept = list(heard)
    assert engine.streams["chat"].phase is Phase.IDLE
    assert held == len(b"tell me a long story") + len(kept)
    engine.run_until_idle()
    assert heard == kept  # nothing more of the interrupted turn
    engine.append("chat", list(b" stop"), max_new_tokens=6)
    engine.run_until_idle()
    history = [*b"tell me a long story", *kept, *b" stop"]
    assert heard[len(kept) :] == fresh(params, programs, history, 6)
    assert engine.compilations == 0


@pytest.mark.parametrize(
    ("steps", "held", "read"),
    [(1, 2 + 3 + 3, b"a l"), (0, 2 + 3, b"")],
    ids=["after-a-chunk", "before-anything"],
)
def test_an_interrupt_while_reading_input_keeps_what_was_read(params, programs, steps, held, read):
    """Cut after one chunk of 4 (the byte the last turn owed, then 3 of the question): the 3 stay in the
    history. Cut before any: the turn is forgotten, and the owed byte is the next turn's first."""
    engine = engine_for(params, programs)
    heard: list[int] = []
    engine.submit(ByteRequest("chat", b"hi", 3), on_output=heard.append, live=True)
    engine.run_until_idle()
    engine.append("chat", list(b"a long question, cut short"), max_new_tokens=4)
    for _ in range(steps):
        engine.step()
    assert engine.interrupt("chat") == held  # input read and bytes delivered
    engine.append("chat", list(b"?"), max_new_tokens=4)
    engine.run_until_idle()
    assert heard[3:] == fresh(params, programs, [*b"hi", *heard[:3], *read, *b"?"], 4)


def test_an_interrupt_before_the_first_step_forgets_the_request_itself(params, programs):
    engine = engine_for(params, programs)
    heard: list[int] = []
    engine.submit(ByteRequest("chat", b"never read", 3), on_output=heard.append, live=True)
    assert engine.interrupt("chat") == 0
    assert engine.served.manager.free_slots == SLOTS  # it never took a slot
    engine.append("chat", list(b"hello"), max_new_tokens=5)
    engine.run_until_idle()
    assert heard == fresh(params, programs, list(b"hello"), 5)


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_a_stream_closed_mid_turn_reads_the_turns_it_was_given_then_ends(params, programs, pipelined):
    alone = chat(engine_for(params, programs))[0]
    engine = engine_for(params, programs, pipelined=pipelined, snapshot_every=3)
    inject_faults(engine, NODE, lambda n: "after" if n == 7 else None)  # replayed across a turn's end
    heard: list[int] = []
    engine.submit(ByteRequest("chat", *TURNS[0]), on_output=heard.append, live=True)
    engine.step()
    for text, new in TURNS[1:]:
        engine.append("chat", list(text), max_new_tokens=new)
    engine.close("chat")
    assert engine.streams["chat"].phase is not Phase.IDLE  # mid-turn: it goes on
    engine.run_until_idle()
    assert engine.finished["chat"].phase is Phase.DONE
    assert heard == [byte for turn in alone for byte in turn]
    assert engine.stats.faults == 1
    assert engine.served.manager.free_slots == SLOTS


@pytest.mark.parametrize("pipelined", MODES, ids=MODE_IDS)
def test_a_fault_replays_every_turn_to_the_same_bytes(params, programs, pipelined):
    alone = chat(engine_for(params, programs))[0]
    engine = engine_for(params, programs, pipelined=pipelined, snapshot_every=2)
    inject_faults(engine, NODE, lambda n: "after" if n in (4, 9, 15) else None)
    assert chat(engine)[0] == alone
    assert engine.stats.faults == 3
    assert engine.stats.requests_restored >= 3
    assert engine.compilations == 0


@pytest.mark.parametrize("fault_at", [6, 7, 8])
def test_a_replay_ends_an_interrupted_turn_where_the_interrupt_did(params, programs, fault_at):
    """A snapshot taken mid-turn, the turn interrupted, the next given, then a fault before the next
    snapshot: the replay cuts the interrupted turn where the client saw it end, and the next turn hears
    what it heard without the fault."""

    def run(fault: bool) -> list[int]:
        engine = engine_for(params, programs, snapshot_every=4)
        if fault:
            inject_faults(engine, NODE, lambda n: "after" if n == fault_at else None)
        heard: list[int] = []
        engine.submit(ByteRequest("chat", b"tell me", 30), on_output=heard.append, live=True)
        for _ in range(5):
            engine.step()
        engine.interrupt("chat")
        engine.append("chat", list(b"ok"), max_new_tokens=8)
        engine.run_until_idle()
        assert engine.stats.faults == int(fault)
        assert engine.stats.requests_restored == int(fault)
        return heard

    assert run(fault=True) == run(fault=False)


def test_an_idle_live_stream_is_offloaded_and_comes_back_when_input_arrives(params, programs):
    clock = [0.0]
    engine = ServingEngine(
        ByteServing(params, slots=SLOTS, programs=programs),
        settings=EngineSettings(max_batch=SLOTS, offload_idle_after_s=5.0),
        clock=lambda: clock[0],
    )
    engine.warm_up()
    alone = chat(engine_for(params, programs))[0]

    def wait(engine, i):  # idle past the setting between turns: offloaded on the next step
        clock[0] += 10.0
        if i:
            engine.step()
            assert engine.is_offloaded("chat")
            assert engine.served.manager.free_slots == SLOTS

    assert chat(engine, between=wait)[0] == alone
    assert engine.stats.offloads >= len(TURNS) - 1
    assert engine.stats.reloads >= len(TURNS) - 1


def test_a_crowd_takes_the_slot_of_an_idle_live_stream(params, programs):
    """Two slots, one held by an idle live stream: two new streams take both (the idle one offloaded),
    and the live one comes back for its next turn."""
    engine = engine_for(params, programs)
    alone = chat(engine_for(params, programs))[0]

    def crowd(engine, i):
        if i == 1:
            for j in range(2):
                engine.submit(ByteRequest(f"other{j}", b"abc", 4))
            engine.run_until_idle()
            assert engine.stats.offloads == 1

    assert chat(engine, between=crowd)[0] == alone


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e.append("nobody", [1], max_new_tokens=2), UnknownRequestError, "'nobody' is not a live"),
        (lambda e: e.append("plain", [1], max_new_tokens=2), ValueError, "'plain' is not a live stream"),
        (lambda e: e.interrupt("plain"), ValueError, "'plain' is not a live stream"),
        (lambda e: e.close("plain"), ValueError, "'plain' is not a live stream; it ends by itself"),
        (lambda e: e.append("chat", [], max_new_tokens=2), TypeError, r"tokens=\[\] must be a non-empty"),
        (lambda e: e.append("chat", b"ab", max_new_tokens=2), TypeError, "tokens=b'ab' must be a non-empty"),
        (lambda e: e.append("chat", [1, "a"], max_new_tokens=2), TypeError, "must hold ints only"),
        (lambda e: e.append("chat", [1.0], max_new_tokens=2), TypeError, "must hold ints only"),
        (lambda e: e.append("chat", [1], max_new_tokens=0), ValueError, "max_new_tokens=0"),
        (lambda e: e.append("chat", [1], max_new_tokens=math.nan), ValueError, "max_new_tokens=nan must"),
        (lambda e: e.append("chat", [1], max_new_tokens="3"), ValueError, "max_new_tokens='3' must"),
        (lambda e: e.submit(ByteRequest("x", b"a", 1), live=1), TypeError, "live=1 must be a bool"),
    ],
    ids=[
        "unknown-id", "not-live", "interrupt-not-live", "close-not-live", "empty-tokens", "bytes-tokens",
        "str-token", "float-token", "zero-new", "nan-new", "str-new", "live-not-bool",
    ],
)  # fmt: skip
def test_bad_input_to_a_live_stream_is_refused_and_changes_nothing(params, programs, call, error, match):
    engine = engine_for(params, programs)
    engine.submit(ByteRequest("chat", b"hi", 2), live=True)
    engine.run_until_idle()
    engine.submit(ByteRequest("plain", b"hi", 2))  # waiting: live, but not a live stream
    chat = engine.streams["chat"]
    marked, turns = engine.served.mark(chat), [(t.tokens, t.max_new_tokens) for t in chat.turns]
    with pytest.raises(error, match=match):
        call(engine)
    assert engine.served.mark(chat) == marked
    assert [(t.tokens, t.max_new_tokens) for t in chat.turns] == turns
    assert chat.phase is Phase.IDLE
    assert set(engine.streams) == {"chat", "plain"}
