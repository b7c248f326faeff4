"""`mstar-jax generate` served: the real Gemma 3 270M streaming text through the one engine.

`mstar_jax.models.gemma3.command` adds the command's arguments (cheaply, so `mstar-jax -h` works without
the `gemma` extra); `run` here loads the model, checks the memory budget before allocating anything, and
serves every prompt as a `TextRequest` through `ServingEngine(Gemma3Serving(...), pipelined=True)`, with
the engine's queue: `--max-slots` streams hold a slot of both caches at once, the others are refused
admission and wait (held, retried) until a stream finishes and gives its slots back. Each token is
printed as it comes (`_Printer`), then a summary.

How the summary counts:
- prompt tokens: every stream's `prefilled` (its prompt after `--max-prompt-tokens`); decoded tokens:
  the tokens fed back to decode, every generated token but each stream's last (its first comes from
  its prompt's last chunk).
- their seconds: the engine's step records (`engine.records`, in the order steps were read back), a step
  charged the time from its start, or the previous step's read-back if later, to its own read-back; so
  a pipelined engine's overlapping steps are not counted twice. A step is a prompt step when its rows
  are still reading their prompts (a stream's position below its prompt's length), else a decode step.
- compiled while serving: `engine.compilations` (programs compiled by a step after warm-up).
- admissions that waited for a slot: the streams the caches refused at least once (`hold_until` set);
  the engine retries a held stream every `hold_backoff_s`, and `stats.allocation_failed` counts
  every refusal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from mstar_jax.engine.records import StepRecord

if TYPE_CHECKING:
    from mstar_jax.models.gemma3.gguf import Gemma3Config
    from mstar_jax.models.gemma3.serving import TextStream
    from mstar_jax.resources.kv.bounded.config import SinkWindow

__all__ = ["charged_seconds", "resident_bytes", "run"]

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
"""Rows per compiled program (below `--max-slots`; `Gemma3Streams` adds `--max-slots` itself)."""


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
      error: naming `--max-slots`, its value, the bytes needed and available, and the most that fit; or
        naming `--global-sink` and `--global-window` where the caches cannot hold them.
    """
    import jax.numpy as jnp
    from flax import nnx

    from mstar_jax.memory import DeviceMemory, device_memory, format_bytes, serving_budget
    from mstar_jax.models.gemma3 import screen
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.stream import GLOBAL_KV, LOCAL_KV, cache_configs

    dtype = jnp.dtype(args.dtype)
    try:
        local, global_ = cache_configs(config, global_retention=retention, max_slots=slots, dtype=dtype)
    except ValueError as err:  # a sink and window past int32 positions together (each flag is bounded)
        flags = (
            "--dense" if args.dense else f"--global-sink {retention.sink} --global-window {retention.window}"
        )
        raise error(f"{flags}: the global layers' cache cannot keep them: {err}") from None
    _, params = nnx.split(nnx.eval_shape(lambda: Gemma3(config, dtype=dtype, rngs=nnx.Rngs(0))))
    if args.greedy_screen:
        params = (params, screen.abstract_arrays(config.vocab_size, config.d_model))
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


def charged_seconds(records: Iterable[StepRecord]) -> list[float]:
    """Each step's share of the serving time, in the order the steps were read back: from its start, or
    the previous step's read-back where that came later, to its own read-back (so the steps of a
    pipelined engine, each dispatched before the one before it is read, share no second)."""
    shares, last = [], -math.inf
    for record in records:
        end = record.started + record.latency
        shares.append(max(0.0, end - max(record.started, last)))
        last = max(last, end)
    return shares


