"""What a step's outputs do to its streams: codes appended, chunks delivered once and in order, and
streams finished when their audio is complete."""

from __future__ import annotations

import numpy as np

from mstar_jax.engine import batch
from mstar_jax.engine.batch import Layout
from mstar_jax.engine.request import AudioChunk, Phase, ReplayMismatchError, RequestError, Stream
from mstar_jax.engine.scheduler import FlowRow, TalkerRow
from mstar_jax.models.streaming_tts.model import SAMPLES_PER_FRAME
from mstar_jax.resources.step import BucketKey

__all__ = ["Outputs"]


class Outputs:
    """The part of `Engine` that hands a step's outputs to its streams."""

    def _after_talker(
        self, rows: list[TalkerRow], bucket: BucketKey, codes: np.ndarray, now: float, layout: Layout | None
    ) -> None:
        for row, code in zip(rows, batch.row_outputs(bucket, rows, codes, layout), strict=True):
            stream = row.stream
            stream.talker_written += row.span
            stream.last_step_at = now
            stream.faults = 0
            if not row.decode:
                stream.prefilled += row.span
                stream.phase = Phase.PREFILL
            if row.decode or stream.prefilled == stream.prompt_len:
                if not self._append_code(stream, int(code)):
                    continue
                stream.phase = Phase.DECODE
            if stream.talker_done:
                stream.phase = Phase.FLUSH
                self.nodes["talker"].runner.remove_request(stream.request_id)  # its talker slot is free now

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

    def _after_flow(
        self, rows: list[FlowRow], bucket: BucketKey, outputs: tuple[np.ndarray, np.ndarray], now: float,
        layout: Layout | None,
    ) -> None:  # fmt: skip
        mel, samples = (batch.row_outputs(bucket, rows, x, layout) for x in outputs)
        for i, row in enumerate(rows):
            stream, span = row.stream, row.span
            if stream.phase.finished:  # cancelled by an earlier row's callback during this step
                continue
            chunk = AudioChunk(
                first_frame=row.start, codes=np.asarray(row.codes, np.int32), mel=mel[i][:span],
                samples=samples[i][: span * SAMPLES_PER_FRAME],
            )  # fmt: skip
            stream.flow_written += span
            stream.last_step_at = now
            stream.faults = 0
            delivered = stream.chunks[-1].first_frame + len(stream.chunks[-1].codes) if stream.chunks else 0
            if row.start < delivered:  # replayed after a fault: the listener has it already
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
            if stream.talker_done and stream.flow_written == stream.request.frames:
                self._finish(stream, Phase.DONE, None)


def _same_chunk(chunk: AudioChunk, delivered: list[AudioChunk]) -> bool:
    """True when `delivered` holds a chunk with `chunk`'s frames and every bit of its output."""
    match = next((c for c in reversed(delivered) if c.first_frame == chunk.first_frame), None)
    return match is not None and all(
        np.array_equal(a, b) for a, b in zip(
            (match.codes, match.mel, match.samples), (chunk.codes, chunk.mel, chunk.samples), strict=True
        )
    )  # fmt: skip
