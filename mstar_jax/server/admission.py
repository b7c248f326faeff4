"""What the server checks of a request against the engine's resources before the engine sees it.

The seed's contract (`ResourceReqConfig`): `validate(spec)` is called at intake so a bad request is a
400 before any device work, and `loop_room(spec)` says how many iterations each loop may still run. A
request here asks for a number of iterations of its model's loop (`frames` of the talker's decode,
`max_tokens` of Gemma's); one over a resource's room is refused. A bounded cache bounds no loop (its
footprint is fixed at admission), so for the caches served today only `validate` can refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_jax.resources.spec import ResourceReqConfig
from mstar_jax.server.errors import BadRequestError, OverloadedError, ServerShuttingDownError

__all__ = ["check_resources", "submit_counted"]


def submit_counted(host: Any, metrics: Any, request: Any) -> Any:
    """`host.submit(request)`'s handle; a refusal (overloaded, or shutting down) is counted among the
    requests by outcome before it is raised (the host never saw the request, so it counts nothing)."""
    try:
        return host.submit(request)
    except OverloadedError:
        metrics.refused("overloaded")
        raise
    except ServerShuttingDownError:
        metrics.refused("shutdown")
        raise


def check_resources(
    managers: list[Any], loops: Mapping[str, tuple[str, int]], req_config: ResourceReqConfig | None = None
) -> None:
    """Refuse a request some resource cannot serve.

    Args:
      managers: the engine's resource managers (each has a `spec`).
      loops: loop name -> (the request field that sets it, the iterations asked).
      req_config: the request's per-resource config (default: the base one, which asks nothing).

    Raises:
      BadRequestError: naming the field, its value and the room the resource has.
    """
    req_config = req_config or ResourceReqConfig()
    for manager in managers:
        spec = manager.spec
        try:
            req_config.validate(spec)
        except ValueError as error:
            raise BadRequestError(f"{spec.resource_key}: {error}") from None
        room = req_config.loop_room(spec)
        for loop, (field, asked) in loops.items():
            if loop in room and asked > room[loop]:
                raise BadRequestError(
                    f"{field}={asked} must be <= {room[loop]}: {spec.resource_key} has room for "
                    f"{room[loop]} more iterations of {loop!r}",
                    param=field,
                )
