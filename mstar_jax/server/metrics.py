"""The server's Prometheus metrics, in a `CollectorRegistry` of its own (so one process can build many
apps, as the tests do), scraped at `GET /metrics`.

    mstar_time_to_first_output_seconds{kind}    histogram: submit to first audio chunk or token
    mstar_step_latency_seconds                  histogram: each engine step, forming to outputs
    mstar_requests_total{outcome}               done, failed, cancelled, invalid, shutdown, overloaded
    mstar_slots_in_use{cache}                   slots held, per cache
    mstar_queue_depth{cache}                    live requests holding no slot of the cache yet
    mstar_source_readers{cache}                 live requests reading a voice of the cache's source bank
    mstar_live_requests                         requests the host holds (submitted, not yet answered)
    mstar_waiting_requests                      requests waiting for their first step (max_waiting bounds it)
    mstar_paused_streams                        streams paused for a slow reader
    mstar_offloaded_streams                     streams whose caches are in host memory
    mstar_compilations_after_warmup             programs compiled after warm-up (0 unless a bug)
    mstar_faults                                device faults the engine survived

The host thread updates them (`HostObserver`); prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mstar_jax.server.host import EngineHost, HostObserver

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics(HostObserver):
    """The metrics of one server (module doc).

    Args:
      kind: what a first output is: `audio` (speech) or `token` (text).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_output_seconds = Histogram(
            "mstar_time_to_first_output_seconds", "Submit to first audio chunk or token", ["kind"],
            buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(kind)  # fmt: skip
        self.step_seconds = Histogram(
            "mstar_step_latency_seconds", "Engine step latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("mstar_requests", "Requests by outcome", ["outcome"], registry=r)
        self.slots = Gauge("mstar_slots_in_use", "Slots held, per cache", ["cache"], registry=r)
        self.queue = Gauge(
            "mstar_queue_depth", "Live requests without a slot, per cache", ["cache"], registry=r
        )
        self.readers = Gauge(
            "mstar_source_readers", "Live requests reading the source bank, per cache", ["cache"], registry=r
        )
        self.live = Gauge("mstar_live_requests", "Requests the host holds", registry=r)
        self.waiting = Gauge("mstar_waiting_requests", "Requests waiting for their first step", registry=r)
        self.paused = Gauge("mstar_paused_streams", "Streams paused for a slow reader", registry=r)
        self.offloaded = Gauge("mstar_offloaded_streams", "Streams offloaded to host memory", registry=r)
        self.compilations = Gauge(
            "mstar_compilations_after_warmup", "Programs compiled after warm-up", registry=r
        )
        self.faults = Gauge("mstar_faults", "Device faults the engine survived", registry=r)

    def first_output(self, seconds: float) -> None:
        self.first_output_seconds.observe(seconds)

    def ended(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def refused(self, outcome: str) -> None:
        """A request answered before the host saw it (`overloaded`, `invalid`); from any thread."""
        self.requests.labels(outcome).inc()

    def stepped(self, host: EngineHost, latencies: list[float]) -> None:
        for latency in latencies:
            self.step_seconds.observe(latency)
        engine = host.engine
        streams = list(engine.streams)
        for manager in host.managers:
            key = manager.spec.resource_key
            self.slots.labels(key).set(host.free_slots[key] - manager.free_slots)
            self.queue.labels(key).set(sum(manager.slot_of(rid) is None for rid in streams))
            self.readers.labels(key).set(sum(manager.readers(i) for i in range(manager.bank.num_sources)))
        self.live.set(host.live)
        self.waiting.set(host.waiting)
        self.paused.set(sum(s.paused for s in engine.streams.values()))
        self.offloaded.set(sum(engine.is_offloaded(rid) for rid in streams))
        self.compilations.set(engine.compilations)
        self.faults.set(engine.stats.faults)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
