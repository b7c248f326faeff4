"""Streaming TTS talker decode: our bounded cache against StreamingLLM's baseline and a dense cache.

The same talker (the streaming TTS model's, with one geometry) decodes one frame per step for a batch
of streams at a given stream position, three ways:

  bounded     our cache: sink (the 4-frame voice) + window 1020 entries, 1024 retained, in a ring;
  recompute   StreamingLLM's "sliding window with re-computation": no cache, each step re-runs the model
              over the last 1024 tokens (the paper reports its cache 22.2x faster than this);
  dense       a growing cache holding the whole stream: each step attends every entry so far.

Each step's time includes its host work (admission, planning, commit for the bounded cache). Printed
ratios come from this one run: recompute / bounded (StreamingLLM: 22.2x), dense / bounded at the
longest position, and each method's latency at the longest position over the shortest (bounded and
recompute stay flat; dense grows with the stream).

Run: python benchmarks/streaming.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel, dense_attention
from mstar_jax.models.streaming_tts.voices import VoiceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext

WINDOW = 1024  # StreamingLLM's cache size in its speed comparison: 4 sinks + 1020 recent tokens
VOICE = 4


def config_for(batch: int) -> StreamingTTSConfig:
    return StreamingTTSConfig(
        d_model=256, talker_layers=4, talker_heads=8, talker_kv_heads=2, talker_head_dim=32,
        talker_ffn_dim=768, min_voice_frames=VOICE, max_voice_frames=VOICE, talker_sink_extra=0,
        talker_window=WINDOW - VOICE, query_window=WINDOW - VOICE + 1, max_slots=batch,
    )  # fmt: skip


def median_ms_alternating(runs: dict[str, tuple[Callable[[], None], int]]) -> dict[str, float]:
    """Median ms per call of each `(fn, repeats)`, the calls interleaved round by round so that a
    change in machine load affects every method alike. Each fn is called once first (it compiles)."""
    for fn, _ in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(max(repeats for _, repeats in runs.values())):
        for name, (fn, repeats) in runs.items():
            if i < repeats:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bounded_step(model: StreamingTTSModel, batch: int, position: int) -> Callable[[], None]:
    """A decode step through the manager (admit, plan, step, commit) at stream position `position`."""
    spec = model.config.resource_specs()[0]
    talker = BoundedKVManager(spec, num_sources=1)
    flow = BoundedKVManager(model.config.resource_specs()[1], num_sources=1)
    voice = VoiceBank(model, talker, flow).add(0, frames=VOICE, seed=0)
    rids = [f"r{i}" for i in range(batch)]
    written = position - VOICE
    for rid in rids:
        talker.ingest_request(rid)
        talker._requests[rid].written = written  # place the stream without running `written` steps
    step_fn = jax.jit(model.talker_step, donate_argnums=1)
    tokens = model.code_tokens(np.arange(batch)[:, None] % 16)
    lengths, seeds = np.ones(batch, np.int32), np.arange(batch, dtype=np.uint32)
    lease = SlotLease(0, BucketKey("talker_decode", batch, 1))

    def run():
        nonlocal written
        step = BoundedKVStep(
            tuple(Segment(r, "main", 1) for r in rids), {r: voice.position(written) for r in rids}
        )
        ctx = StepContext(rids, "talker_decode", 0, capture=False, slot_lease=lease)
        assert talker.admit(step, ctx).ok
        plan = talker.plan(step, ctx)
        talker.cache, codes = step_fn(
            model.talker_params, talker.cache, talker.bank, plan, tokens, lengths, seeds
        )
        codes.block_until_ready()
        talker.commit(step, ctx)
        written += 1

    return run


def recompute_step(model: StreamingTTSModel, batch: int) -> Callable[[], None]:
    """StreamingLLM's baseline: each step re-encodes the last WINDOW tokens from scratch."""
    graph = model._talker_def
    idx = jnp.arange(WINDOW, dtype=jnp.int32)
    causal = idx[None, :] <= idx[:, None]

    @jax.jit
    def step(params, tokens):
        talker = nnx.merge(graph, params)
        attend = lambda state, layer, q, k, v: (dense_attention(q, k, v, causal), state)  # noqa: E731
        positions = jnp.broadcast_to(idx[None], tokens.shape)
        (hidden,), _ = talker([tokens], [positions], None, [attend])
        return jnp.argmax(talker.logits(hidden[:, -1]), axis=-1)

    tokens = model.code_tokens(np.arange(batch * WINDOW).reshape(batch, WINDOW) % 16)
    return lambda: step(model.talker_params, tokens).block_until_ready()


