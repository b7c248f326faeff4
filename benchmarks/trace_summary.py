"""Where a profiled run's time went: a Perfetto trace from `jax.profiler` as a few tables.

`benchmarks/gemma_decode.py --trace DIR` and `benchmarks/engine.py --trace DIR` write one; the device
session (`benchmarks/device_session.sh`) summarises both, since the trace files are too large to bring
back from a lent machine. For each device lane (a `/device:` process: a GPU or TPU), its span from the
first op's start to the last op's end, the time some op ran (busy) and their ratio; the ops that took
the most device time; and the host's events with the most time, inclusive of what they call (nested
events are each counted, so their totals do not add up to the wall time), then with the most self time
(outside the events nested in them, on their thread: where the host's time went).

On a CPU, XLA's programs run as thunks on the host's own threads, so there is no device lane; each
thunk event names its program (`hlo_module`) and the execution it belongs to (`run_id`). For each
program (a module and its thunks a run, so captured buckets of one function stay apart), its runs'
medians of: the span from the first thunk's start to the last one's end; the time an XLA dot ran; the
time a YNNPACK fusion (XLA:CPU's library products and the ops fused with them) ran and no dot did; the
time any other thunk ran and no product did; and the time no thunk ran on any thread (`idle`: the
executor handing work between its threads, or waiting). In each run the four add up to its span
(their medians need not).

Run: python -m benchmarks.trace_summary DIR_OR_FILE [DIR_OR_FILE ...] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import pathlib
import statistics
from collections.abc import Callable, Iterable, Sequence

TRACE_NAME = "perfetto_trace.json.gz"


@dataclasses.dataclass(frozen=True)
class Op:
    """One kind of event: every event of that name in a lane group, in µs."""

    name: str
    count: int
    total_us: float
    median_us: float


@dataclasses.dataclass(frozen=True)
class Lane:
    """A device lane: span and busy time in µs, and its ops, the most time first."""

    name: str
    span_us: float
    busy_us: float
    ops: tuple[Op, ...]


def add_trace_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """A benchmark's `--trace DIR`: after its timed runs, `what` once more under the profiler."""
    parser.add_argument(
        "--trace", type=_trace_folder, default=None, metavar="DIR",
        help=f"then {what} under jax.profiler, untimed: a Perfetto trace in DIR (made if missing)",
    )  # fmt: skip


