"""`Stream` and `Phase`, the parts every model's stream shares."""

from __future__ import annotations

import dataclasses

from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase, Stream


def test_exactly_the_ending_phases_are_finished():
    assert {phase for phase in Phase if phase.finished} == {Phase.DONE, Phase.FAILED, Phase.CANCELLED}
    assert all(type(phase.finished) is bool for phase in Phase)
    assert (PREFILL, DECODE, FLUSH) == (Phase.PREFILL, Phase.DECODE, Phase.FLUSH)


@dataclasses.dataclass(frozen=True)
class _Request:
    request_id: str


def test_a_stream_takes_its_request_id_from_its_request():
    stream = Stream(_Request("r7"))
    assert stream.request_id == "r7"
    assert stream.phase is Phase.WAITING
    assert not stream.phase.finished
