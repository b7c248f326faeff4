"""The pipelined engine (`EngineSettings(pipelined=True)`): it dispatches each talker step before it reads the
previous one, the codes feeding the next step on the device, and delivers audio when its copy is back;
every request hears exactly what it hears from the synchronous engine, alone, whatever happens to it
(a crowd competing for slots, cancellation, offloading, device faults)."""

from __future__ import annotations

import pytest

from tests.engine.support import assert_complete
from tests.engine.test_outputs import Alone, assert_same_output, crowd, fresh_engine, serve


@pytest.fixture(scope="module")
def alone(programs) -> Alone:
    return Alone(programs)


def test_a_pipelined_crowd_hears_what_each_hears_alone_from_the_synchronous_engine(programs, alone):
    arrivals = crowd("crowd")
    engine = fresh_engine(programs, pipelined=True)
    streams = serve(engine, arrivals)
    for stream in streams.values():
        assert_complete(stream)
        assert_same_output(stream, alone(stream.request))
    decode_rows = sum(r.rows for r in engine.records if r.walk == "talker_decode")
    # Every decode row but those after a step that left nothing in flight took its token on the device.
    assert engine.stats.rows_fed_on_device >= decode_rows // 2
    talker_steps = sum(r.walk.startswith("talker") for r in engine.records)
    assert engine.stats.steps_read_behind["talker"] >= talker_steps // 2
    assert not engine.drain()  # nothing left in flight


def test_the_synchronous_engine_overlaps_nothing(programs, alone):
    engine = fresh_engine(programs)
    serve(engine, crowd("crowd"))
    assert engine.stats.rows_fed_on_device == sum(engine.stats.steps_read_behind.values()) == 0