def _trace_folder(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; --trace takes a folder (made if missing)")
    return path


def write_trace(folder: pathlib.Path, run: Callable[[], object]) -> None:
    """Runs `run()` under `jax.profiler.trace`, with a Perfetto trace (what `main` reads) in `folder`."""
    import jax

    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        run()
    print(f"\nPerfetto trace in {folder} (python -m benchmarks.trace_summary {folder})")


def find_trace(path: pathlib.Path) -> pathlib.Path:
    """`path` if it is a trace file, else the newest `perfetto_trace.json.gz` below the folder.

    Raises:
      FileNotFoundError: the path does not exist or holds no trace.
    """
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    traces = sorted(path.rglob(TRACE_NAME), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"{path}: no {TRACE_NAME} below it (write one with --trace)")
    return traces[-1]


def load_events(path: pathlib.Path) -> list[dict]:
    """The trace's events: a Chrome-trace JSON list, or an object holding `traceEvents`."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of `[start, end)` intervals (ops on several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _ops(events: Sequence[dict]) -> tuple[Op, ...]:
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(float(e.get("dur", 0.0)))
    ops = [
        Op(name, len(durations), sum(durations), statistics.median(durations))
        for name, durations in by_name.items()
    ]
    return tuple(sorted(ops, key=lambda op: -op.total_us))


def self_times(events: Sequence[dict]) -> list[dict]:
    """`events` (complete ones) with each `dur` less the time of the events nested directly in it on its
    thread (`pid`, `tid`): what it spent itself. An event nests in the latest one open at its start that
    it ends within."""
    out = []
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("pid"), e.get("tid")].append(e)
    for thread in by_thread.values():
        stack: list[list] = []  # [event, end, time of its direct children]
        for e in sorted(thread, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and not (start < stack[-1][1] and start + dur <= stack[-1][1]):
                out.append(_closed(stack.pop()))
            if stack:
                stack[-1][2] += dur
            stack.append([e, start + dur, 0.0])
        out.extend(_closed(entry) for entry in reversed(stack))
    return out


def _closed(entry: list) -> dict:
    event, _, children = entry
    return {**event, "dur": max(0.0, float(event.get("dur", 0.0)) - children)}


@dataclasses.dataclass(frozen=True)
class HostProgram:
    """An XLA:CPU program's runs: per run in µs, the median over its runs (see the module docstring)."""

    module: str
    thunks: int
    runs: int
    span_us: float
    dots_us: float
    ynn_us: float
    other_us: float
    idle_us: float


def host_programs(events: Sequence[dict]) -> tuple[HostProgram, ...]:
    """The XLA:CPU programs of the trace's thunk events (complete events whose `args` name an `hlo_op`,
    an `hlo_module` and a `run_id`), the most time in all (span × runs) first."""
    runs: dict[tuple, list[tuple[str, float, float]]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and {"hlo_op", "hlo_module", "run_id"} <= args.keys():
            start = float(e["ts"])
            runs[args["hlo_module"], args["run_id"]].append(
                (e["name"], start, start + float(e.get("dur", 0.0)))
            )
    parts: dict[tuple[str, int], list[tuple[float, ...]]] = collections.defaultdict(list)
    for (module, _), thunks in runs.items():
        spans = [(start, end) for _, start, end in thunks]
        dots = [(start, end) for name, start, end in thunks if name.startswith("dot")]
        products = dots + [(start, end) for name, start, end in thunks if name.startswith("ynn")]
        span = max(end for _, end in spans) - min(start for start, _ in spans)
        busy, dot, product = busy_time(spans), busy_time(dots), busy_time(products)
        parts[module, len(thunks)].append((span, dot, product - dot, busy - product, span - busy))
    programs = [
        HostProgram(
            module,
            thunks,
            len(samples),
            *(statistics.median(column) for column in zip(*samples, strict=True)),
        )
        for (module, thunks), samples in parts.items()
    ]
    return tuple(sorted(programs, key=lambda p: -p.span_us * p.runs))


def program_table(programs: Sequence[HostProgram]) -> list[str]:
    """The XLA:CPU programs as lines: ms a run, medians over its runs."""
    if not programs:
        return []
    columns = ("span", "dots", "YNNPACK", "other", "idle")
    head = f"  {'runs':>5} {'thunks':>7} " + " ".join(f"{c:>8}" for c in columns) + "  program"
    lines = ["XLA:CPU programs on the host's threads, ms a run (medians over its runs):", head]
    for p in programs:
        cells = (p.span_us, p.dots_us, p.ynn_us, p.other_us, p.idle_us)
        lines.append(
            f"  {p.runs:5d} {p.thunks:7d} " + " ".join(f"{c / 1e3:8.2f}" for c in cells) + f"  {p.module}"
        )
    return lines


def summarise(events: Sequence[dict]) -> tuple[tuple[Lane, ...], tuple[Op, ...], tuple[Op, ...]]:
    """(device lanes, the host's events by inclusive time, the host's events by self time) of complete
    (`"ph": "X"`) events."""
    process = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    complete = [e for e in events if e.get("ph") == "X"]
    lanes, host = [], []
    for pid in sorted({e["pid"] for e in complete}, key=lambda p: str(process.get(p, p))):
        mine = [e for e in complete if e["pid"] == pid]
        name = str(process.get(pid, pid))
        if not name.startswith("/device:"):
            host.extend(mine)
            continue
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in mine]
        span = max(end for _, end in intervals) - min(start for start, _ in intervals)
        lanes.append(Lane(name, span, busy_time(intervals), _ops(mine)))
    return tuple(lanes), _ops(host), _ops(self_times(host))


def report(lanes: Sequence[Lane], host: Sequence[Op], host_self: Sequence[Op] = (), *, top: int) -> list[str]:
    """The summary's lines."""
    lines = []
    for lane in lanes:
        share = lane.busy_us / lane.span_us if lane.span_us else 0.0
        lines.append(
            f"{lane.name}: busy {lane.busy_us / 1e3:.1f} of {lane.span_us / 1e3:.1f} ms "
            f"(busy ÷ span {share:.2f}), {sum(op.count for op in lane.ops)} ops"
        )
        lines.append(f"  {'ms':>9} {'share':>6} {'count':>7} {'median µs':>10}  op")
        for op in lane.ops[:top]:
            lines.append(
                f"  {op.total_us / 1e3:9.2f} {op.total_us / lane.busy_us if lane.busy_us else 0:6.2f} "
                f"{op.count:7d} {op.median_us:10.1f}  {op.name[:90]}"
            )
    if not lanes:
        lines.append("no device lane (on a CPU, XLA's work runs on the host's threads, below)")
    lines += _host_table("host, inclusive times (nested events each counted)", host, top)
    if host_self:
        lines += _host_table("host, self times (outside their nested events)", host_self, top)
    return lines


def _host_table(title: str, ops: Sequence[Op], top: int) -> list[str]:
    lines = [f"{title}, top {top}:", f"  {'ms':>9} {'count':>7} {'median µs':>10}  event"]
    return lines + [
        f"  {op.total_us / 1e3:9.2f} {op.count:7d} {op.median_us:10.1f}  {op.name[:90]}" for op in ops[:top]
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", type=pathlib.Path, nargs="+", help="trace files, or folders --trace wrote")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top} must be >= 1")
    try:
        paths = [find_trace(path) for path in args.traces]
    except FileNotFoundError as e:
        parser.error(str(e))
    shares = []
    for given, path in zip(args.traces, paths, strict=True):
        events = load_events(path)
        lanes, host, host_self = summarise(events)
        print(f"benchmarks/trace_summary.py: {path}")
        lines = report(lanes, host, host_self, top=args.top) + program_table(host_programs(events))
        print("\n".join(lines) + "\n")
        busy = ", ".join(f"{lane.busy_us / lane.span_us:.2f}" for lane in lanes if lane.span_us)
        shares.append(f"{given.name} {busy or 'no device lane'}")
    print(f"device busy ÷ span: {'; '.join(shares)}")


if __name__ == "__main__":
    main()
