"""Gemma 3 as the engine serves it: text requests in, greedy tokens out, on its two bounded caches.

`Gemma3Serving` is the model's part of `mstar_jax.serving.ServedModel`, a `GreedyDecoder`
(`mstar_jax/serving/decoder.py`, which keeps its streams' books): one node, `gemma3`, whose step runs
both caches (local and global layers, `Gemma3Streams`) and returns each row's next greedy token. It
feeds: a decode row reads its input token from the previous step's outputs on the device, so a pipelined
engine dispatches step t + 1 before it reads step t. Each round runs a decode program of K one-token
steps (`EngineSettings.decode_steps`; the stop tokens checked on the device) for every stream
generating, then prefill programs of prompt chunks (new streams read `chunk` tokens a row); a stream's
last chunk gives its first token. Served through `mstar_jax.engine.ServingEngine`, every
stream gets `Gemma3Streams.greedy`'s tokens exactly, alone or in a crowd, synchronous or pipelined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mstar_jax import distributed
from mstar_jax.checks import INT32_MAX, check_int, check_number
from mstar_jax.compile import Buckets
from mstar_jax.models.gemma3.stream import DECODE, GLOBAL_KV, LOCAL_KV, PREFILL, Gemma3Streams, step_extras
from mstar_jax.serving.decoder import DecodeRow, DecoderStream, GreedyDecoder
from mstar_jax.serving.decoder_programs import MAX_STOP_TOKENS, DecoderPrograms, capture_decoder
from mstar_jax.settings import MAX_DECODE_STEPS

__all__ = ["GEMMA3", "Gemma3Programs", "Gemma3Serving", "TextRequest", "TextRow", "TextStream"]

GEMMA3 = "gemma3"
"""The one node's name."""

MAX_TEMPERATURE = 100.0
"""The highest sampling temperature a request may ask for (beyond, the draw is uniform to float
precision)."""


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """Continue `prompt` for at most `max_new_tokens` tokens: greedily, or sampled at `temperature`.

    Attributes:
      request_id: unique among live requests.
      prompt: i32[tokens] token ids (at least one).
      max_new_tokens: tokens to generate, at most.
      stop_tokens: generation ends after any of these (it is kept, as the last token); at most
        `MAX_STOP_TOKENS` (16: a decode block checks them on the device).
      temperature: 0 takes the most likely token; above, tokens are drawn from the softmax of the
        logits divided by it (`mstar_jax.serving.sample`).
      seed: the draw's seed; the same request with the same seed gives the same tokens, alone or in a
        crowd, whatever the batch.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} must be a non-empty str")
        for name in ("prompt", "stop_tokens"):
            values = np.asarray(getattr(self, name))
            if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
                raise ValueError(
                    f"request {self.request_id!r}: {name}={getattr(self, name)!r} must be one sequence of "
                    "integer token ids"
                )
            object.__setattr__(self, name, tuple(int(t) for t in values))
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r}: prompt is empty; it needs at least one token")
        if len(self.stop_tokens) > MAX_STOP_TOKENS:
            raise ValueError(
                f"request {self.request_id!r}: stop_tokens holds {len(self.stop_tokens)} tokens; at most "
                f"{MAX_STOP_TOKENS} are allowed"
            )
        where = f"request {self.request_id!r}: "
        check_int(where + "max_new_tokens", self.max_new_tokens, minimum=1, maximum=INT32_MAX)
        check_number(where + "temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE)
        check_int(where + "seed", self.seed, minimum=0, maximum=2**32 - 1)
        object.__setattr__(self, "temperature", float(self.temperature))


@dataclasses.dataclass(eq=False)
class TextStream(DecoderStream):
    """A text request's progress and tokens (`DecoderStream`); `request` is its `TextRequest`."""


