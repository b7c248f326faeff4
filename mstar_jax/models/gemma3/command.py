"""`mstar-jax generate`'s arguments: the real Gemma 3 270M streaming text on the bounded caches.

The arguments are added here with nothing heavier than argparse imported, so `mstar-jax -h` works
without the `gemma` extra. The command runs through the engine, so it is served one layer up
(`mstar_jax.models.gemma3.generate.run`: a model never imports the engine).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable

from mstar_jax.registry import ModelCommand

__all__ = ["GENERATE", "add_arguments"]


_MOST = 2**31 - 1  # the programs' token counts and positions are int32


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if not minimum <= value <= _MOST:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} must be an int in [{minimum}, {_MOST}]")
        return value

    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _path(text: str) -> pathlib.Path:
    if not text:  # pathlib reads "" as the working directory: an unset variable, not a choice
        raise argparse.ArgumentTypeError("'' must be a non-empty path")
    return pathlib.Path(text)


def _size(text: str) -> int:
    from mstar_jax.devices import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help="prompts, one stream each (default: one short prompt)")
    parser.add_argument(
        "--prompt-file", action="append", default=[], type=_path, metavar="PATH",
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
    # No "pallas": a Pallas kernel lowers only for its own platform, and "auto" already picks it there.
    parser.add_argument(
        "--implementation", choices=("auto", "xla"), default="auto",
        help="attention: the Pallas kernel on TPU and GPU, else XLA (auto), or XLA everywhere (xla)",
    )  # fmt: skip
    parser.add_argument(
        "--greedy-screen", action="store_true",
        help="CPU, float32: greedy tokens through an int8 screen of the output projection (faster decode; "
        "built with the host's C++ compiler)",
    )  # fmt: skip
    parser.add_argument("--gguf", type=_path, metavar="PATH", help="(default: the gemma extra's)")
    parser.add_argument(
        "--executable-store", type=_path, metavar="DIR",
        help="load the compiled programs from DIR and store those compiled (a second start skips capture)",
    )  # fmt: skip
    parser.add_argument(
        "--device-memory", type=_size, metavar="SIZE",
        help="memory to fit the weights and caches in, e.g. 16GiB (default: the accelerator's bytes_limit, "
        "or the host's RAM on a CPU)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="print only the summary")


def _run(args: argparse.Namespace, error: Callable[[str], Exception]) -> int:
    from mstar_jax.models.gemma3.generate import run  # imports the engine only when serving

    return run(args, error)


GENERATE = ModelCommand(
    name="generate",
    help="stream text from the real Gemma 3 270M, its global layers on a bounded cache",
    add_arguments=add_arguments,
    run=_run,
)
"""`mstar-jax generate`, which Gemma 3's registry entry adds."""
