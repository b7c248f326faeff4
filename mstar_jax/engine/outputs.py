"""What a step's outputs do to its streams: codes appended, chunks delivered once and in order, and
streams finished when their audio is complete."""

from __future__ import annotations

import numpy as np

from mstar_jax.engine.records import InFlight
from mstar_jax.engine.request import AudioChunk, Phase, ReplayMismatchError, RequestError, Stream
from mstar_jax.engine.scheduler import FlowRow
from mstar_jax.models.streaming_tts.model import SAMPLES_PER_FRAME

__all__ = ["Outputs"]


class Outputs:
    """The part of `Engine` that hands a step's outputs to its streams.

    Each step has two halves. At dispatch (`_talker_dispatched`, `_flow_dispatched`) what the step
    will do is known from its rows alone: entries written, prompt read, codes coming, the talker done;
    the next step is formed from that. When its outputs are back on the host (`_talker_read`,
    `_flow_read`: at once in a synchronous engine, a step later in a pipelined one), the codes are
    appended and the audio delivered.
    """

    def _talker_dispatched(self, step: InFlight, now: float) -> tuple[bool, ...]:
        """Advance the rows' streams by the step; return which rows generate a code."""
        coded = []
        for row, index in zip(step.rows, step.indices, strict=True):
            stream = row.stream
            stream.talker_written += row.span
            stream.last_step_at = now
            if not row.decode:
                stream.prefilled += row.span
                stream.phase = Phase.PREFILL
            coded.append(row.decode or stream.prefilled == stream.prompt_len)
            if coded[-1]:
                stream.codes_in_flight += 1
                stream.feed = (step.serial, index)
                stream.phase = Phase.DECODE
            if stream.codes_scheduled >= stream.request.frames:
                stream.phase = Phase.FLUSH  # its talker slot is freed once its last code is read
        return tuple(coded)

    def _talker_read(self, step: InFlight, codes: np.ndarray) -> None:
        for row, index, coded in zip(step.rows, step.indices, step.coded, strict=True):
            stream = row.stream
            if stream.phase.finished or not coded:
                continue
            if stream.feed == (step.serial, index):
                stream.feed = None
            stream.codes_in_flight -= 1
            stream.faults = 0
            if self._append_code(stream, int(codes[index])) and stream.talker_done:
                # Held until now, so a fault that loses a step in flight still finds the stream among
                # the cache's holders, and rewinds it.
                self.nodes["talker"].runner.remove_request(stream.request_id)

    def _append_code(self, stream: Stream, code: int) -> bool:
        """Add a generated code; after a rewind it must be the code generated there before."""
        index = len(stream.codes)
        if index < len(stream.replay_codes) and stream.replay_codes[index] != code:
            self._fail(stream, ReplayMismatchError(
                f"request {stream.request_id!r}: replaying after a fault generated code {code} at frame "
                f"{index}, where it had generated {stream.replay_codes[index]}"
            ))  # fmt: skip
            return False
        stream.codes.append(code)
        return True

    def _flow_dispatched(self, rows: list[FlowRow], now: float) -> None:
        for row in rows:
            row.stream.flow_written += row.span
            row.stream.last_step_at = now

    def _flow_read(self, step: InFlight, outputs: tuple[np.ndarray, np.ndarray], now: float) -> None:
        mel, samples = ([x[i] for i in step.indices] for x in outputs)
        for i, row in enumerate(step.rows):
            stream, span = row.stream, row.span
            if stream.phase.finished:  # cancelled by an earlier row's callback, or before it came back
                continue
            chunk = AudioChunk(
                first_frame=row.start, codes=np.asarray(row.codes, np.int32), mel=mel[i][:span],
                samples=samples[i][: span * SAMPLES_PER_FRAME],
            )  # fmt: skip
            stream.faults = 0
            if row.start < stream.frames_decoded:  # replayed after a fault: the listener has it already
                if not _same_chunk(chunk, stream.chunks):
                    self._fail(stream, ReplayMismatchError(
                        f"request {stream.request_id!r}: replaying after a fault decoded frames "
                        f"[{row.start}, {row.start + span}) differently from the chunk already delivered"
                    ))  # fmt: skip
                continue
            stream.chunks.append(chunk)
            if stream.first_audio_at is None:
                stream.first_audio_at = now
            if stream.on_chunk is not None:
                try:
                    stream.on_chunk(chunk)
                except Exception as err:  # a client's callback must not stop the other streams
                    self._fail(
                        stream, RequestError(f"request {stream.request_id!r}: on_chunk raised {err!r}")
                    )
                    continue
                if stream.phase.finished:  # the callback cancelled its own stream
                    continue
            if stream.talker_done and stream.frames_decoded == stream.request.frames:
                self._finish(stream, Phase.DONE, None)


def _same_chunk(chunk: AudioChunk, delivered: list[AudioChunk]) -> bool:
    """True when `delivered` holds a chunk with `chunk`'s frames and every bit of its output."""
    match = next((c for c in reversed(delivered) if c.first_frame == chunk.first_frame), None)
    return match is not None and all(
        np.array_equal(a, b) for a, b in zip(
            (match.codes, match.mel, match.samples), (chunk.codes, chunk.mel, chunk.samples), strict=True
        )
    )  # fmt: skip
