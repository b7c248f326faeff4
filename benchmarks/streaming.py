"""Streaming TTS talker decode: our bounded cache against StreamingLLM's baseline and a dense cache.

The same talker (the streaming TTS model's, with one geometry) decodes one frame per step for a batch
of streams at a given stream position, three ways:

  bounded     our cache: sink (the 4-frame voice) + window 1020 entries, 1024 retained, in a ring;
  recompute   StreamingLLM's "sliding window with re-computation": no cache, each step re-runs the model
              over the last 1024 tokens;
  dense       a growing cache holding the whole stream: each step attends every entry so far.

Each step's time includes its host work (admission, planning, commit for the bounded cache). Printed
ratios come from this one run: recompute / bounded and dense / bounded at the longest position, and
each method's latency at the longest position over the shortest (bounded and recompute stay flat; dense
grows with the stream). Every case is timed once per repeat, in a fresh random order each repeat
(`benchmarks.timing`); each ratio is the median of the per-repeat ratios with their min–max.

The StreamingLLM paper's 22.2x (its cache over recomputation) was measured on Llama-2-7B on an A100: it
is printed as context only, never as a figure this run can be compared with.

Run: python -m benchmarks.streaming [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import ORDER_NOTE, Spread, describe, interleaved_times, quick_label, ratios
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
    parser.add_argument("--repeats", type=int, default=None, help="samples per case (default 25, quick 10)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 25)
    short, long = (2 * WINDOW, 8 * WINDOW) if args.quick else (2 * WINDOW, 32 * WINDOW)
    label = quick_label(args.quick, f"long position {long}, {repeats} repeats")
    model = StreamingTTSModel(config_for(args.batch), temperature=0.0)
    cfg = model.config
    print(f"benchmarks/streaming.py{label}")
    print(
        f"backend {jax.default_backend()}; talker {cfg.talker_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.talker_heads} query / {cfg.talker_kv_heads} KV heads x {cfg.talker_head_dim}; "
        f"batch {args.batch}; window {WINDOW} (sink {VOICE} + {WINDOW - VOICE})"
    )
    print(f"timing: {ORDER_NOTE}; medians, ratios as median (min–max) over {repeats} repeats")
    t = interleaved_times(
        {
            "b_short": bounded_step(model, args.batch, short),
            "b_long": bounded_step(model, args.batch, long),
            "d_short": dense_step(model, args.batch, short),
            "d_long": dense_step(model, args.batch, long),
            "recompute": recompute_step(model, args.batch),
        },
        repeats,
    )
    ms = {name: Spread.of(samples, scale=1e3).median for name, samples in t.items()}
    row = "  {:<27}{:9.3f}   {:9.3f}   {}"
    over = lambda a, b, fmt=".2f", unit="": describe(ratios(t[a], t[b]), fmt, repeats=False, unit=unit)  # noqa: E731

    print(f"\ndecode step, median ms      at {short:>6}   at {long:>6}   long / short{label}")
    print(row.format("bounded (ours)", ms["b_short"], ms["b_long"], over("b_long", "b_short")))
    print(row.format(f"recompute last {WINDOW}", ms["recompute"], ms["recompute"], "(position-independent)"))
    print(row.format("dense growing cache", ms["d_short"], ms["d_long"], over("d_long", "d_short")))
    print(f"\nratios from this run, at position {long}, median (min–max) over {repeats} repeats{label}")
    print(f"  recompute / bounded   {over('recompute', 'b_long', '.1f', 'x')}")
    print(f"  dense / bounded       {over('d_long', 'b_long', '.1f', 'x')}")
    print(
        "\ncontext only, not comparable: the StreamingLLM paper reports its cache 22.2x faster than "
        "recomputation for Llama-2-7B on an A100 (another model, another machine); this run is a "
        f"{cfg.talker_layers}-layer talker on {jax.default_backend()}"
    )


if __name__ == "__main__":
    main()
