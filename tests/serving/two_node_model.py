"""A two-node model, added as a user adds one and served through the registry (`ENTRY`) by `mstar-jax run`
and `serve`: `bytes` (`byte_model.py`'s decoder, decode blocks on a walk of their own) hands its bytes to
`chunks`, which reads them CHUNK at a time through an attention layer and hands out OUT floats a byte."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.sink_window_attention.ordered import ordered_sum
from mstar_jax.checks import check_int
from mstar_jax.compile import Buckets, cap_batch_sizes
from mstar_jax.engine import ServingEngine
from mstar_jax.engine.build import deployment_mesh
from mstar_jax.engine.report import write_report
from mstar_jax.memory import params_budget
from mstar_jax.registry import ModelEntry
from mstar_jax.resources.kv import bounded as kv
from mstar_jax.serving import layer_attention
from mstar_jax.serving.chunks import ChunkNode
from mstar_jax.serving.decoder import DecoderHooks, DecoderNode
from mstar_jax.serving.nodes import NodeGraph, node_caches, on_mesh
from tests.serving.byte_model import HEAD_DIM, RETENTION, init_params
from tests.serving.byte_model import step as byte_step

BYTES, CHUNKS, DECODE, PREFILL = "bytes", "chunks", "decode", "prefill"  # nodes; the decoder's walks
CHUNK, OUT, CHUNK_RETENTION = 4, 3, kv.SinkWindow(1, 5)


def init_chunk_params(seed: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed + 1), 5))
    normal = lambda *shape: jax.random.normal(next(keys), shape) / math.sqrt(shape[0])  # noqa: E731
    shapes = {"embed": (256, HEAD_DIM), "wq": (HEAD_DIM, 2 * HEAD_DIM), "wk": (HEAD_DIM, HEAD_DIM),
              "wv": (HEAD_DIM, HEAD_DIM), "out": (2 * HEAD_DIM, OUT)}  # fmt: skip
    return {name: normal(*shape) * (4 if name == "embed" else 1) for name, shape in shapes.items()}


def chunk_step(params, cache, bank, plan: kv.BoundedKVPlan, tokens, lengths, *, config, mesh=None):
    """Every row's floats f32[B, T, OUT], each sum in a fixed order: a row's do not depend on its batch."""
    angles = plan.positions(tokens.shape[1])[..., None].astype(jnp.float32) / 4.0
    x = params["embed"][tokens] * jnp.cos(angles) + jnp.sin(angles)
    dense = lambda x, w: ordered_sum(jnp.swapaxes(x[..., None] * w[None, None], -1, -2))  # noqa: E731
    q, k, v = (jnp.reshape(dense(x, params[n]), (*tokens.shape, -1, HEAD_DIM)) for n in ("wq", "wk", "wv"))
    out, cache = layer_attention(config, bank, plan, mesh=mesh)(cache, 0, q, k, v)
    return cache, jnp.tanh(dense(out.reshape(*tokens.shape, -1), params["out"]))  # 2 query heads, 1 KV head


class TwoNodeRequest(NamedTuple):
    request_id: str
    prompt: bytes
    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwoNodeConfig:
    """The model's `model.config`: its slots and its weights' seed."""

    slots: int = 2
    seed: int = 0
    UNREAD_WORKLOAD = ("voices", "min_frames", "max_frames")

    def __post_init__(self):
        check_int("slots", self.slots, minimum=1)
        check_int("seed", self.seed, minimum=0)

    def resource_specs(self) -> tuple[kv.BoundedKVSpec, ...]:
        return tuple(
            kv.BoundedKVSpec(f"{node}_kv", {node}, kv.BoundedKVConfig(
                num_layers=layers, num_heads=1, head_dim=HEAD_DIM, rows_per_request=1, max_source_len=0,
                retention=retention, query_window=retention.window + 1, max_slots=self.slots))
            for node, layers, retention in ((BYTES, 2, RETENTION), (CHUNKS, 1, CHUNK_RETENTION))
        )  # fmt: skip


class TwoNodeServing(NodeGraph, DecoderHooks):
    """The model served: a `DecoderNode` handing its bytes to a `ChunkNode`, whose outputs the client gets."""

    request_type, decode_walk, prefill_walk, chunk = TwoNodeRequest, DECODE, PREFILL, CHUNK

    def __init__(self, config: TwoNodeConfig, *, batch_sizes=(1, 2), decode_steps: int = 1, mesh=None):
        self.managers = node_caches(config.resource_specs(), mesh=mesh)
        params = on_mesh((init_params(config.seed), init_chunk_params(config.seed)), mesh)
        sizes = cap_batch_sizes(batch_sizes, config.slots)
        decoded = Buckets.of(sizes, {DECODE: decode_steps, PREFILL: CHUNK})
        chunked = Buckets.of(sizes, {CHUNKS: CHUNK})
        decoder = DecoderNode.capture(
            self, BYTES, byte_step, self.managers[0], params[0], decoded, mesh=mesh, decode_walk=DECODE,
            progress_of=lambda s: s.progress[BYTES], final=False,
        )  # fmt: skip
        chunker = ChunkNode.capture(
            CHUNKS, chunk_step, self.managers[1], params[1], chunked, decoder, chunk=CHUNK, mesh=mesh,
            progress_of=lambda s: s.progress[CHUNKS],
        )  # fmt: skip
        super().__init__((decoder, chunker), mesh=mesh)

    def check(self, request: TwoNodeRequest) -> None:  # the decoder node checks `max_new_tokens`
        if not isinstance(request.prompt, bytes) or not request.prompt:
            raise ValueError(f"prompt={request.prompt!r} must be non-empty bytes")


def engine_of(deployment) -> ServingEngine:
    settings, mesh = deployment.engine, deployment_mesh(deployment)
    served = TwoNodeServing(deployment.model_config, batch_sizes=deployment.batch_sizes, mesh=mesh,
                            decode_steps=settings.decode_steps)  # fmt: skip
    engine = ServingEngine(served, settings=settings)
    engine.warm_up()
    return engine


def run(deployment, *, output="runs/latest", print_fn=print, **_) -> dict:
    """`mstar-jax run`: the workload's random prompts, every output in `report.json`, the latency plot."""
    w, engine = deployment.workload, engine_of(deployment)
    rng = np.random.default_rng(w.seed)
    sizes = rng.integers(w.min_text_tokens, w.max_text_tokens + 1, w.streams)
    prompts = [rng.integers(0, 256, n).astype(np.uint8).tobytes() for n in sizes]
    streams = [engine.submit(TwoNodeRequest(f"w{i}", p, w.max_new_tokens)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    done = sum(s.phase.name == "DONE" for s in streams)
    outputs = {s.request_id: [o.values.tolist() for o in s.outputs] for s in streams}
    report = {"streams": {"submitted": len(streams), "done": done}, "outputs": outputs}
    json_path, png_path = write_report(report, engine, pathlib.Path(output))
    print_fn(f"streams {done}/{len(streams)} done; wrote {json_path} and {png_path}")
    return report


def build(deployment, *, progress=False, history=None, voices=None):
    """`mstar-jax serve`: the engine, and `POST /v1/streams` of a `prompt` string and `max_tokens`."""
    from mstar_jax.server.routes import StreamCodec, stream_routes

    def request(body, request_id):  # a bad field is a 400 naming it
        most = body.integer("max_tokens", minimum=1, maximum=64, default=8)
        return TwoNodeRequest(request_id, body.string("prompt").encode(), most)

    return engine_of(deployment), stream_routes(StreamCodec(request, lambda o: o.values.tolist()))


def memory(deployment, device):
    return params_budget(deployment, jax.eval_shape(lambda: (init_params(0), init_chunk_params(0))), device)


ENTRY = ModelEntry(
    name="two_node", config=TwoNodeConfig, **{f: f"{__name__}:{f}" for f in ("run", "build", "memory")}
)