TextRow = DecodeRow
"""One stream's part of a step (`DecodeRow`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Gemma3Programs(DecoderPrograms):
    """The fed `next`-token step of every bucket (`Gemma3Programs.capture`).

    Attributes:
      buckets: `Gemma3Streams.buckets` (prefill and decode walks).
      steps: walk -> `CapturedStep`; each takes `(params, caches, banks, plans, prev_tokens i32[C],
        feed i32[B], tokens i32[B, T], lengths i32[B], targets i32[B, T], temperatures f32[B],
        seeds u32[B])` and returns the caches and every row's next token, padded to `C` (`width`, the
        most rows any program runs).
      shards: the data shards of `streams`' mesh (1: one device).
    """

    @classmethod
    def capture(
        cls, streams: Gemma3Streams, *, progress: bool = False, decode_steps: int = 1
    ) -> Gemma3Programs:
        """Compile every bucket ahead of time (or load it from `streams`' executable store; never on a
        mesh of many processes, whose programs pair with other processes' devices).

        Args:
          decode_steps: K, the one-token decode steps each decode program runs
            (`EngineSettings.decode_steps`); the decode walk's buckets are then of K tokens.
        """
        check_int("decode_steps", decode_steps, minimum=1, maximum=MAX_DECODE_STEPS)
        local, global_, mesh = streams.local, streams.global_, streams.mesh
        fingerprint = (streams.config, local.config, global_.config)
        store = None if mesh is not None and distributed.spans_processes(mesh) else streams.store
        buckets = Buckets(tuple(
            dataclasses.replace(streams.buckets[walk], token_counts=(decode_steps,)) if walk == DECODE
            else streams.buckets[walk] for walk in streams.buckets.walks
        ))  # fmt: skip
        steps = capture_decoder(
            streams.step_fn, buckets, streams.params, (local.cache, global_.cache),
            (local.bank, global_.bank), name="gemma3 fed", extra=step_extras, mesh=mesh,
            static_kwargs={"head": "next"}, progress=progress, store=store, fingerprint=fingerprint,
            decode_walk=DECODE,
        )  # fmt: skip
        shards = 1 if mesh is None else mesh.shape["data"]
        return cls(buckets=buckets, steps=steps, shards=shards, decode_walk=DECODE)


class Gemma3Serving(GreedyDecoder):
    """Gemma 3 served by the engine (module doc).

    Args:
      streams: the weights, both caches and their buckets.
      programs: the captured programs (`Gemma3Programs.capture(streams)`, the default).
    """

    request_type, stream_type = TextRequest, TextStream
    decode_walk, prefill_walk = DECODE, PREFILL  # a row of one token runs DECODE, as Gemma3Streams.declare

    def __init__(self, streams: Gemma3Streams, programs: Gemma3Programs | None = None):
        if not isinstance(streams, Gemma3Streams):
            raise TypeError(f"streams={streams!r} must be a Gemma3Streams")
        if programs is not None and not isinstance(programs, Gemma3Programs):
            raise TypeError(f"programs={programs!r} must be a Gemma3Programs (Gemma3Programs.capture)")
        self.streams = streams
        programs = programs or Gemma3Programs.capture(streams)
        keys = (LOCAL_KV, GLOBAL_KV)
        super().__init__(GEMMA3, streams.runner, keys, streams.params, programs, mesh=streams.mesh)

    @property
    def chunk(self) -> int:
        return self.streams.chunk

    def check(self, request: TextRequest) -> None:
        vocab = self.streams.config.vocab_size
        for name in ("prompt", "stop_tokens"):
            bad = [t for t in getattr(request, name) if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"request {request.request_id!r}: {name} tokens {bad[:5]} are outside "
                    f"[0, vocab_size={vocab})"
                )

    def check_input(self, stream: TextStream, tokens: Any, max_new_tokens: Any) -> None:
        """Refuse a turn that is not a non-empty sequence of ints inside the vocabulary, or whose
        `max_new_tokens` is not an int >= 1."""
        super().check_input(stream, tokens, max_new_tokens)
        vocab = self.streams.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {stream.request_id!r}: tokens {bad[:5]} are outside [0, vocab_size={vocab})"
            )

    def extra_inputs(self, rows: Sequence[DecodeRow], places: Sequence[int], size: int, span: int) -> tuple:
        """The targets `next` does not read, then each row's temperature and seed."""
        temperatures, seeds = np.zeros(size, np.float32), np.zeros(size, np.uint32)
        for i, row in zip(places, rows, strict=True):
            temperatures[i], seeds[i] = row.stream.request.temperature, row.stream.request.seed
        return np.zeros((size, span), np.int32), temperatures, seeds