def run(args: argparse.Namespace, error: Callable[[str], Exception]) -> int:
    """Load the model, serve the prompts through the engine, print the text and the summary (module
    doc); returns the exit status: 0, or 1 where a stream failed (each named on stderr)."""
    import jax.numpy as jnp

    from mstar_jax.compile import ExecutableStore
    from mstar_jax.compile.store import check_directory
    from mstar_jax.memory import format_bytes
    from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf, read_config
    from mstar_jax.models.gemma3.gguf import tensor_shapes
    from mstar_jax.models.gemma3.model import Gemma3, check_tensors
    from mstar_jax.models.gemma3.run import text_engine
    from mstar_jax.models.gemma3.serving import TextRequest
    from mstar_jax.models.gemma3.stream import Gemma3Streams
    from mstar_jax.resources.kv.bounded.config import SinkWindow
    from mstar_jax.serving.stream import Phase
    from mstar_jax.settings import EngineSettings

    if args.dense and args.global_sink is not None:
        raise error(f"--global-sink {args.global_sink} does not go with --dense, which keeps every position")
    if args.greedy_screen and args.dtype != "float32":
        raise error(f"--greedy-screen needs --dtype float32, not {args.dtype}")
    if args.greedy_screen:
        from mstar_jax.models.gemma3 import screen
        from mstar_jax.native import NativeUnavailableError

        try:  # off CPU, or no C++ compiler: refused before the model loads, not by `Gemma3Streams`
            screen.require(None, jnp.float32)
        except (ValueError, NativeUnavailableError) as err:
            raise error(f"--greedy-screen cannot run here: {err}") from None
    texts = list(args.prompt)
    for path in args.prompt_file:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise error(f"--prompt-file {str(path)!r} cannot be read: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise error(
                f"--prompt-file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})"
            ) from None
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
        check_tensors(config, tensor_shapes(reader))  # before any is read
        _, tensors = load_gguf(reader)
        tokenizer = Gemma3Tokenizer.from_gguf(reader)
    except ValueError as err:  # a tensor missing, or not the config's or its table's; not a tokenizer
        raise error(f"{gguf_name}: {err}") from None
    prompts = [tokenizer.encode(text)[: args.max_prompt_tokens] for text in texts]
    model = Gemma3.from_tensors(config, tensors, dtype=jnp.dtype(args.dtype))
    streams = Gemma3Streams(
        config, model, global_retention=retention, max_slots=slots, chunk=args.chunk,
        batch_sizes=BATCH_SIZES, implementation=args.implementation, greedy_screen=args.greedy_screen,
        store=None if args.executable_store is None else ExecutableStore(args.executable_store),
    )  # fmt: skip
    # Every stream may run in one step (the largest bucket holds `slots` rows).
    engine = text_engine(streams, EngineSettings(max_batch=slots, pipelined=True), progress=not args.quiet)
    printer = _Printer(tokenizer.decode, tagged=len(prompts) > 1)
    memory: list[int | None] = []

    def on_output(index: int) -> Callable[[int], None]:
        def deliver(token: int) -> None:
            if not args.quiet:
                printer(index, token)
            if not memory:
                memory.append(resident_bytes())

        return deliver

    stops = () if args.ignore_eos else (tokenizer.eos_id,)
    start = time.perf_counter()
    requests = [
        TextRequest(f"p{i}", ids, args.max_new_tokens, stop_tokens=stops) for i, ids in enumerate(prompts)
    ]
    served: list[TextStream] = [engine.submit(r, on_output=on_output(i)) for i, r in enumerate(requests)]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    if not args.quiet:
        printer.finish()
    memory.append(resident_bytes())

    prompt_length = {s.request_id: len(s.request.prompt) for s in served}
    prompt_seconds = decode_seconds = 0.0
    for record, share in zip(engine.records, charged_seconds(engine.records), strict=True):
        rows = zip(record.request_ids, record.positions, strict=True)
        if any(position < prompt_length.get(rid, 0) for rid, position in rows):
            prompt_seconds += share
        else:
            decode_seconds += share
    prompt_tokens = sum(s.prefilled for s in served)
    new_tokens = sum(len(s.tokens) for s in served)
    decoded = sum(max(len(s.tokens) - 1, 0) for s in served)
    longest = max(len(s.request.prompt) + len(s.tokens) for s in served)
    captured = engine.programs.steps.values()
    rss = " -> ".join(format_bytes(m) for m in memory) if None not in memory else "unknown"
    print(
        f"\n\n{len(prompts)} stream(s), {slots} at once; global cache {retention}; longest stream "
        f"{longest:,} tokens (context {config.context_length:,})\n"
        f"generated {new_tokens:,} tokens in {seconds:.1f} s: prompts read at "
        f"{prompt_tokens / max(prompt_seconds, 1e-9):,.1f} tokens/s ({prompt_tokens:,}), tokens decoded at "
        f"{decoded / max(decode_seconds, 1e-9):.1f}/s ({decoded:,}, all streams)\n"
        f"memory per stream: {format_bytes(streams.bytes_per_stream)} of cache, fixed whatever the length; "
        f"process resident memory at the first token -> at the end: {rss}\n"
        f"captured {sum(len(step) for step in captured)} programs ahead of time in "
        f"{sum(step.report.wall_secs for step in captured):.1f} s "
        f"({sum(step.report.loaded for step in captured)} loaded from the executable store); "
        f"{engine.compilations} compiled while serving; "
        f"{sum(s.hold_until > 0 for s in served)} admissions waited for a slot"
    )  # fmt: skip
    failed = [s for s in served if s.phase is not Phase.DONE]
    for stream in failed:
        print(
            f"mstar-jax generate: stream {stream.request_id} {stream.phase.value}: {stream.error}",
            file=sys.stderr,
        )
    return 1 if failed else 0
