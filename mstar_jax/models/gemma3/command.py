"""`mstar-jax generate`: the real Gemma 3 270M streaming text on the bounded caches.

The arguments are added here with nothing heavier than argparse imported, so `mstar-jax -h` works
without the `gemma` extra; `run` imports the model when it runs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar_jax.models.gemma3.gguf import Gemma3Config
    from mstar_jax.resources.kv.bounded.config import SinkWindow

__all__ = ["add_arguments", "resident_bytes", "run"]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be an int >= {minimum}")
        return value

    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _size(text: str) -> int:
    from mstar_jax.devices import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help="prompts, one stream each (default: one short prompt)")
    parser.add_argument(
        "--prompt-file", action="append", default=[], type=pathlib.Path, metavar="PATH",
        help="a text file read as one more prompt (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--max-prompt-tokens", type=_positive, metavar="N", help="keep each prompt's first N tokens"
    )
    parser.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="per stream")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    retention = parser.add_argument_group("the global layers' cache (local layers keep their 512)")
    retention.add_argument("--global-sink", type=_non_negative, metavar="S", help="sinks kept (default 4)")
    size = retention.add_mutually_exclusive_group()
    size.add_argument("--global-window", type=_positive, metavar="W", help="latest kept (default 1020)")
    size.add_argument("--dense", action="store_true", help="keep the model's whole context (32,768)")
    parser.add_argument("--max-slots", type=_positive, metavar="N", help="streams at once (default: all)")
    parser.add_argument("--chunk", type=_positive, default=128, metavar="T", help="prefill tokens a step")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto")
    parser.add_argument("--gguf", type=pathlib.Path, metavar="PATH", help="(default: the gemma extra's)")
    parser.add_argument(
        "--executable-store", type=pathlib.Path, metavar="DIR",
        help="load the compiled programs from DIR and store those compiled (a second start skips capture)",
    )  # fmt: skip
    parser.add_argument(
        "--device-memory", type=_size, metavar="SIZE",
        help="memory to fit the weights and caches in, e.g. 16GiB (default: the accelerator's bytes_limit, "
        "or the host's RAM on a CPU)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="print only the summary")


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Printer:
    """Prints each stream's text as its tokens come: one stream's as it is, several streams' a line at a
    time (at a newline, or once `LINE` characters wait), each line tagged `[i]`.

    A word's pieces (or a character's bytes) only make sense together, so each token's text is what
    decoding the tail since the last shown token adds to decoding that tail without it, taken once it
    holds no replacement character (the incremental detokenization vLLM and TGI use).
    """

    LINE = 96

    def __init__(self, decode: Callable[[list[int]], str], tagged: bool, out=None):
        self.decode, self.tagged, self.out = decode, tagged, out or sys.stdout
        self.ids: dict[int, list[int]] = {}
        self.offsets: dict[int, tuple[int, int]] = {}  # (tail start, tokens shown)
        self.pending: dict[int, str] = {}  # tagged: text not printed yet

    def __call__(self, index: int, token: int) -> None:
        self.ids.setdefault(index, []).append(token)
        self._show(index, final=False)

    def finish(self) -> None:
        """Print what every stream still holds back (a stream may end mid-character or mid-line)."""
        for index in self.ids:
            self._show(index, final=True)

    def _show(self, index: int, *, final: bool) -> None:
        ids = self.ids[index]
        start, shown = self.offsets.get(index, (0, 0))
        text = self.decode(ids[start:])
        new = text[len(self.decode(ids[start:shown])) :]
        if new and (final or not text.endswith("\ufffd")):
            self.offsets[index] = (shown, len(ids))
        else:
            new = ""
        if not self.tagged:
            self.out.write(new)
        else:
            *lines, rest = (self.pending.get(index, "") + new).split("\n")
            if (final and rest) or len(rest) >= self.LINE:
                lines, rest = [*lines, rest], ""
            self.pending[index] = "" if final else rest
            self.out.write("".join(f"[{index}] {line}\n" for line in lines))
        self.out.flush()


def _check_memory(
    args: argparse.Namespace, config: Gemma3Config, retention: SinkWindow, slots: int, source: str,
    error: Callable[[str], Exception],
) -> None:  # fmt: skip
    """Refuse `slots` streams where the weights and both caches would not fit the device's memory.

    Counted abstractly before anything is allocated: the weights from the model's own parameters
    (`nnx.eval_shape`), each cache's slots and source bank from its config (`memory.serving_budget`).

    Raises:
      error: naming `--max-slots`, its value, the bytes needed and available, and the most that fit.
    """
    import jax.numpy as jnp
    from flax import nnx

    from mstar_jax.memory import DeviceMemory, device_memory, format_bytes, serving_budget
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.stream import GLOBAL_KV, LOCAL_KV, cache_configs

    dtype = jnp.dtype(args.dtype)
    local, global_ = cache_configs(config, global_retention=retention, max_slots=slots, dtype=dtype)
    _, params = nnx.split(nnx.eval_shape(lambda: Gemma3(config, dtype=dtype, rngs=nnx.Rngs(0))))
    if args.device_memory is None:
        device = device_memory()
    else:
        device = DeviceMemory(nbytes=args.device_memory, source="--device-memory")
    budget = serving_budget(
        params, {LOCAL_KV: local, GLOBAL_KV: global_}, device, num_sources=1, source=source
    )
    if budget.fits:
        return
    flag = f"--max-slots {slots}" + ("" if args.max_slots else " (one slot per prompt, the default)")
    parts = " + ".join(f"{part.label} {format_bytes(part.nbytes)}" for part in budget.parts if part.nbytes)
    message = (
        f"{flag} needs {parts} = {format_bytes(budget.total)} ({budget.total:,} B), more than the "
        f"{format_bytes(device.nbytes)} ({device.nbytes:,} B) available ({device.source}); "
    )
    if budget.max_fitting_slots is not None:
        message += f"--max-slots {budget.max_fitting_slots} is the most that fits"
    else:
        message += (
            f"not even --max-slots 1 fits, where the largest part is {budget.blocker.label} "
            f"({format_bytes(budget.blocker.nbytes)}): try --dtype bfloat16, a smaller --global-window, or a "
            "device with more memory"
        )
    raise error(message)


def run(args: argparse.Namespace, error: Callable[[str], Exception]) -> int:
    """Load the model, serve the prompts, print the text and the summary; returns the exit status."""
    import jax.numpy as jnp

    from mstar_jax.compile import ExecutableStore
    from mstar_jax.compile.store import check_directory
    from mstar_jax.memory import format_bytes
    from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf, read_config
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.serve import generate
    from mstar_jax.models.gemma3.stream import Gemma3Streams
    from mstar_jax.resources.kv.bounded.config import SinkWindow

    if args.dense and args.global_sink is not None:
        raise error(f"--global-sink {args.global_sink} does not go with --dense, which keeps every position")
    texts = list(args.prompt)
    for path in args.prompt_file:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise error(f"--prompt-file {str(path)!r} cannot be read: {err.strerror}") from None
    texts = texts or ["The old lighthouse keeper climbed the stairs and"]
    if args.executable_store is not None:
        try:
            check_directory(args.executable_store, "--executable-store")
        except ValueError as err:
            raise error(str(err)) from None
    gguf_name = "--gguf" if args.gguf else "the gemma extra's model file"
    try:
        reader = open_gguf(args.gguf or default_gguf_path())
        config = read_config(reader)
    except ModuleNotFoundError as err:
        raise error(str(err)) from None
    except OSError as err:
        raise error(f"--gguf {str(args.gguf)!r} cannot be read: {err.strerror}") from None
    except ValueError as err:  # a corrupt file (GGUFError), another model, a missing key
        raise error(f"{gguf_name}: {err}") from None
    if args.dense:
        retention = SinkWindow(0, config.context_length)
    else:
        sink = 4 if args.global_sink is None else args.global_sink
        retention = SinkWindow(sink, 1020 if args.global_window is None else args.global_window)
    slots = args.max_slots or len(texts)
    _check_memory(args, config, retention, slots, str(args.gguf or "Gemma 3"), error)  # before allocating
    try:
        _, tensors = load_gguf(reader)
        tokenizer = Gemma3Tokenizer.from_gguf(reader)
    except ValueError as err:  # a tensor that does not match its table, a tokenizer that is not one
        raise error(f"{gguf_name}: {err}") from None
    prompts = [tokenizer.encode(text)[: args.max_prompt_tokens] for text in texts]
    model = Gemma3.from_tensors(config, tensors, dtype=jnp.dtype(args.dtype))
    streams = Gemma3Streams(
        config, model, global_retention=retention, max_slots=slots, chunk=args.chunk,
        batch_sizes=(1, 2, 4, 8, 16, 32), implementation=args.implementation,
        store=None if args.executable_store is None else ExecutableStore(args.executable_store),
    )  # fmt: skip
    captures = streams.capture(progress=not args.quiet)
    printer = _Printer(tokenizer.decode, tagged=len(prompts) > 1)
    memory: list[int | None] = []

    def on_token(index: int, token: int) -> None:
        if not args.quiet:
            printer(index, token)
        if not memory:
            memory.append(resident_bytes())

    stops = () if args.ignore_eos else (tokenizer.eos_id,)
    result = generate(streams, prompts, args.max_new_tokens, stop_ids=stops, on_token=on_token)
    if not args.quiet:
        printer.finish()
    memory.append(resident_bytes())
    longest = max(len(p) + len(t) for p, t in zip(prompts, result.tokens, strict=True))
    prompt_rate = result.prompt_tokens / max(result.prompt_seconds, 1e-9)
    decode_rate = result.decoded_tokens / max(result.decode_seconds, 1e-9)
    rss = " -> ".join(format_bytes(m) for m in memory) if None not in memory else "unknown"
    print(
        f"\n\n{len(prompts)} stream(s), {slots} at once; global cache {retention}; longest stream "
        f"{longest:,} tokens (context {config.context_length:,})\n"
        f"generated {result.new_tokens:,} tokens in {result.seconds:.1f} s: prompts read at "
        f"{prompt_rate:,.1f} tokens/s ({result.prompt_tokens:,}), tokens decoded at {decode_rate:.1f}/s "
        f"({result.decoded_tokens:,}, all streams)\n"
        f"memory per stream: {format_bytes(streams.bytes_per_stream)} of cache, fixed whatever the length; "
        f"process resident memory at the first token -> at the end: {rss}\n"
        f"captured {sum(len(r.buckets) for r in captures)} programs ahead of time in "
        f"{sum(r.wall_secs for r in captures):.1f} s ({sum(r.loaded for r in captures)} loaded from the "
        f"executable store); {result.late_captures} compiled while serving; "
        f"{result.refusals} admissions waited for a slot"
    )  # fmt: skip
    return 0
