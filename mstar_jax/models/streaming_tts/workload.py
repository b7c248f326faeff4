"""A synthetic streaming workload and the loop that drives an engine through it in real time.

Requests arrive as a Poisson process (or all at once), each with a random text, one of a few random
voices and a random length, so a run mixes stream positions, prefill spans and voices, and its long
streams run far past the caches' windows.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from mstar_jax.models.streaming_tts.request import Stream, TTSRequest
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.models.streaming_tts.voices import Voice

if TYPE_CHECKING:
    from mstar_jax.deployment import WorkloadSettings

__all__ = ["Arrival", "drive", "register_voices", "synthetic_workload"]


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request and when it arrives, in seconds after the run starts."""

    at: float
    request: TTSRequest


def register_voices(engine: Engine, count: int, *, seed: int) -> list[Voice]:
    """Register `count` random voices with random prompt lengths in the model's allowed range."""
    cfg = engine.model.config
    rng = np.random.default_rng(seed)
    frames = rng.integers(cfg.min_voice_frames, cfg.max_voice_frames + 1, count)
    return [engine.add_voice(i, frames=int(f), seed=seed * 1000 + i) for i, f in enumerate(frames)]


def synthetic_workload(
    settings: WorkloadSettings, voices: Sequence[Voice], *, text_vocab: int
) -> list[Arrival]:
    """Draw the requests of a `WorkloadSettings`.

    Args:
      settings: a `mstar_jax.deployment.WorkloadSettings` (streams, arrival rate, lengths, seed).
      voices: the registered voices requests pick from (uniformly).
      text_vocab: text tokens are drawn from `[0, text_vocab)`.

    Returns:
      The arrivals, in time order.
    """
    rng = np.random.default_rng(settings.seed)
    n, times = settings.streams, settings.arrival_times(rng)
    text_lens = rng.integers(settings.min_text_tokens, settings.max_text_tokens + 1, n)
    frames = rng.integers(settings.min_frames, settings.max_frames + 1, n)
    picks = rng.integers(0, len(voices), n)
    return [
        Arrival(
            float(times[i]),
            TTSRequest(
                request_id=f"s{i:04d}",
                text=rng.integers(0, text_vocab, int(text_lens[i])),
                voice=voices[int(picks[i])],
                frames=int(frames[i]),
                seed=int(rng.integers(0, 2**31)),
            ),
        )
        for i in range(n)
    ]


def drive(engine: Engine, arrivals: Sequence[Arrival], *, progress: bool = True) -> float:
    """Serve `arrivals` in real time: submit each when its time comes, step until every stream is done
    (in a multi-process deployment, until every process's are: each calls `step` as often).

    Returns:
      Serving wall time in seconds.
    """
    pending = collections.deque(sorted(arrivals, key=lambda a: a.at))
    total = sum(a.request.frames for a in pending)
    start = time.perf_counter()
    # Progress counts the frames of the streams this run saw live: those still live, read each step, plus
    # a running total of those that ended, added once as each leaves `engine.streams`. A step so costs
    # O(live streams); summing `engine.finished` every step grew with every stream the run had served.
    live: dict[str, Stream] = dict(engine.streams)
    ended_frames = ended = decoded = 0

    def settle() -> None:
        nonlocal ended_frames, ended
        for rid, stream in list(live.items()):
            if engine.streams.get(rid) is not stream:  # it ended
                ended_frames += stream.flow_written
                ended += 1
                del live[rid]

    with tqdm(total=total, desc="serving", unit="frame", disable=not progress) as bar:
        # Paused streams alone do not keep the run going (their clients stopped reading).
        while engine.busy_anywhere(bool(pending) or any(not s.paused for s in engine.streams.values())):
            now = time.perf_counter() - start
            while pending and pending[0].at <= now:
                engine.submit(pending.popleft().request)
            live.update(engine.streams)
            ran = engine.step()
            settle()
            frames = ended_frames + sum(s.flow_written for s in engine.streams.values())
            bar.update(frames - decoded)
            decoded = frames
            bar.set_postfix(live=len(engine.streams), done=ended, refresh=False)
            if not ran:
                if engine.idle and pending:
                    time.sleep(max(0.0, pending[0].at - (time.perf_counter() - start)))
                elif not engine.idle:
                    time.sleep(engine.hold_backoff_s)
    return time.perf_counter() - start
