"""The streaming TTS model as the engine serves it, and `Engine`, the serving engine built for it.

`TTSServing` is the model's part of the protocol (`mstar_jax.serving.ServedModel`): two nodes, the
talker (a decoder that feeds: its sampled codes are the next talker step's input, on the device) and the
flow decoder (chunks of codes to mel and samples, copied back asynchronously). Each round runs one
talker program (decode, prefill, or both on the combined walk, on a mesh too; with decode blocks,
K > 1, decode and prefill run as two programs) and one flow program (`scheduler`).

Each step has two halves. At dispatch (`dispatched`) what the step will do is known from its rows
alone: entries written, prompt read, codes coming, the talker done; the next step is formed from that.
When its outputs are back on the host (`read`: at once in a synchronous engine, a step later in a
pipelined one), the codes are appended and the audio delivered, once and in order.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.engine import batch
from mstar_jax.engine.engine import ServingEngine
from mstar_jax.models.streaming_tts.batch import step_inputs
from mstar_jax.models.streaming_tts.build import build_from_deployment
from mstar_jax.models.streaming_tts.model import (
    FLOW_CHUNK,
    SAMPLES_PER_FRAME,
    TALKER_DECODE,
    TALKER_MIXED,
    TALKER_PREFILL,
    StreamingTTSModel,
)
from mstar_jax.models.streaming_tts.programs import TTSPrograms
from mstar_jax.models.streaming_tts.request import AudioChunk, ReplayMismatchError, Stream, TTSRequest
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.models.streaming_tts.scheduler import FlowRow, flow_rows, talker_rows
from mstar_jax.models.streaming_tts.voices import Voice, VoiceBank
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.serving.model import InFlight, Node, RowWalks, ServedModel, StreamOps, notify
from mstar_jax.serving.stream import DECODE, FLUSH, PREFILL, Phase
from mstar_jax.settings import EngineSettings

__all__ = ["Engine", "TTSServing"]

TALKER, FLOW = "talker", "flow"


class TTSServing(ServedModel):
    """The streaming TTS model served: its talker and flow nodes over the two caches (module doc).

    Args:
      model: the step functions and weights.
      talker, flow: the two caches' managers (geometry as the programs were captured for).
      programs: the captured programs (`TTSPrograms.capture`); `SettingsMismatchError` when they were
        captured for other model settings.

    Attributes:
      voices: the voices registered in both caches' source banks.
    """

    def __init__(
        self,
        model: StreamingTTSModel,
        *,
        talker: BoundedKVManager,
        flow: BoundedKVManager,
        programs: TTSPrograms,
    ):
        for name, manager in (("talker", talker), ("flow", flow)):
            if not isinstance(manager, BoundedKVManager):
                raise TypeError(f"{name}={manager!r} must be a BoundedKVManager")
        if not isinstance(programs, TTSPrograms):
            raise TypeError(f"programs={programs!r} must be a TTSPrograms (TTSPrograms.capture)")
        programs.check(model.settings)  # SettingsMismatchError, naming the settings that differ
        self.model, self.programs, self.mesh = model, programs, model.mesh
        self.talker, self.flow = talker, flow
        replicated = None if self.mesh is None else NamedSharding(self.mesh, P())
        self.decode_steps = programs.decode_steps
        no_codes = jax.device_put(jnp.zeros((programs.codes_width, self.decode_steps), jnp.int32), replicated)
        talker_walks = tuple(walk for walk in programs.buckets.walks if walk != FLOW_CHUNK)
        self.nodes = (
            Node(
                TALKER, ResourceRunner({TALKER_KV: talker}), (TALKER_KV,), model.talker_params, talker_walks,
                feeds=True, no_feed=no_codes, row_walks=RowWalks(TALKER_DECODE, TALKER_PREFILL, TALKER_MIXED),
            ),
            Node(FLOW, ResourceRunner({FLOW_KV: flow}), (FLOW_KV,), model.flow_params, (FLOW_CHUNK,)),
        )  # fmt: skip
        self.voices = VoiceBank(model, talker, flow)
        buckets = programs.buckets
        self._prefill_tokens = buckets.max_tokens(TALKER_PREFILL)
        self._prefill_room = buckets[TALKER_MIXED].prefill_rows[-1] if TALKER_MIXED in buckets else 0
        self._flow_chunk = min(model.config.flow_chunk, buckets.max_tokens(FLOW_CHUNK))
        self._warm_up_voice: Voice | None = None

    # -- requests -----------------------------------------------------------------------------------

    def new_stream(self, request: Any, *, on_output: Any, now: float) -> Stream:
        if not isinstance(request, TTSRequest):
            raise TypeError(f"request={request!r} must be a TTSRequest")
        rid, vocab = request.request_id, self.model.config.text_vocab_size
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
        return Stream(request, on_output=on_output, submitted_at=now)

    def outputs(self, stream: Stream) -> list[AudioChunk]:
        return stream.chunks

    # -- scheduling ---------------------------------------------------------------------------------

    def rows(
        self, node: Node, streams: Sequence[Stream], *, now: float, max_batch: int, in_flight: int | None
    ) -> list[tuple[list, str | None]]:
        if node.name == FLOW:
            return [(flow_rows(streams, now=now, max_batch=max_batch, chunk=self._flow_chunk), FLOW_CHUNK)]
        rows = {
            "now": now, "max_batch": max_batch, "prefill_tokens": self._prefill_tokens,
            "bos": self.model.bos, "text_vocab": self.model.text_vocab, "in_flight": in_flight,
            "decode_steps": self.decode_steps,
        }  # fmt: skip
        decode, prefill = talker_rows(streams, prefill_room=self._prefill_room, **rows)
        if self._prefill_room:
            return [(decode + prefill, None)]
        if decode:  # no combined walk (decode blocks): prefill runs as its own program
            _, prefill = talker_rows([s for s in streams if s.phase is not DECODE], prefill_room=0, **rows)
        return [(decode, TALKER_DECODE), (prefill, TALKER_PREFILL)]

    def choose_bucket(self, node: Node, rows: Sequence, *, rows_per_shard: int | None = None):
        buckets = self.programs.buckets
        if node.name == FLOW:
            size = len(rows) if rows_per_shard is None else rows_per_shard
            return buckets.bucket_for(FLOW_CHUNK, size, max([len(r.codes) for r in rows]))
        room = None  # on a mesh, the most prefill rows any data shard gets: the combined bucket's room
        if rows_per_shard is not None:
            prefill = [r for r in rows if not r.decode]
            placed = node.manager.placement([r.stream.request_id for r in prefill])
            room = batch.fit_shards(prefill, placed, len(prefill))[1] if prefill else 0
        return batch.rows_bucket(
            buckets, node.row_walks, rows, rows_per_shard=rows_per_shard, prefill_per_shard=room
        )

    def position(self, node: Node, stream: Stream) -> StreamPosition:
        return stream.request.voice.position(stream.written_in(node.name))

    def positions(self, node: Node, streams: Sequence[Stream]) -> np.ndarray:
        # `Voice.position`, a batch at once: i64[B, 3] of (source_len, written, source).
        if node.name == FLOW:
            table = [(s.request.voice.frames, s.flow_written, s.request.voice.index) for s in streams]
        else:
            table = [(s.request.voice.frames, s.talker_written, s.request.voice.index) for s in streams]
        return np.fromiter(itertools.chain.from_iterable(table), np.int64, 3 * len(table)).reshape(-1, 3)

    def block_steps(self, bucket) -> int:
        return bucket.num_tokens if bucket.graph_walk == TALKER_DECODE else 1

    def inputs(self, node: Node, bucket, rows: Sequence, layout) -> tuple:
        return step_inputs(bucket, rows, layout)

    # -- outputs ------------------------------------------------------------------------------------

    def dispatched(self, step: InFlight, now: float) -> None:
        if step.node.name == FLOW:
            for row in step.rows:
                stream = row.stream
                stream.flow_written += len(row.codes)  # the row's span
                stream.last_step_at = now
            return
        emits, steps, serial = [], self.decode_steps, step.serial
        for row, index in zip(step.rows, step.indices, strict=True):
            stream = row.stream
            stream.last_step_at = now
            # A decode row's block gives a code per step; a prompt's last chunk gives the first code.
            if row.decode:
                stream.talker_written += row.steps
                emit = row.steps
            else:
                stream.talker_written += len(row.tokens)
                stream.prefilled += len(row.tokens)
                stream.phase = PREFILL
                emit = int(stream.prefilled == stream.prompt_len)
            emits.append(emit)
            if emit:
                stream.codes_in_flight += emit
                stream.feed = (serial, index * steps + emit - 1)  # its newest code, flattened
                stream.phase = DECODE
            if len(stream.codes) + stream.codes_in_flight >= stream.request.frames:  # all scheduled
                stream.phase = FLUSH  # its talker slot is freed once its last code is read
        step.emits = tuple(emits)

    def read(self, step: InFlight, outputs: Any, now: float, ops: StreamOps) -> None:
        if step.node.name == FLOW:
            self._flow_read(step, outputs, now, ops)
            return
        n = len(step.indices)  # every row's block of codes, in one conversion (rows 0 .. n - 1: a slice)
        codes = (outputs[:n] if step.indices == list(range(n)) else outputs[step.indices]).tolist()
        serial, steps = step.serial, self.decode_steps
        for row, index, emits, block in zip(step.rows, step.indices, step.emits, codes, strict=True):
            stream = row.stream
            if not emits or stream.phase.finished:
                continue
            if stream.feed == (serial, index * steps + emits - 1):
                stream.feed = None
            stream.codes_in_flight -= emits
            if stream.replay_codes:
                if not self._append_codes(stream, block[:emits], ops):
                    continue
            else:
                stream.codes.extend(block[:emits])
            if len(stream.codes) >= stream.request.frames:  # the talker is done
                # Held until now, so a fault that loses a step in flight still finds the stream among
                # the cache's holders, and rewinds it.
                ops.release(stream, TALKER)

    def _append_codes(self, stream: Stream, codes: list[int], ops: StreamOps) -> bool:
        """Add generated codes, in order; after a rewind each must be the code generated there before."""
        start = len(stream.codes)
        replayed = stream.replay_codes[start : start + len(codes)] if stream.replay_codes else ()
        for index, (code, before) in enumerate(zip(codes, replayed, strict=False), start):  # replaying only
            if code != before:
                ops.fail(stream, ReplayMismatchError(
                    f"request {stream.request_id!r}: replaying after a fault generated code {code} at "
                    f"frame {index}, where it had generated {before}"
                ))  # fmt: skip
                return False
        stream.codes.extend(codes)
        return True

    def _flow_read(self, step: InFlight, outputs: tuple, now: float, ops: StreamOps) -> None:
        mel, samples = outputs
        rows: list[FlowRow] = step.rows
        n, spans = len(rows), {len(row.codes) for row in rows}
        if len(spans) == 1:  # whole chunks: every row's codes in one array (`fromiter`: see `step_inputs`)
            span = spans.pop()
            codes = np.fromiter(
                itertools.chain.from_iterable([row.codes for row in rows]), np.int32, n * span
            )
            codes = codes.reshape(n, span)
            codes.setflags(write=False)  # each chunk's codes are a row of it
            if step.indices == list(range(n)):  # rows 0 .. n - 1: each chunk's outputs, views in one slice
                mel, samples = list(mel[:n, :span]), list(samples[:n, : span * SAMPLES_PER_FRAME])
            else:
                mel, samples = mel[step.indices, :span], samples[step.indices, : span * SAMPLES_PER_FRAME]
        else:
            codes = [np.array(row.codes, np.int32) for row in rows]
            mel = [mel[i, : len(row.codes)] for i, row in zip(step.indices, rows, strict=True)]
            samples = [
                samples[i, : len(row.codes) * SAMPLES_PER_FRAME]
                for i, row in zip(step.indices, rows, strict=True)
            ]
        for row, row_codes, row_mel, row_samples in zip(rows, codes, mel, samples, strict=True):
            stream, span = row.stream, len(row.codes)
            if stream.phase.finished:  # cancelled by an earlier row's callback, or before it came back
                continue
            chunk = AudioChunk(row.start, row_codes, row_mel, row_samples)
            if stream.chunks and row.start < stream.frames_decoded:  # replayed: the listener has it
                if not _same_chunk(chunk, stream.chunks):
                    ops.fail(stream, ReplayMismatchError(
                        f"request {stream.request_id!r}: replaying after a fault decoded frames "
                        f"[{row.start}, {row.start + span}) differently from the chunk already delivered"
                    ))  # fmt: skip
                continue
            stream.chunks.append(chunk)
            if stream.first_audio_at is None:
                stream.first_audio_at = now
            if stream.on_output is not None and not notify(
                stream, stream.on_output, chunk, ops, name="on_output"
            ):
                continue  # the callback raised, or cancelled its own stream
            frames = stream.request.frames
            if row.start + span == frames and len(stream.codes) >= frames:  # every frame delivered
                ops.done(stream)

    # -- recovery and warm-up -----------------------------------------------------------------------

    def mark(self, stream: Stream) -> tuple:
        return (stream.phase, stream.prefilled, stream.talker_written, len(stream.codes), stream.flow_written)

    def rewind(self, stream: Stream, node: Node, mark: tuple | None) -> None:
        phase, prefilled, talker_written, codes, flow_written = mark or (Phase.WAITING, 0, 0, 0, 0)
        if node.name == FLOW:
            stream.flow_written = flow_written
            return
        if len(stream.codes) > len(stream.replay_codes):  # an earlier replay may still be catching up
            stream.replay_codes = tuple(stream.codes)
        del stream.codes[codes:]
        stream.codes_in_flight, stream.feed = 0, None  # an engine rewinds only with nothing in flight
        stream.phase, stream.prefilled, stream.talker_written = phase, prefilled, talker_written

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """A warm-up request reads a voice: a registered one, else a temporary one removed after."""
        voice = next(iter(self.voices.voices.values()), None)
        temporary = None
        if voice is None:
            temporary = self.voices.capacity - 1
            voice = self.voices.add(temporary, frames=self.model.config.min_voice_frames, seed=0)
        self._warm_up_voice = voice
        try:
            yield
        finally:
            self._warm_up_voice = None
            if temporary is not None:
                self.voices.remove(temporary)

    def warm_up_position(self, node: Node) -> StreamPosition:
        return self._warm_up_voice.position(0)


def _same_chunk(chunk: AudioChunk, delivered: list[AudioChunk]) -> bool:
    """True when `delivered` holds a chunk with `chunk`'s frames and every bit of its output."""
    match = next((c for c in reversed(delivered) if c.first_frame == chunk.first_frame), None)
    return match is not None and all(
        np.array_equal(a, b) for a, b in zip(
            (match.codes, match.mel, match.samples), (chunk.codes, chunk.mel, chunk.samples), strict=True
        )
    )  # fmt: skip


