"""Gemma 3 through the engine on whatever device JAX has: prefill and decode tokens per second.

A random-weight Gemma 3 of the 270M geometry (`GEMMA3_270M`: no model file needed, so it runs on a lent
device that has none; `--tiny`: a model of a few thousand parameters, for a dry run), its global layers
on `SinkWindow(4, 1020)`. B streams of a P-token prompt each decode N greedy tokens through
`ServingEngine(Gemma3Serving(...))`, synchronous and pipelined, the two timed once per repeat in a fresh
random order (`benchmarks.timing`). Prefill rate: every prompt token over the time to the last stream's
first token; decode rate: every token after each stream's first over the time from there to the end.
Medians (min–max) over the repeats; the programs are captured once per K, before any timing. With
`--steps`, decode blocks of K tokens a dispatch (`EngineSettings.decode_steps`) too, each K timed in the
same interleaved run as K = 1; every K must give every stream the same tokens (checked).

Run: python -m benchmarks.gemma_decode [--quick] [--tiny] [--batch B] [--prompt P] [--tokens N]
     [--repeats R] [--steps K ...] [--trace DIR]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label
from benchmarks.trace_summary import add_trace_argument, write_trace
from mstar_jax.engine import ServingEngine
from mstar_jax.models.gemma3.gguf import GEMMA3_270M, Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.serving import Gemma3Programs, Gemma3Serving, TextRequest
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow
from mstar_jax.settings import EngineSettings

TINY = Gemma3Config(
    vocab_size=64, num_layers=6, d_model=32, ffn_dim=48, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_eps=1e-6, rope_global_base=1e6, rope_local_base=1e4, sliding_window=8, context_length=256,
    bos_id=2, eos_id=1, add_bos=True,
)  # fmt: skip
RETENTION = SinkWindow(4, 1020)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (labelled)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model instead of the 270M geometry"
    )
    parser.add_argument("--batch", type=int, default=None, help="streams at once (default 8, quick 2)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512, quick 32)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens each decodes (default 128, quick 8)")
    parser.add_argument("--repeats", type=int, default=None, help="runs each way (default 5, quick 1)")
    add_trace_argument(parser, "serve once more, pipelined at K = 1,")
    parser.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=[],
        help="decode steps per dispatch K besides 1 (default: none)",
    )
    args = parser.parse_args(argv)
    batch = args.batch or (2 if args.quick else 8)
    prompt, tokens = args.prompt or (32 if args.quick else 512), args.tokens or (8 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 5)
    ks = sorted({1, *args.steps})
    config = TINY if args.tiny else GEMMA3_270M
    label = quick_label(
        args.quick, f"batch {batch}, {prompt}-token prompts, {tokens} tokens, {repeats} repeats"
    )
    print(f"benchmarks/gemma_decode.py{label}")
    geometry = "tiny" if args.tiny else "270M"
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); the {geometry} geometry")
    print(f"timing: {ORDER_NOTE}; {repeats} repeats; median (min–max)")
    model = Gemma3(config, rngs=nnx.Rngs(0))
    chunk = min(128, prompt)

    def new_streams() -> Gemma3Streams:
        return Gemma3Streams(
            config, model, global_retention=RETENTION, max_slots=batch, chunk=chunk, batch_sizes=(batch,)
        )

    programs = {}
    for k in ks:
        started = time.perf_counter()
        programs[k] = Gemma3Programs.capture(new_streams(), decode_steps=k)
        took = time.perf_counter() - started
        print(f"captured {len(programs[k].buckets.keys())} programs for K={k} in {took:.0f} s")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, prompt) for _ in range(batch)]
    rates: dict[str, dict[str, list[float]]] = {}
    tokens_of: dict[str, list[list[int]]] = {}

    def case(pipelined: bool, k: int):
        name = ("pipelined" if pipelined else "synchronous") + ("" if k == 1 else f" K={k}")
        rates[name] = {"prefill": [], "decode": []}

        def run() -> float:
            settings = EngineSettings(max_batch=batch, pipelined=pipelined, decode_steps=k)
            engine = ServingEngine(Gemma3Serving(new_streams(), programs[k]), settings=settings)
            engine.warm_up()
            streams = [engine.submit(TextRequest(f"s{i}", p, tokens)) for i, p in enumerate(prompts)]
            start = engine.clock()
            engine.run_until_idle()
            end = engine.clock()
            if engine.compilations:
                raise RuntimeError(f"{engine.compilations} programs compiled while serving")
            first = max(s.first_token_at for s in streams)
            rates[name]["prefill"].append(batch * prompt / (first - start))
            rates[name]["decode"].append(sum(len(s.tokens) - 1 for s in streams) / (end - first))
            tokens_of.setdefault(name, [list(s.tokens) for s in streams])
            if tokens_of[name] != tokens_of["synchronous"]:
                raise RuntimeError(f"{name} generated other tokens than synchronous K=1")
            return end - start

        return run

    # Warm-ups run in list order: synchronous K = 1 first, so every later case has tokens to check against.
    cases = [case(pipelined, k) for k in ks for pipelined in (False, True)]
    interleaved_times(cases, repeats, self_timed=True)
    print(f"\ntokens per second, {batch} streams{label}")
    for name, measured in rates.items():
        prefill = describe(measured["prefill"][-repeats:], ".1f", repeats=False)
        decode = describe(measured["decode"][-repeats:], ".1f", repeats=False)
        print(f"   {name:<17} prefill {prefill}, decode {decode}")
    if args.trace is not None:
        write_trace(args.trace, case(True, 1))


if __name__ == "__main__":
    main()
