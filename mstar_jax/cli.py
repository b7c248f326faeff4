"""The `mstar-jax` command line.

Each subcommand is an entry of `SUBCOMMANDS`: its help line, a function that adds its arguments to
its parser, and a function that runs it and returns the exit status. A refused deployment exits
with status 2 and the loader's message, never a traceback.

    mstar-jax check [CONFIG]    validate a deployment and print what its resources cost
    mstar-jax run [--config CONFIG] [--output DIR]
                                serve the deployment's synthetic workload and report on it
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from mstar_jax.deployment import DEFAULT_CONFIG, Deployment, DeploymentError, ResourceCosts, load_deployment
from mstar_jax.resources.kv.bounded.config import SinkWindow

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "format_bytes", "format_check", "main"]

EXIT_BAD_CONFIG = 2
"""Exit status for a deployment the loader refuses (argparse uses 2 for bad arguments too)."""


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


def _add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help=f"deployment YAML file (default: the embedded {DEFAULT_CONFIG.name})",
    )


def _check(args: argparse.Namespace) -> int:
    deployment = load_deployment(DEFAULT_CONFIG if args.config is None else args.config)
    print(format_check(deployment))
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


def _run(args: argparse.Namespace) -> int:
    from mstar_jax.engine.run import run_deployment  # imports JAX and the model only when serving

    deployment = load_deployment(DEFAULT_CONFIG if args.config is None else args.config)
    report = run_deployment(deployment, output=args.output, progress=not args.no_progress)
    return 0 if report["streams"]["done"] == report["streams"]["submitted"] else 1


SUBCOMMANDS: dict[str, Subcommand] = {
    "check": Subcommand(
        help="validate a deployment and print its resources and what they cost",
        add_arguments=_add_config_argument,
        run=_check,
    ),
    "run": Subcommand(
        help="serve the deployment's synthetic workload of concurrent streams and report on it",
        add_arguments=_add_run_arguments,
        run=_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The `mstar-jax` parser, one subparser per entry of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="mstar-jax", description="The resource layer of a streaming inference engine, in JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=subcommand.help, description=subcommand.help)
        subcommand.add_arguments(sub)
        sub.set_defaults(run=subcommand.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mstar-jax` on `argv` (default: `sys.argv[1:]`); return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except DeploymentError as err:
        print(f"mstar-jax {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG


# -- the check report -------------------------------------------------------------------------------

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """`n` bytes in binary units with one decimal, e.g. `1.5 MiB`; below 1 KiB, exact (`512 B`)."""
    if n < 1024:
        return f"{n} B"
    unit = 0
    value = float(n)
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_BYTE_UNITS[unit]}"


def _bytes_cell(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)" if n >= 1024 else format_bytes(n)


def _retention(policy: SinkWindow) -> str:
    return f"sink {policy.sink:,} + window {policy.window:,}"


_RESOURCE_ROWS: tuple[tuple[str, Callable[[ResourceCosts], str]], ...] = (
    ("nodes", lambda c: ", ".join(c.nodes)),
    ("layers", lambda c: f"{c.layers:,}"),
    ("kv heads x head dim", lambda c: f"{c.kv_heads} x {c.head_dim}"),
    ("rows per request", lambda c: f"{c.rows_per_request}"),
    ("dtype", lambda c: c.dtype),
    ("source length", lambda c: f"{c.min_source_len:,}..{c.max_source_len:,}"),
    ("retention at min source", lambda c: _retention(c.retention_at_min)),
    ("retention at max source", lambda c: _retention(c.retention_at_max)),
    ("sink capacity", lambda c: f"{c.sink_capacity:,}"),
    ("window capacity", lambda c: f"{c.window_capacity:,}"),
    ("slot tokens", lambda c: f"{c.slot_tokens:,}"),
    ("max retained", lambda c: f"{c.max_retained:,}"),
    ("max slots", lambda c: f"{c.max_slots:,}"),
    ("bytes per slot", lambda c: _bytes_cell(c.slot_bytes)),
    ("bytes for all slots", lambda c: _bytes_cell(c.all_slots_bytes)),
    ("bytes per source (voice)", lambda c: _bytes_cell(c.source_bytes)),
)


def format_check(deployment: Deployment) -> str:
    """The report `mstar-jax check` prints: the deployment's settings, a table of its resources (one
    column each) and the totals."""
    costs = deployment.costs()
    engine, workload = deployment.engine, deployment.workload
    arrivals = (
        "all at once" if workload.arrival_rate_hz is None else f"Poisson {workload.arrival_rate_hz:g} Hz"
    )
    offload = (
        "never" if engine.offload_idle_after_s is None else f"after {engine.offload_idle_after_s:g} s idle"
    )
    cache = deployment.compile.persistent_cache_dir or "off"
    buckets = f"batch sizes {list(deployment.batch_sizes)}, token counts {list(deployment.token_counts)}"
    lines = [
        f"deployment  {deployment.source}",
        f"model       {deployment.model} ({type(deployment.model_config).__name__})",
        f"compile     {buckets}, persistent cache {cache}",
        f"engine      max batch {engine.max_batch}, hold backoff {engine.hold_backoff_s:g} s, "
        f"offload {offload}",
        f"workload    {workload.streams} streams, {arrivals}, {workload.voices} voices, "
        f"text tokens {workload.min_text_tokens}..{workload.max_text_tokens}, "
        f"frames {workload.min_frames}..{workload.max_frames}",
        "",
    ]
    table = [("resource", *(c.key for c in costs))]
    table += [(label, *(cell(c) for c in costs)) for label, cell in _RESOURCE_ROWS]
    lines += _aligned(table)
    total_slot = sum(c.slot_bytes for c in costs)
    total_all = sum(c.all_slots_bytes for c in costs)
    total_sources = sum(c.source_bytes for c in costs)
    lines += [
        "",
        *_aligned(
            [
                ("total bytes per request (a slot in each)", _bytes_cell(total_slot)),
                ("total bytes for all slots", _bytes_cell(total_all)),
                (
                    f"total bytes for {workload.voices} voices (source bank)",
                    _bytes_cell(total_sources * workload.voices),
                ),
            ]
        ),
    ]
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


if __name__ == "__main__":
    sys.exit(main())