def dense_step(model: StreamingTTSModel, batch: int, position: int) -> Callable[[], None]:
    """A dense cache of the whole stream: the new token goes to entry `position`, every entry is attended."""
    cfg = model.config
    graph = model._talker_def
    shape = (batch, position + 1, cfg.talker_kv_heads, cfg.talker_head_dim)

    @partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens):
        talker = nnx.merge(graph, params)

        def attend(state, layer, q, k, v):
            ks, vs = state
            ks = (
                *ks[:layer],
                jax.lax.dynamic_update_slice_in_dim(ks[layer], k, position, axis=1),
                *ks[layer + 1 :],
            )
            vs = (
                *vs[:layer],
                jax.lax.dynamic_update_slice_in_dim(vs[layer], v, position, axis=1),
                *vs[layer + 1 :],
            )
            return dense_attention(q, ks[layer], vs[layer], jnp.ones((1, position + 1), bool)), (ks, vs)

        positions = jnp.full(tokens.shape, position, jnp.int32)
        (hidden,), cache = talker([tokens], [positions], cache, [attend])
        return cache, jnp.argmax(talker.logits(hidden[:, -1]), axis=-1)

    layers = range(cfg.talker_layers)
    state = {"cache": tuple(tuple(jnp.zeros(shape) for _ in layers) for _ in range(2))}
    tokens = model.code_tokens(np.arange(batch)[:, None] % 16)

    def run():
        state["cache"], codes = step(model.talker_params, state["cache"], tokens)
        codes.block_until_ready()

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter streams and fewer repeats")
    parser.add_argument(
        "--batch", type=int, default=4, help="streams decoding together (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    repeats = 15 if args.quick else 25
    short, long = (2 * WINDOW, 8 * WINDOW) if args.quick else (2 * WINDOW, 32 * WINDOW)
    model = StreamingTTSModel(config_for(args.batch), temperature=0.0)
    cfg = model.config
    print(
        f"backend {jax.default_backend()}; talker {cfg.talker_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.talker_heads} query / {cfg.talker_kv_heads} KV heads x {cfg.talker_head_dim}; "
        f"batch {args.batch}; window {WINDOW} (sink {VOICE} + {WINDOW - VOICE})"
    )
    # The recompute baseline is hundreds of times slower: a few calls measure it well enough.
    ms = median_ms_alternating(
        {
            "b_short": (bounded_step(model, args.batch, short), repeats),
            "b_long": (bounded_step(model, args.batch, long), repeats),
            "d_short": (dense_step(model, args.batch, short), repeats),
            "d_long": (dense_step(model, args.batch, long), repeats),
            "recompute": (recompute_step(model, args.batch), 3),
        }
    )
    b_short, b_long, d_short, d_long, r = (
        ms[k] for k in ("b_short", "b_long", "d_short", "d_long", "recompute")
    )

    print(f"\ndecode step, median ms      at {short:>6}   at {long:>6}   long / short")
    print(f"  bounded (ours)             {b_short:9.3f}   {b_long:9.3f}   {b_long / b_short:6.2f}")
    print(f"  recompute last {WINDOW}      {r:9.3f}   {r:9.3f}   {1.0:6.2f}  (position-independent)")
    print(f"  dense growing cache        {d_short:9.3f}   {d_long:9.3f}   {d_long / d_short:6.2f}")
    print("\nratios from this run")
    print(f"  recompute / bounded   {r / b_long:7.1f}x   (StreamingLLM reports 22.2x, Llama-2-7B on an A100)")
    print(f"  dense / bounded       {d_long / b_long:7.1f}x   at position {long}")


if __name__ == "__main__":
    main()
