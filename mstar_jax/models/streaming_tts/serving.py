"""The streaming TTS model as the engine serves it, and `Engine`, the serving engine built for it.

`TTSServing` is the model's part of the protocol (`mstar_jax.serving.ServedModel`): two nodes, the
talker (a decoder that feeds: its sampled codes are the next talker step's input, on the device) and the
flow decoder (chunks of codes to mel and samples, copied back asynchronously). Each round runs one
talker program (decode, prefill, or both on the combined walk, on a mesh too; with decode blocks,
K > 1, decode and prefill run as two programs) and one flow program (`nodes.py`: the talker is the
library's `DecoderNode`, the flow decoder its `ChunkNode`).

Each step has two halves. At dispatch (`dispatched`) what the step will do is known from its rows
alone: entries written, prompt read, codes coming, the talker done; the next step is formed from that.
When its outputs are back on the host (`read`: at once in a synchronous engine, a step later in a
pipelined one), the codes are appended and the audio delivered, once and in order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.compile import Buckets
from mstar_jax.engine.engine import ServingEngine
from mstar_jax.models.streaming_tts.build import build_from_deployment
from mstar_jax.models.streaming_tts.model import (
    FLOW_CHUNK,
    TALKER_DECODE,
    TALKER_MIXED,
    TALKER_PREFILL,
    StreamingTTSModel,
)
from mstar_jax.models.streaming_tts.nodes import FlowNode, TalkerNode
from mstar_jax.models.streaming_tts.programs import TTSPrograms
from mstar_jax.models.streaming_tts.request import FLOW, TALKER, Stream, TTSRequest
from mstar_jax.models.streaming_tts.resource_keys import FLOW_KV, TALKER_KV
from mstar_jax.models.streaming_tts.voices import Voice, VoiceBank
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.serving.model import Node, RowWalks
from mstar_jax.serving.nodes import NodeGraph
from mstar_jax.settings import EngineSettings

__all__ = ["Engine", "TTSServing"]


class TTSServing(NodeGraph):
    """The streaming TTS model served: its talker and flow nodes over the two caches (module doc).

    Args:
      model: the step functions and weights.
      talker, flow: the two caches' managers (geometry as the programs were captured for).
      programs: the captured programs (`TTSPrograms.capture`); `SettingsMismatchError` when they were
        captured for other model settings.

    Attributes:
      voices: the voices registered in both caches' source banks.
    """

    request_type = TTSRequest

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
        self.model, self.talker, self.flow = model, talker, flow
        mesh, buckets, steps = model.mesh, programs.buckets, programs.decode_steps
        replicated = None if mesh is None else NamedSharding(mesh, P())
        no_codes = jax.device_put(jnp.zeros((programs.codes_width, steps), jnp.int32), replicated)
        talker_walks = tuple(walk for walk in buckets.walks if walk != FLOW_CHUNK)
        talker_node = Node(
            TALKER, ResourceRunner({TALKER_KV: talker}), (TALKER_KV,), model.talker_params, talker_walks,
            feeds=True, no_feed=no_codes, row_walks=RowWalks(TALKER_DECODE, TALKER_PREFILL, TALKER_MIXED),
        )  # fmt: skip
        talker_node = TalkerNode(
            talker_node, buckets=buckets, decode_steps=steps, mesh=mesh, text_vocab=model.text_vocab,
            decode_walk=TALKER_DECODE, prefill_walk=TALKER_PREFILL,
        )  # fmt: skip
        flow_buckets = Buckets(tuple(s for s in buckets.sets if s.graph_walk == FLOW_CHUNK))
        flow_node = Node(FLOW, ResourceRunner({FLOW_KV: flow}), (FLOW_KV,), model.flow_params, (FLOW_CHUNK,))
        chunk = min(model.config.flow_chunk, buckets.max_tokens(FLOW_CHUNK))
        flow_node = FlowNode(flow_node, talker_node, buckets=flow_buckets, chunk=chunk)
        super().__init__((talker_node, flow_node), programs=programs, mesh=mesh, decode_steps=steps)
        self.voices = VoiceBank(model, talker, flow)
        self._warm_up_voice: Voice | None = None

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
        prompt = (*request.text, self.model.bos)
        return Stream(request, on_output=on_output, submitted_at=now, prompt=prompt)

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