class Engine(ServingEngine):
    """The serving engine of the streaming TTS model: `ServingEngine(TTSServing(...))`, with its voices.

    Args:
      model: the step functions and weights.
      talker, flow: the two caches' managers (geometry as the programs were captured for).
      programs: the captured programs (`TTSPrograms.capture`); they may be shared between engines whose
        models have the settings they were captured for (`SettingsMismatchError` otherwise).
      settings, history, clock: as `ServingEngine` takes them.
    """

    served: TTSServing

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
        served = TTSServing(model, talker=talker, flow=flow, programs=programs)
        super().__init__(served, settings=settings, history=history, clock=clock)
        self.model, self.talker, self.flow, self.voices = model, talker, flow, served.voices

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
          history: finished streams and step records kept (see `ServingEngine`).

        Raises:
          ValueError: `num_voices`, `max_workers`, `max_prefill_rows_in_combined` or `history` not an
            int in range, before anything is built or compiled; a deployment these devices cannot serve.
        """
        return build_from_deployment(
            cls, deployment, progress=progress, implementation=implementation, interpret=interpret,
            max_workers=max_workers, num_voices=num_voices,
            max_prefill_rows_in_combined=max_prefill_rows_in_combined, history=history,
        )  # fmt: skip

    def add_voice(self, index: int, *, frames: int, seed: int) -> Voice:
        """Register a random voice prompt (see `VoiceBank.add`); after warm-up this compiles nothing.

        Raises:
          ValueError: when a live request names voice `index`, admitted or still queued (it would
            otherwise start speaking with the replacement).
        """
        self._check_driver("add_voice")
        waiting = sorted(rid for rid, s in self.streams.items() if s.request.voice.index == index)
        if waiting:
            raise ValueError(
                f"voice {index} is named by live request(s) {waiting}; replace it once they finish"
            )
        with self.counting_compilations():
            return self.voices.add(index, frames=frames, seed=seed)
