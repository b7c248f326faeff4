"""The streaming TTS model's two nodes, as the library's nodes serve them.

- The talker is a `DecoderNode` (`TalkerNode`): it reads the text, then BOS, in chunks, then generates one
  codec frame a step (or a block of K), each the next step's input on the device. Its rows say their
  walk: decode rows and prompt chunks run together on the combined walk where it was captured, else as
  a decode program and one prefill program a round. It is not final: once its last frame is read its
  cache is given back and the flow decoder finishes the stream.
- The flow decoder is a `ChunkNode` (`FlowNode`): whole chunks of the talker's frames (or its last ones)
  become mel and samples, handed to the client as `AudioChunk`s.

Both write after the request's voice, a source prefix shared by every request of that voice; their
programs also take each row's sampling seed (`step_inputs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from mstar_jax.models.streaming_tts.batch import step_inputs
from mstar_jax.models.streaming_tts.model import SAMPLES_PER_FRAME
from mstar_jax.models.streaming_tts.request import FLOW, TALKER, AudioChunk, Stream
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving.chunks import ChunkNode, ChunkRow
from mstar_jax.serving.decoder import DecoderHooks, DecoderNode
from mstar_jax.serving.model import InFlight

__all__ = ["FlowNode", "TalkerNode"]


class _AfterVoice:
    """What both nodes share: a stream writes after its voice (a source prefix) in the node's caches, and
    the programs take the model's inputs (`step_inputs`: with each row's seed)."""

    node: Any

    def position(self, stream: Stream) -> StreamPosition:
        return stream.request.voice.position(stream.progress[self.node.name].written)

    def positions(self, streams: Sequence[Stream]) -> np.ndarray:
        """`Voice.position` of each stream, a batch at once: i64[B, 3] of (source_len, written, source)."""
        name = self.node.name
        table = [(s.request.voice.frames, s.progress[name].written, s.request.voice.index) for s in streams]
        return np.fromiter(itertools.chain.from_iterable(table), np.int64, 3 * len(table)).reshape(-1, 3)

    def inputs(self, bucket: BucketKey, rows: Sequence, layout: Any) -> tuple:
        return step_inputs(bucket, rows, layout)


class TalkerNode(_AfterVoice, DecoderNode, DecoderHooks):
    """The talker as a decoder node, and its own hooks (module doc).

    Args:
      node: its `Node` (it feeds; its rows say their walk).
      buckets, decode_steps, mesh: as `DecoderNode` takes them.
      text_vocab: where codec tokens start among the talker's input tokens.
      decode_walk, prefill_walk: its walks of decode rows and of prompt chunks.
    """

    def __init__(
        self, node: Any, *, buckets: Any, decode_steps: int, mesh: Any, text_vocab: int, decode_walk: str,
        prefill_walk: str,
    ):  # fmt: skip
        self.decode_walk, self.prefill_walk, self.text_vocab = decode_walk, prefill_walk, text_vocab
        self.chunk = buckets.max_tokens(prefill_walk)
        super().__init__(
            node, self, buckets=buckets, decode_steps=decode_steps, mesh=mesh, final=False,
            progress_of=lambda stream: stream.progress[TALKER], one_prefill_program=True,
        )  # fmt: skip

    def prompt(self, stream: Stream) -> tuple[int, ...]:
        return stream.prompt

    def limit(self, stream: Stream) -> int:
        return stream.request.frames

    def input_token(self, token: int) -> int:
        return self.text_vocab + token

    def stop_tokens(self, stream: Stream) -> tuple[int, ...]:
        return ()

    def check(self, request: Any) -> None:
        """A `TTSRequest` checks its own frames."""


class FlowNode(_AfterVoice, ChunkNode):
    """The flow decoder as a chunk node of the talker's frames (module doc).

    Args:
      node: its `Node`.
      source: the talker.
      buckets: its buckets (the flow walk).
      chunk: frames a row reads, at most.
    """

    def __init__(self, node: Any, source: TalkerNode, *, buckets: Any, chunk: int):
        super().__init__(node, source, buckets=buckets, chunk=chunk, progress_of=lambda s: s.progress[FLOW])

    def outputs_of(self, step: InFlight, outputs: tuple) -> list[AudioChunk]:
        """Each row's `AudioChunk`: its frames' codes, mel and samples (views of the step's outputs)."""
        mel, samples = outputs
        rows: list[ChunkRow] = step.rows
        n, spans = len(rows), {row.span for row in rows}
        if len(spans) == 1:  # whole chunks: every row's codes in one array (`fromiter`: see `step_inputs`)
            span = spans.pop()
            codes = np.fromiter(
                itertools.chain.from_iterable([row.tokens for row in rows]), np.int32, n * span
            )
            codes = codes.reshape(n, span)
            codes.setflags(write=False)  # each chunk's codes are a row of it
            if step.indices == list(range(n)):  # rows 0 .. n - 1: each chunk's outputs, views in one slice
                mel, samples = list(mel[:n, :span]), list(samples[:n, : span * SAMPLES_PER_FRAME])
            else:
                mel, samples = mel[step.indices, :span], samples[step.indices, : span * SAMPLES_PER_FRAME]
        else:
            codes = [np.array(row.tokens, np.int32) for row in rows]
            mel = [mel[i, : row.span] for i, row in zip(step.indices, rows, strict=True)]
            samples = [
                samples[i, : row.span * SAMPLES_PER_FRAME] for i, row in zip(step.indices, rows, strict=True)
            ]
        return [
            AudioChunk(*chunk) for chunk in zip([r.start for r in rows], codes, mel, samples, strict=True)
        ]
