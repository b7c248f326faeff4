"""`mstar-jax serve`: a deployment's engine behind the HTTP and WebSocket front door, on uvicorn.

    mstar-jax serve [--config CONFIG] [--host H] [--port P] [--max-waiting N] [--max-body-bytes N]
                    [--stream-buffer N] [--shutdown-grace-s S] [--voices N] [--model-name NAME] ...

The arguments are added with nothing heavier than argparse imported (`mstar-jax -h` stays fast); `run`
builds the engine (captured and warmed up before the port opens), the app, and serves until `SIGTERM`
or Ctrl-C: then it stops accepting, gives streams in flight `--shutdown-grace-s` to finish, cancels the
rest with a typed, retryable error, and exits 0.

In a multi-process deployment every process runs `mstar-jax serve` with the same deployment (and the
`run` command's multi-process flags) and serves its own port: each admits its own clients into the
slots its devices hold, and a load balancer spreads clients over the hosts (`docs/guides/server.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["add_arguments", "run", "settings_from_args"]

# flag -> ServerSettings field, with its argparse type
_SETTINGS = {
    "max_waiting": int, "retry_after_s": int, "max_body_bytes": int, "stream_buffer": int,
    "shutdown_grace_s": float, "offload_paused_after_s": "optional_float", "max_input_bytes": int,
    "frames_per_byte": float, "max_frames": int, "max_tokens": int, "default_max_tokens": int,
    "segment_bytes": int, "history": int,
}  # fmt: skip


def _optional_float(text: str) -> float | None:
    """A float, or None for `none` (a setting that can be off)."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number or 'none'") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`mstar-jax serve`'s arguments (module doc)."""
    parser.add_argument("--config", default=None, help="deployment YAML file (default: the embedded one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument(
        "--voices", type=int, default=None, metavar="N",
        help="voices registered at start, voice-0 .. voice-N-1 (default: the deployment's workload.voices); "
        "a speech model only",
    )  # fmt: skip
    parser.add_argument(
        "--model-name",
        default=None,
        help="the name clients give as `model` (default: the deployment's model)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument("--no-progress", action="store_true", help="no capture progress bars")
    from mstar_jax.server.settings import ServerSettings  # a leaf: only the checks

    defaults = ServerSettings()
    limits = parser.add_argument_group("limits (ServerSettings)")
    for name, kind in _SETTINGS.items():
        limits.add_argument(
            f"--{name.replace('_', '-')}", type=_optional_float if kind == "optional_float" else kind,
            default=getattr(defaults, name), metavar="N",
            help=f"(default: {getattr(defaults, name)})",
        )  # fmt: skip
    group = parser.add_argument_group("multi-process (a TPU pod: one process per host, each on its own port)")
    group.add_argument(
        "--coordinator-address", metavar="HOST:PORT", help="process 0's address, in every process"
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, in [0, N)")


def settings_from_args(args: argparse.Namespace, error: Callable[[str], Exception]) -> Any:
    """The `ServerSettings` of the flags; `error(message)` (naming the flag) for a value refused."""
    from mstar_jax.checks import INT32_MAX, check_int
    from mstar_jax.server.settings import ServerSettings

    try:
        check_int("--port", args.port, minimum=0, maximum=65535)
        check_int("--voices", args.voices, minimum=1, maximum=INT32_MAX, allow_none=True)
    except ValueError as err:
        raise error(str(err)) from None
    if not isinstance(args.host, str) or not args.host:
        raise error(f"--host={args.host!r} must be a non-empty address")
    if args.model_name is not None and not args.model_name:
        raise error("--model-name='' must be a non-empty name")
    values = {name: getattr(args, name) for name in _SETTINGS}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"--{name.replace('_', '-')}={value!r} must be a finite number")
    try:
        return ServerSettings(**values)
    except ValueError as err:
        message = str(err)
        name = next((n for n in _SETTINGS if message.startswith(f"{n}=")), None)
        raise error(f"--{name.replace('_', '-')}: {message}" if name else message) from None


def run(
    args: argparse.Namespace,
    deployment: Any,
    error: Callable[[str], Exception],
    prepare: Callable[[], None] = lambda: None,
) -> int:
    """Build the engine of `deployment`, serve it on `--host:--port` until a signal; return 0.
    `prepare()` runs once nothing else refuses, before the engine is built (it may write)."""
    settings = settings_from_args(args, error)
    import uvicorn

    from mstar_jax.registry import model_entry
    from mstar_jax.server.app import create_app

    entry = model_entry(deployment.model)
    if entry.serve_check is not None:  # what the model's endpoints cannot serve, before anything is bound
        try:
            entry.function("serve_check")(deployment)
        except ValueError as err:
            raise error(f"{deployment.source}: {err}") from None
    sock = _bind(args.host, args.port, error)  # before the engine is built: a port in use fails fast
    try:
        prepare()
        progress = not args.no_progress
        name = args.model_name or deployment.model
        build = entry.function("build")
        engine, routes = build(deployment, progress=progress, history=settings.history, voices=args.voices)
        app = create_app(engine, settings, model_name=name, routes=routes)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
            ws="websockets-sansio", timeout_graceful_shutdown=settings.shutdown_grace_s + 5.0,
        )  # fmt: skip
        server = _server(config, app.state.host, settings.shutdown_grace_s)
        server.run(sockets=[sock])
        if app.state.host.failure is not None:
            raise error(f"the engine thread failed: {app.state.host.failure!r}")
        return 0
    finally:
        sock.close()


def _bind(host: str, port: int, error: Callable[[str], Exception]) -> socket.socket:
    """A socket bound to `host:port` (uvicorn listens on it), or `error` naming the address."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise error(f"--host={host!r} --port={port}: cannot bind it ({err})") from None
    return sock


def _server(config: Any, host: Any, grace_s: float) -> Any:
    """uvicorn's server, which starts the host's grace period as soon as a signal comes (not once every
    connection has closed, which waits on the very streams the grace period bounds), lets the requests
    in flight end and their deliveries finish (`EngineHost.delivering`) before it closes any connection
    (uvicorn closes a WebSocket at once, with 1012), and exits 0."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            host.begin_shutdown(grace_s)  # sets attributes only: safe in a signal handler
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has shut down, to die of it: we exit 0 instead.
            if sig in (signal.SIGTERM, signal.SIGINT):
                self._captured_signals.clear()

        async def shutdown(self, sockets: list | None = None) -> None:
            for server in self.servers:  # no new connections; those open finish their requests
                server.close()
            deadline = time.monotonic() + grace_s + 1.0  # the host answers every request by grace_s
            while (host.live or host.delivering) and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

    return Server(config)
