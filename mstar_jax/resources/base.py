"""`Resource`: the lifecycle every engine resource implements.

Per request: `ingest_request` -> for each step `admit` -> `plan` -> device work -> `commit` ... ->
`remove_request`. A step that will not run after a successful admit gets `abort_step`. Resources that
can evict idle requests to host memory opt in with `supports_eviction` and implement
`offload` / `reload` / `is_offloaded`. Resources that hand state to another instance (a KV transfer
between a prefill and a decode engine) implement `publish`, and the receiving side `admit_retrieve`.
"""

from __future__ import annotations

import abc
from typing import Any

from mstar_jax.resources.spec import NodeResourceSpec, ResourceReqConfig
from mstar_jax.resources.step import ADMIT_OK, AdmitOutcome, ResourceStep, StepContext

__all__ = ["PublishedInfo", "Resource"]


class PublishedInfo(abc.ABC):
    """Durable state a resource sends outward after a step (`Resource.publish`), for another instance's
    `admit_retrieve`; a later step's info folds into the earlier one with `update`."""

    @abc.abstractmethod
    def update(self, other: PublishedInfo) -> None:
        """Fold `other`, published later for the same request and resource, into this one."""


class Resource(abc.ABC):
    """A resource built once per node from its spec and shared by every request of that node.

    Contract: `admit` is atomic (a refusal leaves no claim behind), `plan` is a pure function of the
    step and the committed state (planning twice gives the same plan), `commit` records only work that
    ran, and `remove_request` returns every claim, also after a failure or a cancellation.
    """

    supports_eviction: bool = False

    @classmethod
    @abc.abstractmethod
    def build(
        cls, spec: NodeResourceSpec, dependencies: dict[str, NodeResourceSpec] | None = None
    ) -> Resource:
        """Construct the resource from its spec (and the specs it `depends_on`)."""

    def depends_on(self) -> set[str]:
        """Keys of resources whose plans this one reads from `ctx.plan_results`."""
        return set()

    # Request lifecycle.
    def ingest_request(self, request_id: str, req_config: ResourceReqConfig | None = None) -> None:
        """Open per-request state. Validate `req_config` here; raise ValueError before any claim."""

    def remove_request(self, request_id: str) -> None:
        """Forget the request and return everything it holds."""

    def reset_request(self, request_id: str, free: bool = False) -> None:
        """Rewind the request to its start (`free=True` also returns its storage)."""
        if free:
            self.remove_request(request_id)

    # Step lifecycle.
    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve what `step` needs, all or nothing."""
        del step, ctx
        return ADMIT_OK

    @abc.abstractmethod
    def plan(self, step: ResourceStep, ctx: StepContext) -> Any:
        """Return the immutable value (a pytree of arrays) the device code consumes for `step`."""

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Record that `step` ran."""

    def abort_step(self, step: ResourceStep, ctx: StepContext) -> None:
        """Undo what `admit` reserved for a step that will not run."""

    # State handed between instances (opt-in).
    def publish(self, request_id: str) -> PublishedInfo | None:
        """What the request's state would tell another instance now (None: nothing to tell)."""
        del request_id
        return None

    def admit_retrieve(
        self, request_id: str, node_name: str, graph_walk: str, published: PublishedInfo | None
    ) -> AdmitOutcome:
        """Take in state another instance `published` for the request and start retrieving it; `ready`
        stays False while it is still on its way."""
        del request_id, node_name, graph_walk, published
        return ADMIT_OK

    # Eviction (opt-in).
    def is_offloaded(self, request_id: str) -> bool:
        del request_id
        return False

    def offload(self, request_id: str) -> int:
        """Move the request's state to host memory; return the capacity reclaimed (0: none)."""
        raise NotImplementedError(f"{type(self).__name__} does not support eviction")

    def reload(self, request_id: str) -> bool:
        """Bring an offloaded request back; False while it does not fit."""
        raise NotImplementedError(f"{type(self).__name__} does not support eviction")

    def cleanup(self) -> None:
        """Release everything the resource holds (the engine is shutting down)."""
