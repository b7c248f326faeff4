"""`GreedyDecoder`'s bookkeeping on its own, on host state only (no program runs): the branches the two
models served end to end (`test_byte_model.py`, `tests/models/gemma3/test_serving.py`) seldom or never
take: more decode rows than a program holds, a callback that raises, a replay that comes out different,
the hooks' defaults and overrides, a rewind to the start.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from mstar_jax.compile import Buckets, BucketSet
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving import (
    DecodeRow,
    DecoderPrograms,
    DecoderStream,
    GreedyDecoder,
    InFlight,
    Phase,
    ReplayMismatchError,
    RequestError,
)


class Request(NamedTuple):
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()


def buckets(*walks: str) -> Buckets:
    return Buckets(tuple(BucketSet(graph_walk=w, batch_sizes=(1, 2), token_counts=(1, 4)) for w in walks))


class OneWalk(GreedyDecoder):
    request_type, decode_walk, prefill_walk, chunk = Request, "step", "step", 4

    def __init__(self, walks=("step",)):
        super().__init__("node", ResourceRunner({}), ("kv",), {}, DecoderPrograms(buckets(*walks), {}))

    def check(self, request: Request) -> None:
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_new_tokens must be >= 1")


class TwoWalks(OneWalk):
    decode_walk, prefill_walk = "decode", "prefill"

    def __init__(self):
        super().__init__(("decode", "prefill"))

    def extra_inputs(self, rows, places, size: int, span: int) -> tuple:
        return (np.ones((size, span), np.int32),)


class Ops:
    """The engine's side of `read`: records what the model asks and ends the stream as the engine does."""

    def __init__(self):
        self.failed, self.finished = {}, []

    def fail(self, stream, failure):
        stream.phase, self.failed[stream.request_id] = Phase.FAILED, failure

    def done(self, stream):
        stream.phase = Phase.DONE
        self.finished.append(stream.request_id)

    def release(self, stream, node):
        raise AssertionError("a one-node decoder gives nothing back early")


def stream(rid: str, prompt=(1, 2, 3, 4, 5, 6), new=3, **fields) -> DecoderStream:
    return DecoderStream(Request(rid, prompt, new, **fields.pop("request", {})), **fields)


def step_of(model: GreedyDecoder, rows: list, serial: int) -> InFlight:
    bucket = model.choose_bucket(model.nodes[0], rows)
    return InFlight(model.nodes[0], serial, bucket, rows, list(range(len(rows))), None, 0.0, (), 0)


def run(model: GreedyDecoder, rows: list, serial: int, outputs: list[int], ops: Ops) -> InFlight:
    step = step_of(model, rows, serial)
    model.dispatched(step, now=1.0)
    model.read(step, np.asarray(outputs)[:, None], now=2.0, ops=ops)  # [C, K]: one token a row, K = 1
    return step


def test_rows_skip_what_waits_and_feed_decode_rows_from_the_step_in_flight():
    model = OneWalk()
    fed = stream("fed", phase=Phase.DECODE, tokens=[7], generated=1, feed=(5, 1))
    host = stream("host", phase=Phase.DECODE, tokens=[7, 8], generated=2, feed=(4, 0))
    waiting = [
        stream("done", phase=Phase.DONE),
        stream("flush", phase=Phase.FLUSH),
        stream("paused", paused=True),
        stream("held", hold_until=10.0),
    ]
    new = stream("new", prefilled=4, written=4, phase=Phase.PREFILL)
    programs = model.rows(model.nodes[0], [*waiting, new, host, fed], now=1.0, max_batch=8, in_flight=5)
    assert programs == [
        (
            [
                DecodeRow(host, (8,), decode=True),  # its newest token is on the host
                DecodeRow(fed, (0,), decode=True, feed=1),  # a placeholder: the program reads row 1
                DecodeRow(new, (5, 6), decode=False),  # the prompt's rest, after what is read
            ],
            "step",
        )
    ]


def test_every_decode_row_is_in_the_rounds_first_program_and_the_rest_wait():
    model = OneWalk()
    decoding = [stream(f"d{i}", phase=Phase.DECODE, tokens=[i], generated=1) for i in range(3)]
    new = [stream(f"p{i}") for i in range(3)]
    programs = model.rows(model.nodes[0], [*new, *decoding], now=0.0, max_batch=2, in_flight=None)
    ids = [[row.stream.request_id for row in rows] for rows, _ in programs]
    assert ids == [["d0", "d1"], ["p0", "p1"], ["p2"]]  # d2 waits: a later program cannot read the feed
    two = TwoWalks()
    programs = two.rows(two.nodes[0], [*new, *decoding], now=0.0, max_batch=2, in_flight=None)
    ids = [([row.stream.request_id for row in rows], walk) for rows, walk in programs]
    assert ids == [(["d0", "d1"], "decode"), (["p0", "p1"], "prefill"), (["p2"], "prefill")]


