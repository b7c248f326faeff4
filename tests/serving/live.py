"""Driving a live stream in tests: turns given one after another, each once the last ended."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mstar_jax.engine import ServingEngine
from mstar_jax.serving.stream import Phase


def converse(
    engine: ServingEngine,
    request: Any,
    turns: Sequence[tuple[Sequence[int], int]],
    *,
    between: Callable[[ServingEngine, int], None] | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """`request` submitted live, then each of `turns` (`(tokens, max_new_tokens)`) given once the last
    turn ended (`between(engine, i)` runs before turn `i + 1` is given, and before the request's own at
    0); each turn's outputs, the request's first, and the history each followed."""
    heard: list[int] = []
    if between is not None:
        between(engine, 0)
    stream = engine.submit(request, on_output=heard.append, live=True)
    said, before, history = [], [], []
    for i, (tokens, new) in enumerate([(request.prompt, None), *turns]):
        if i:
            if between is not None:
                between(engine, i)
            engine.append(request.request_id, list(tokens), max_new_tokens=new)
        history += tokens
        before.append(list(history))
        start = len(heard)
        engine.run_until_idle()
        assert stream.phase is Phase.IDLE, stream.error
        said.append(heard[start:])
        history += heard[start:]
    assert stream.tokens == heard  # each output delivered once, in order
    return said, before
