"""A live stream's turns on a decoder node (`DecoderNode`, `ServingEngine.append`): what each turn reads,
where it starts and ends, and how an interrupt cuts it.

A turn's tokens are read after everything the stream holds. The last token a turn generates is not in
the caches when it ends (a decode step writes its input): the next turn reads it first, unless a
one-token step dispatched past the end already wrote it. A decode block writes nothing after a stop
token, nor when it came in on one (`serving/steps.py`). An interrupt cuts its turn to what was read and
delivered, so a replay after a fault ends the turn at the same place.

The functions take the node's `DecoderHooks` and the stream's `DecoderProgress` (its turn fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mstar_jax.checks import brief, check_int, is_int
from mstar_jax.serving.stream import IDLE, PREFILL, Stream

__all__ = ["Turn", "check_turn", "cut_turn", "end_turn", "own_turns", "set_turn", "start_turn"]


@dataclasses.dataclass(eq=False)
class Turn:
    """One turn of a live stream: `tokens` read after all it holds, then at most `max_new_tokens`
    generated. An interrupt cuts both to what the turn read and delivered, so a replay ends it there too."""

    tokens: tuple[int, ...]
    max_new_tokens: int


def check_turn(stream: Stream, tokens: Any, max_new_tokens: Any) -> None:
    """Refuse a turn that is not a non-empty sequence of int tokens with an int `max_new_tokens` >= 1."""
    rid = stream.request_id
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence) or not tokens:
        raise TypeError(f"request {rid!r}: tokens={brief(tokens)} must be a non-empty sequence of ints")
    if not all(is_int(t) for t in tokens):
        raise TypeError(f"request {rid!r}: tokens={brief(tokens)} must hold ints only")
    check_int(f"request {rid!r}: max_new_tokens", max_new_tokens, minimum=1)


def own_turns(hooks: Any, stream: Stream, p: Any) -> None:
    """Keep turn 0 (the request's) in `p.turns`, so later ones follow it (once: an interrupt may forget
    it)."""
    if p.prompt is None:
        p.turns.append(Turn(tuple(hooks.prompt(stream)), hooks.limit(stream)))
        p.prompt, p.limit = p.turns[0].tokens, p.turns[0].max_new_tokens


def set_turn(hooks: Any, p: Any) -> None:
    """`prompt` and `limit` of turn `p.turn`, begun at `p.turn_start` with `p.owed_prefix`."""
    turn, generated = p.turns[p.turn], p.turn_start[1]
    owed = (hooks.input_token(p.tokens[generated - 1]),) if p.owed_prefix else ()
    p.prompt, p.limit = owed + turn.tokens, generated + turn.max_new_tokens


def start_turn(hooks: Any, stream: Stream, p: Any) -> None:
    """Begin the turn after `p.turn`: its prompt read where the last one ended."""
    p.turn, p.owed_prefix, p.owed = p.turn + 1, int(p.owed), False
    p.turn_start = (p.written, p.generated)
    set_turn(hooks, p)
    p.prefilled, p.finished, p.feed = 0, False, None
    stream.phase = PREFILL


def cut_turn(stream: Stream, p: Any) -> None:
    """Barge-in with nothing in flight: drop the turns not started and end this one at what it read and
    delivered. A turn that read nothing is forgotten (its owed token still owed)."""
    del p.turns[p.turn + 1 :]
    if stream.phase is IDLE:
        return
    if p.prefilled == 0:  # it read nothing: as if it had never been given
        del p.turns[p.turn]
        p.turn, p.owed = p.turn - 1, bool(p.owed_prefix)
    else:
        cut = p.turns[p.turn]
        cut.tokens = cut.tokens[: p.prefilled - p.owed_prefix]
        cut.max_new_tokens = p.generated - p.turn_start[1]
        p.owed = cut.max_new_tokens > 0  # drained: the last token read back, not written
    p.finished, p.feed = True, None
    stream.phase = IDLE


def end_turn(hooks: Any, stream: Stream, p: Any, *, one_token_steps: bool, managers: Sequence[Any]) -> None:
    """The turn ended on its last token (or on its input, an interrupted turn's replay): count what the
    stream's caches hold, tell `managers` (which counted whole decode blocks: `truncate`), then begin
    its next turn or leave it idle. Steps still in flight ran past the end (`p.ran_on`); with
    `one_token_steps` the first of them wrote the last token."""
    own_turns(hooks, stream, p)
    ran_on, p.tokens_in_flight = p.tokens_in_flight, 0
    p.ran_on += ran_on
    written, generated = p.turn_start
    new = p.generated - generated
    wrote_last = new > 0 and ran_on > 0 and one_token_steps
    p.written = written + len(p.prompt) + max(new - 1, 0) + int(wrote_last)
    p.owed, p.feed, p.finished = new > 0 and not wrote_last, None, True
    for manager in managers:
        if manager.written(stream.request_id) > p.written:
            manager.truncate(stream.request_id, p.written)
    if p.turn + 1 < len(p.turns):
        start_turn(hooks, stream, p)
    else:
        stream.phase = IDLE
