"""`workload.drive`: its progress counts every frame once, at a cost per step that follows the live
streams, not every stream that ever finished."""

from __future__ import annotations

from typing import ClassVar

from mstar_jax.models.streaming_tts import workload
from mstar_jax.models.streaming_tts.workload import Arrival, drive
from tests.engine.support import assert_complete, make_engine, request


class FinishedGuard(dict):
    """`engine.finished` that refuses to be scanned: a per-step walk over it would grow with the run."""

    def values(self):
        raise AssertionError("drive scanned every finished stream")

    items = values


class Bar:
    """A stand-in for tqdm that records what drive reports."""

    made: ClassVar[list[Bar]] = []

    def __init__(self, *, total, **kwargs):
        self.total, self.updates, self.postfix = total, [], {}
        Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.updates.append(n)

    def set_postfix(self, refresh=True, **postfix):
        self.postfix = postfix


def test_progress_counts_every_frame_once_without_scanning_finished_streams(programs, monkeypatch):
    engine, voices = make_engine(programs)
    engine.finished = FinishedGuard()
    monkeypatch.setattr(workload, "tqdm", Bar)
    requests = [request(f"w{i}", voices[i % 2], frames=3 + 4 * i) for i in range(4)]
    arrivals = [Arrival(0.0, r) for r in requests[:2]] + [Arrival(0.05, r) for r in requests[2:]]
    drive(engine, arrivals)
    (bar,) = Bar.made[-1:]
    assert bar.total == sum(r.frames for r in requests)
    assert sum(bar.updates) == bar.total  # each finished stream's frames counted once, none lost
    assert min(bar.updates) >= 0
    assert bar.postfix == {"live": 0, "done": len(requests)}
    assert len(engine.finished) == len(requests)
    for r in requests:
        assert_complete(dict.__getitem__(engine.finished, r.request_id))
