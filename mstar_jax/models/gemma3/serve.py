"""Several Gemma 3 streams at once: prompts admitted as slots free up, steps run in captured buckets.

`generate` keeps every stream moving. Each round runs one prefill step (the prompts still being read, in
chunks, joined by waiting prompts) and then decode steps of one token for every stream already
generating, as many rows a step as the largest bucket holds. A waiting prompt claims its slots in the
step that first carries it: when the caches refuse it (`AllocationFailed`), it and the prompts behind it
wait until a stream finishes and gives its slots back. Nothing compiles while serving once
`Gemma3Streams.capture()` has run.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from mstar_jax.checks import check_int
from mstar_jax.models.gemma3.stream import DECODE, PREFILL, Gemma3Streams
from mstar_jax.resources.step import AllocationFailed

__all__ = ["Generation", "generate"]


@dataclasses.dataclass(eq=False)
class _Stream:
    index: int
    prompt: np.ndarray
    rid: str | None = None
    read: int = 0  # prompt tokens prefilled
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_s: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.read < len(self.prompt)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` produced and what it cost.

    Attributes:
      tokens: per prompt, the tokens generated (greedy), in prompt order.
      prompt_tokens: prompt tokens read, over all prompts.
      seconds: wall time of the whole run.
      first_token_s: per prompt, seconds from the start until its first generated token.
      steps: steps run, by walk (`PREFILL`, `DECODE`).
      prompt_seconds: wall time of the steps reading prompts (each gives its streams' first tokens).
      decode_seconds, decoded_tokens: wall time of the steps feeding generated tokens back, and the
        tokens they fed (every generated token but each stream's last).
      refusals: admissions refused for lack of a free slot (each sent a prompt waiting for a stream to
        finish).
      late_captures: buckets compiled while serving (0 after `capture()`).
    """

    tokens: list[list[int]]
    prompt_tokens: int
    seconds: float
    first_token_s: list[float]
    steps: dict[str, int]
    prompt_seconds: float
    decode_seconds: float
    decoded_tokens: int
    refusals: int
    late_captures: int

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.tokens))


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab_size: int) -> list[np.ndarray]:
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    arrays = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a non-empty sequence of token ids, got {prompt!r:.80}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] holds ids outside [0, vocab_size={vocab_size})")
        arrays.append(ids.astype(np.int32))
    return arrays


def generate(
    streams: Gemma3Streams,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_ids: Sequence[int] = (),
    on_token: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Generation:
    """Continue every prompt greedily by `max_new_tokens` tokens (fewer where one of `stop_ids` comes).

    Args:
      streams: the model and its caches; their `max_slots` streams run at once, the others wait.
      prompts: token ids, one sequence per stream.
      max_new_tokens: tokens to generate per prompt.
      stop_ids: tokens that end a stream (generated, and counted, but not continued).
      on_token: called as `on_token(prompt index, token)` for each token as it comes.
      clock: seconds, for the timings.

    Raises:
      ValueError: for no prompts, an empty prompt or ids outside the vocabulary, or `max_new_tokens`
        below 1; before anything runs.
    """
    arrays = _check(prompts, max_new_tokens, streams.config.vocab_size)
    start, stops = clock(), {int(t) for t in stop_ids}
    waiting = collections.deque(_Stream(i, ids) for i, ids in enumerate(arrays))
    active: list[_Stream] = []
    done: list[_Stream] = []
    steps, seconds, refusals = collections.Counter(), collections.Counter(), 0
    late_before = streams.late_captures
    full = False  # a prompt was refused a slot; none can join until a stream finishes
    decoded = 0

    def emit(stream: _Stream, token: int) -> None:
        nonlocal full
        stream.tokens.append(token)
        if stream.first_token_s is None:
            stream.first_token_s = clock() - start
        if on_token is not None:
            on_token(stream.index, token)
        if len(stream.tokens) == max_new_tokens or token in stops:
            streams.close(stream.rid)
            active.remove(stream)
            done.append(stream)
            full = False

    try:
        while waiting or active:
            largest = streams.buckets.max_batch(PREFILL)
            reading = [s for s in active if s.prefilling][:largest]
            joining = [] if full else list(waiting)[: largest - len(reading)]
            for stream in joining:
                stream.rid = streams.open()
            rows = reading + joining
            while rows:
                chunks = [s.prompt[s.read : s.read + streams.chunk] for s in rows]
                began = clock()
                outcome, out = streams.run([(s.rid, c) for s, c in zip(rows, chunks, strict=True)])
                if out is not None:
                    steps[PREFILL if max(map(len, chunks)) > 1 else DECODE] += 1
                    seconds["prompt"] += clock() - began
                    break
                reason = outcome.reason
                refused = next(
                    (i for i, s in enumerate(rows) if s.rid == getattr(reason, "request_id", None)), 0
                )
                if not isinstance(reason, AllocationFailed) or not (refused or active):
                    # Refused for another reason, or with no stream left to give a slot back.
                    raise RuntimeError(f"{outcome.failed_resource} refused the step: {reason}")
                # Slots go in order, so the refused prompt and every newcomer after it wait for a free one.
                refusals, full = refusals + 1, True
                for stream in rows[refused:]:
                    streams.close(stream.rid)
                    stream.rid = None
                rows = rows[:refused]
            if rows:
                for stream in rows:
                    if stream in joining:
                        waiting.remove(stream)
                        active.append(stream)
                for stream, chunk, token in zip(rows, chunks, out, strict=True):
                    stream.read += len(chunk)
                    if not stream.prefilling:
                        emit(stream, token)
            decoding = [s for s in active if not s.prefilling]
            largest = streams.buckets.max_batch(DECODE)
            for group in (decoding[i : i + largest] for i in range(0, len(decoding), largest)):
                began = clock()
                outcome, out = streams.run([(s.rid, s.tokens[-1:]) for s in group])
                if out is None:  # streams holding their slots are never refused for room
                    raise RuntimeError(f"{outcome.failed_resource} refused a decode step: {outcome.reason}")
                steps[DECODE] += 1
                seconds["decode"] += clock() - began
                decoded += len(group)
                for stream, token in zip(group, out, strict=True):
                    emit(stream, token)
    finally:  # an error (in on_token too) must not leave slots claimed on the shared caches
        for stream in (*active, *waiting):
            if stream.rid is not None:  # a newcomer is open from its first try until it runs or waits
                streams.close(stream.rid)
    done.sort(key=lambda s: s.index)
    return Generation(
        tokens=[s.tokens for s in done],
        prompt_tokens=sum(len(s.prompt) for s in done),
        seconds=clock() - start,
        first_token_s=[s.first_token_s for s in done],
        steps=dict(steps),
        prompt_seconds=seconds["prompt"],
        decode_seconds=seconds["decode"],
        decoded_tokens=decoded,
        refusals=refusals,
        late_captures=streams.late_captures - late_before,
    )