def test_one_token_rows_run_the_decode_walk_and_the_inputs_end_with_the_extra_ones():
    model = TwoWalks()
    last = DecodeRow(stream("last"), (9,), decode=False)  # a prompt's last chunk of one token
    assert model.choose_bucket(model.nodes[0], [last]) == BucketKey("decode", 1, 1)
    rows = [DecodeRow(stream("a"), (0,), decode=True, feed=3), DecodeRow(stream("b"), (1, 2), decode=False)]
    bucket = model.choose_bucket(model.nodes[0], rows)
    assert bucket == BucketKey("prefill", 2, 4)
    feed, tokens, lengths, extra = model.inputs(model.nodes[0], bucket, rows, None)
    np.testing.assert_array_equal(feed, [3, -1])
    np.testing.assert_array_equal(tokens, [[0, 0, 0, 0], [1, 2, 0, 0]])
    np.testing.assert_array_equal(lengths, [1, 2])
    np.testing.assert_array_equal(extra, np.ones((2, 4)))
    assert len(OneWalk().inputs(model.nodes[0], bucket, rows, None)) == 3  # no extra inputs by default


def test_a_stream_runs_its_prompt_then_generates_to_its_limit_or_a_stop_token():
    model, ops = OneWalk(), Ops()
    heard = []
    s = model.new_stream(
        Request("r", (1, 2, 3, 4, 5, 6), 3, stop_tokens=(42,)), on_output=heard.append, now=0.0
    )
    first = run(model, [DecodeRow(s, (1, 2, 3, 4), decode=False)], 1, [99], ops)
    assert first.emits == (False,)
    assert s.phase is Phase.PREFILL
    assert s.tokens == []
    run(model, [DecodeRow(s, (5, 6), decode=False)], 2, [7], ops)  # the last chunk: the first token
    assert (s.phase, s.tokens, s.first_token_at, s.written, s.prefilled) == (Phase.DECODE, [7], 2.0, 6, 6)
    run(model, [DecodeRow(s, (7,), decode=True)], 3, [42], ops)
    assert s.tokens == heard == [7, 42]
    assert ops.finished == ["r"]
    t = model.new_stream(Request("t", (1,), 2), on_output=None, now=0.0)
    run(model, [DecodeRow(t, (1,), decode=False)], 4, [5], ops)
    step = step_of(model, [DecodeRow(t, (5,), decode=True)], 5)
    model.dispatched(step, now=3.0)
    assert t.phase is Phase.FLUSH
    assert t.feed == (5, 0)
    model.read(step, np.asarray([[6]]), now=4.0, ops=ops)
    assert t.tokens == [5, 6]
    assert t.feed is None
    assert ops.finished == ["r", "t"]


def test_a_callback_that_raises_fails_its_stream_only():
    model, ops = OneWalk(), Ops()

    def broken(token: int) -> None:
        raise KeyError(token)

    bad = model.new_stream(Request("bad", (1,), 4), on_output=broken, now=0.0)
    good = model.new_stream(Request("good", (1,), 4), on_output=None, now=0.0)
    run(model, [DecodeRow(bad, (1,), decode=False), DecodeRow(good, (1,), decode=False)], 1, [3, 4], ops)
    assert isinstance(ops.failed["bad"], RequestError)
    assert "request 'bad': on_output raised KeyError(3)" in str(ops.failed["bad"])
    assert good.tokens == [4]
    assert good.phase is Phase.DECODE


def test_a_replay_is_checked_against_the_delivered_tokens_and_not_delivered_again():
    model, ops = OneWalk(), Ops()
    heard = []
    s = model.new_stream(Request("r", (1,), 5), on_output=heard.append, now=0.0)
    run(model, [DecodeRow(s, (1,), decode=False)], 1, [3], ops)
    mark = model.mark(s)
    run(model, [DecodeRow(s, (3,), decode=True)], 2, [4], ops)
    run(model, [DecodeRow(s, (4,), decode=True)], 3, [5], ops)
    model.rewind(s, model.nodes[0], mark)  # a fault: back to the snapshot, two tokens delivered since
    assert (s.phase, s.written, s.generated, s.tokens) == (Phase.DECODE, 1, 1, [3, 4, 5])
    run(model, [DecodeRow(s, (3,), decode=True)], 4, [4], ops)  # the same token: not delivered again
    assert heard == [3, 4, 5]
    assert s.generated == 2
    assert not ops.failed
    run(model, [DecodeRow(s, (4,), decode=True)], 5, [6], ops)  # not the token it had delivered
    assert isinstance(ops.failed["r"], ReplayMismatchError)
    assert "generated token 6 at 2, where it had generated 5" in str(ops.failed["r"])
    model.rewind(s, model.nodes[0], None)  # to its start
    assert (s.phase, s.prefilled, s.written, s.generated, s.feed) == (Phase.WAITING, 0, 0, 0, None)


def test_new_stream_refuses_another_models_request_and_what_the_check_refuses():
    model = OneWalk()
    with pytest.raises(TypeError, match=r"request='hello' must be a Request"):
        model.new_stream("hello", on_output=None, now=0.0)
    with pytest.raises(ValueError, match=r"request 'r': max_new_tokens must be >= 1"):
        model.new_stream(Request("r", (1,), 0), on_output=None, now=0.0)
    s = model.new_stream(Request("r", (1,), 1), on_output=None, now=3.0)
    assert type(s) is DecoderStream
    assert s.submitted_at == 3.0
    assert model.outputs(s) is s.tokens
    assert tuple(model.position(model.nodes[0], s)) == (0, 0, 0)  # no source, nothing written
    assert model.nodes[0].feeds
    assert model.nodes[0].no_feed.shape == (2, 1)  # [C, K]
