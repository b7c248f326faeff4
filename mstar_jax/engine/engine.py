"""The engine loop: requests in, batches per graph walk through the resources and the captured programs,
audio out per request.

Each `step()` runs at most one talker step (prefill, decode, or a combined prefill+decode step) and
one flow step. A step goes: form the rows (`scheduler`), pick the tightest captured bucket, declare a
`BoundedKVStep` padded to it, admit it through the node's `ResourceRunner`, plan, replay the bucket's
compiled program on the donated cache, commit, and hand each request its output.

A pipelined engine (`pipelined=True`, one device) does not wait for a step's outputs before it forms,
admits, plans and dispatches the next: what a step does to its streams' positions is known from its
rows (`outputs`), the talker's sampled codes feed the next talker step on the device (`programs`), and
they come back to the host a step later, the audio with an asynchronous copy, delivered when it is
there. It gives every request the same outputs as the synchronous engine. Whatever needs the streams
as they are (a snapshot, a fault, an offload, nothing left to dispatch) first reads everything in
flight (`drain`).

How it answers a refused admission (docs/design.md §4) is in `admission`, how one step is dispatched
and read back in `dispatch`, what outputs do to streams in `outputs`.

Cancelling or finishing a request returns its slots at once. Nothing compiles after `warm_up()`: every
step replays a program captured at load time, and a step that compiles anyway warns
(`RecompileWarning`) and is counted in `compilations`.

A step that raises does not stop the engine (`recovery`, docs/design.md §11): if its node's cache
survived, its rows retry (each failing alone after `MAX_STEP_FAULTS`); if the failed step consumed the
cache, only the requests that held a slot in it are affected, restored from the last snapshot when
`snapshot_every` is set and failed with the retryable `StateLostError` otherwise.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.engine import batch, recovery
from mstar_jax.engine.admission import Admission
from mstar_jax.engine.build import build_from_deployment
from mstar_jax.engine.dispatch import Dispatch
from mstar_jax.engine.lockstep import Lockstep, MultiProcessError
from mstar_jax.engine.outputs import Outputs
from mstar_jax.engine.programs import TTSPrograms
from mstar_jax.engine.records import InFlight, Node, StepRecord
from mstar_jax.engine.recovery import Recovery
from mstar_jax.engine.request import (
    AudioChunk,
    Phase,
    RequestCancelledError,
    RequestError,
    Stream,
    TTSRequest,
)
from mstar_jax.engine.scheduler import flow_rows, talker_rows
from mstar_jax.engine.voices import VoiceBank
from mstar_jax.engine.warmup import VoicesAndWarmUp
from mstar_jax.models.streaming_tts.model import (
    FLOW_CHUNK,
    TALKER_DECODE,
    TALKER_MIXED,
    TALKER_PREFILL,
    StreamingTTSModel,
)
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import UnknownRequestError
from mstar_jax.settings import EngineSettings

__all__ = ["FLOW_KV", "TALKER_KV", "Engine", "StepRecord"]


class Engine(Admission, Dispatch, Lockstep, Outputs, Recovery, VoicesAndWarmUp):
    """Serves streaming TTS requests: on one host, or in every process of a multi-process mesh
    (`lockstep`).

    Args:
      model: the step functions and weights.
      talker, flow: the two caches' managers (geometry as the programs were captured for).
      programs: the captured programs (`TTSPrograms.capture`); they may be shared between engines whose
        models have the settings they were captured for (`SettingsMismatchError` otherwise).
      settings: how the loop batches, holds, offloads, snapshots and pipelines (`EngineSettings`,
        validated when it was made); its `max_batch` must fit the largest bucket, and `pipelined` needs
        one device.
      history: finished streams and step records kept for reports, the most recent (None: all; a
        server that runs for days bounds it).
      clock: the time source (`time.perf_counter`).
    """

    def __init__(
        self,
        model: StreamingTTSModel,
        *,
        talker: BoundedKVManager,
        flow: BoundedKVManager,
        programs: TTSPrograms,
        settings: EngineSettings,
        history: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        for name, manager in (("talker", talker), ("flow", flow)):
            if not isinstance(manager, BoundedKVManager):
                raise TypeError(f"{name}={manager!r} must be a BoundedKVManager")
        if not isinstance(programs, TTSPrograms):
            raise TypeError(f"programs={programs!r} must be a TTSPrograms (TTSPrograms.capture)")
        if not isinstance(settings, EngineSettings):
            raise TypeError(f"settings={settings!r} must be an EngineSettings (mstar_jax.settings)")
        if not callable(clock):
            raise TypeError(f"clock={clock!r} must be callable, returning seconds")
        if history is not None and (isinstance(history, bool) or not isinstance(history, int) or history < 1):
            raise ValueError(f"history={history!r} must be None or an int >= 1")
        self.mesh = model.mesh
        if settings.pipelined and self.mesh is not None:
            raise ValueError(
                "pipelined=True needs an engine on one device; a mesh engine (one process or many) runs "
                "its steps synchronously"
            )
        # On a mesh a bucket's batch size counts one data shard's rows.
        shards = 1 if self.mesh is None else self.mesh.shape["data"]
        largest = shards * min(programs.buckets.max_batch(walk) for walk in programs.buckets.walks)
        if settings.max_batch > largest:
            raise ValueError(
                f"max_batch={settings.max_batch!r} must be an int in [1, {largest}] (the largest bucket)"
            )
        self.settings, self.history, self.clock = settings, history, clock
        # The settings the loop reads on every step, by name.
        self.pipelined, self.max_batch = settings.pipelined, settings.max_batch
        self.hold_backoff_s, self.snapshot_every = settings.hold_backoff_s, settings.snapshot_every
        self.offload_idle_after_s = settings.offload_idle_after_s
        programs.check(model.settings)  # SettingsMismatchError, naming the settings that differ
        self._talker_in_flight: InFlight | None = None
        self._audio_in_flight: collections.deque[InFlight] = collections.deque()
        self._dispatched = 0
        # What a pipelined engine overlapped: decode rows whose token stayed on the device, and steps
        # read back only once the next one was dispatched.
        self.overlap: collections.Counter[str] = collections.Counter()
        replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        self._no_codes = jax.device_put(jnp.zeros((programs.codes_width,), jnp.int32), replicated)
        self.last_snapshot: recovery.EngineSnapshot | None = None
        self.steps_run = 0
        self.model, self.programs = model, programs
        self.talker, self.flow = talker, flow
        self.nodes = {
            "talker": Node("talker", TALKER_KV, ResourceRunner({TALKER_KV: talker}), talker),
            "flow": Node("flow", FLOW_KV, ResourceRunner({FLOW_KV: flow}), flow),
        }
        self.voices = VoiceBank(model, talker, flow)
        self.streams: dict[str, Stream] = {}  # live, in arrival order
        self.finished: dict[str, Stream] = {}
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.counters: collections.Counter[str] = collections.Counter()
        self.compilations = 0  # after warm-up
        self.warmup_compilations = 0
        self.warmed_up = False
        buckets = programs.buckets
        self._prefill_tokens = buckets.max_tokens(TALKER_PREFILL)
        self._prefill_room = buckets[TALKER_MIXED].prefill_rows[-1] if TALKER_MIXED in buckets else 0
        self._flow_chunk = min(model.config.flow_chunk, buckets.max_tokens(FLOW_CHUNK))
        self._check_lockstep(settings.offload_idle_after_s, settings.snapshot_every)

    @classmethod
    def from_deployment(
        cls,
        deployment: Any,
        *,
        progress: bool = True,
        implementation: str = "auto",
        interpret: Any = False,
        max_workers: int | None = None,
        num_voices: int | None = None,
        max_prefill_rows_in_combined: int | None = 1,
        history: int | None = None,
    ) -> Engine:
        """Build the model, its caches and every bucket's program from a `Deployment`, then warm up.

        Args:
          deployment: a `mstar_jax.deployment.Deployment` of the `streaming_tts` model.
          progress: show capture progress bars.
          implementation, interpret: the attention implementation (see `sink_window_attention`).
          max_workers: buckets compiled at once (default: the host's cores, at most 8).
          num_voices: source-bank entries per cache (default: the workload's voices, at least 8).
          max_prefill_rows_in_combined: prefill rows a combined step makes room for.
          history: finished streams and step records kept (see `Engine`).
        """
        return build_from_deployment(
            cls, deployment, progress=progress, implementation=implementation, interpret=interpret,
            max_workers=max_workers, num_voices=num_voices,
            max_prefill_rows_in_combined=max_prefill_rows_in_combined, history=history,
        )  # fmt: skip

    # -- requests -----------------------------------------------------------------------------------

    def submit(self, request: TTSRequest, *, on_chunk: Callable[[AudioChunk], None] | None = None) -> Stream:
        """Queue a request; its stream fills as steps run.

        Raises:
          TypeError: `request` is not a `TTSRequest`, or `on_chunk` is not callable.
          ValueError: a duplicate or reserved request id, text tokens outside the text vocabulary, or a
            voice that is not registered as given (index and frames); nothing is queued then.
        """
        if not isinstance(request, TTSRequest):
            raise TypeError(f"request={request!r} must be a TTSRequest")
        if on_chunk is not None and not callable(on_chunk):
            raise TypeError(f"on_chunk={on_chunk!r} must be callable or None")
        rid = request.request_id
        if rid in self.streams or rid.startswith(batch.PAD):
            raise ValueError(f"request_id={rid!r} is already live or reserved; use a unique id")
        vocab = self.model.config.text_vocab_size
        bad = [t for t in request.text if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {rid!r}: text tokens {bad[:5]} are outside [0, text_vocab_size={vocab})"
            )
        if self.voices.voices.get(request.voice.index) != request.voice:
            registered = [(v.index, v.frames) for v in self.voices.voices.values()]
            raise ValueError(
                f"request {rid!r}: voice={request.voice} is not registered; registered (index, frames): "
                f"{sorted(registered)}"
            )
        stream = Stream(request, on_chunk=on_chunk, submitted_at=self.clock())
        stream.last_step_at = stream.submitted_at
        for node in self.nodes.values():
            node.runner.ingest_request(rid)
        self.streams[rid] = stream
        self.finished.pop(rid, None)
        return stream

    def stream(self, request: TTSRequest) -> Iterator[AudioChunk]:
        """Submit `request` and yield its audio chunks as the engine produces them (driving it).

        Raises:
          RuntimeError: when the request fails or is cancelled, with the reason.
        """
        stream = self.submit(request)
        sent = 0
        try:
            while True:
                while sent < len(stream.chunks):
                    yield stream.chunks[sent]
                    sent += 1
                if stream.phase.finished:
                    if stream.failure is not None:
                        raise stream.failure
                    return
                if not self.step():
                    self._sleep_until_runnable()
        finally:  # a client that drops the iterator must not leave the request holding its slots
            if not stream.phase.finished:
                self.cancel(request.request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request and return everything it holds."""
        stream = self.streams.get(request_id)
        if stream is not None:
            self._finish(
                stream,
                Phase.CANCELLED,
                RequestCancelledError(f"request {request_id!r} cancelled by the client"),
            )

    def pause(self, request_id: str) -> None:
        """Stop scheduling a stream (its client is not reading); its slots may be offloaded."""
        self._live(request_id).paused = True

    def resume(self, request_id: str) -> None:
        self._live(request_id).paused = False

    def offload(self, request_id: str) -> int:
        """Move a request's cache state to host memory now; return the device bytes freed.

        Raises:
          UnknownRequestError: `request_id` is not live.
          MultiProcessError: in a multi-process deployment (`lockstep`), which keeps streams on device.
        """
        self._live(request_id)
        if self.lockstep:
            raise MultiProcessError(
                f"offload({request_id!r}): a multi-process deployment keeps every stream on its devices"
            )
        freed = sum(node.runner.offload(request_id) for node in self.nodes.values())
        self.counters["offloads"] += freed > 0
        return freed

    def is_offloaded(self, request_id: str) -> bool:
        return any(node.runner.is_offloaded(request_id) for node in self.nodes.values())

    def _live(self, request_id: str) -> Stream:
        stream = self.streams.get(request_id)
        if stream is None:
            live = sorted(self.streams)
            raise UnknownRequestError(
                f"request_id={request_id!r} is not a live request; live: {live[:8]}"
                + (f" and {len(live) - 8} more" if len(live) > 8 else "")
            )
        return stream

    @property
    def idle(self) -> bool:
        return not self.streams

    def snapshot(self) -> recovery.EngineSnapshot:
        """Copy both caches and every live stream's progress to host memory (what a fault restores)."""
        self.drain()
        managers = {name: node.manager for name, node in self.nodes.items()}
        self.last_snapshot = recovery.take_snapshot(self.steps_run, managers, self.streams.values())
        self.counters["snapshots"] += 1
        return self.last_snapshot

    # -- the loop -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration: a talker step and a flow step where there is work. True if any ran
        (for a pipelined engine: was dispatched, or came back)."""
        now = self.clock()
        if self.offload_idle_after_s is not None:
            self._offload_idle(now)
        live = list(self.streams.values())
        in_flight = None if self._talker_in_flight is None else self._talker_in_flight.serial
        rows = {
            "now": now, "max_batch": self.max_batch, "prefill_tokens": self._prefill_tokens,
            "bos": self.model.bos, "text_vocab": self.model.text_vocab, "in_flight": in_flight,
        }  # fmt: skip
        decode, prefill = talker_rows(live, prefill_room=self._prefill_room, **rows)
        if decode and not self._prefill_room:  # no combined walk (a mesh): prefill runs as its own step
            _, prefill = talker_rows([s for s in live if s.phase is not Phase.DECODE], prefill_room=0, **rows)
        ran, dispatched = False, self._dispatched
        programs = [(decode + prefill, None)] if self._prefill_room else [
            (decode, TALKER_DECODE), (prefill, TALKER_PREFILL)
        ]  # fmt: skip
        for rows, walk in programs:
            if rows or self.lockstep:  # in lockstep every process enters every program (lockstep.py)
                ran |= self._run(self.nodes["talker"], rows, walk)
        if self._dispatched == dispatched and self._talker_in_flight is not None:
            ran |= self._read(self._talker_in_flight)  # nothing behind it: the flow waits for its codes
        ran |= self._deliver_audio(wait=False)
        rows = flow_rows(
            self.streams.values(), now=self.clock(), max_batch=self.max_batch, chunk=self._flow_chunk
        )
        if rows or self.lockstep:
            ran |= self._run(self.nodes["flow"], rows, FLOW_CHUNK)
        ran = ran or self.drain()  # nothing could be dispatched: what is in flight comes back now
        if ran:
            self.steps_run += 1
            due = self.snapshot_every is not None and self.steps_run % self.snapshot_every == 0
            # A cache already lost (a poisoned buffer) keeps the last good snapshot for its recovery.
            if due and not any(node.manager.cache_lost() for node in self.nodes.values()):
                self.snapshot()
        return ran

    def run_until_idle(self, *, max_steps: int | None = None) -> int:
        """Step until every stream finished (paused ones excepted); return the steps run."""
        steps = 0
        while max_steps is None or steps < max_steps:
            if not self.busy_anywhere(any(not s.paused for s in self.streams.values())):
                break
            if self.step():
                steps += 1
            else:
                self._sleep_until_runnable()
        return steps

    def _sleep_until_runnable(self) -> None:
        holds = [s.hold_until for s in self.streams.values() if not s.paused]
        wait = (min(holds) - self.clock()) if holds else 0.0
        time.sleep(min(max(wait, 0.0), self.hold_backoff_s) or 1e-4)

    # -- one step -----------------------------------------------------------------------------------

    def _fail(self, stream: Stream, failure: RequestError) -> None:
        self._finish(stream, Phase.FAILED, failure)

    def _finish(self, stream: Stream, phase: Phase, failure: RequestError | None) -> None:
        if stream.phase.finished:  # a stream ends once
            return
        rid = stream.request_id
        for node in self.nodes.values():
            node.runner.remove_request(rid)
        stream.phase, stream.failure, stream.finished_at = phase, failure, self.clock()
        stream.error = None if failure is None else str(failure)
        self.streams.pop(rid, None)
        self.finished[rid] = stream
        if self.history is not None and len(self.finished) > self.history:
            del self.finished[next(iter(self.finished))]
        self.counters[phase.value] += 1
