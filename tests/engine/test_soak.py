"""A short soak of `benchmarks/soak.py` on the embedded default deployment: a randomized workload of
arrivals, cancellations, offloads, malformed requests and injected faults, with snapshots on.

Every finished request must equal, bit for bit, itself served alone: the default deployment captures
batch buckets 1, 2 and 4, so this also holds a request's outputs to the same bits whatever batch size
its steps ran at (docs/design.md §11).
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import soak
from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment
from mstar_jax.models.streaming_tts import Engine

pytestmark = pytest.mark.slow


def test_a_short_soak_serves_everyone_exactly_and_leaks_nothing():
    deployment = load_deployment(DEFAULT_CONFIG)
    deployment = dataclasses.replace(
        deployment, engine=dataclasses.replace(deployment.engine, snapshot_every=8)
    )
    engine = Engine.from_deployment(deployment, progress=False, history=16)
    reference = soak.reference_engine(engine)
    soak.add_voices([engine, reference], 3, seed=5)
    report = soak.soak(engine, reference, steps=400, seed=1, rates=soak.Rates(fault=0.02))

    assert report.faults_injected >= 4
    assert engine.stats.faults >= 4
    assert engine.stats.requests_restored >= 1
    assert report.submitted == report.outcomes["done"] + report.outcomes["cancelled"]
    assert not report.failures  # with snapshots no fault costs a request
    assert report.checked == report.outcomes["done"] >= 40
    assert report.mismatches == []
    assert (report.leaked_slots, report.leaked_readers, report.leaked_records) == (0, 0, 0)
    assert report.bad_refused >= 5
    assert (report.bad_accepted, report.bad_changed_state) == (0, 0)
    start, _, end = report.device_bytes
    assert end == start
    # The same request met different batch sizes (over every step: the engine keeps 16 records, and
    # which those are depends on when a pipelined step's audio copy lands).
    assert len(report.batch_sizes) >= 2, report.batch_sizes
    assert engine.compilations == 0
