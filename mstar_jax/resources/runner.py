"""`ResourceRunner`: drives one node's resources through a step, in dependency order.

The engine holds one runner per graph node. Per request it fans `ingest_request` / `remove_request`
out to every resource; per step it sweeps the resources the step declares (`SubmoduleStep.steps`) in
dependency order: `admit` (stopping at the first refusal), `plan` (each result stored in
`ctx.plan_results` for the resources that depend on it), `commit`, or `abort_step` when the step will
not run after all. Outside steps, `publish` collects what every publishing resource tells another
instance about some requests, and `admit_retrieve` hands such state to the retrieving resources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_jax.checks import brief
from mstar_jax.resources.base import PublishedInfo, Resource
from mstar_jax.resources.spec import ResourceReqConfig
from mstar_jax.resources.step import FULL_ADMIT_OK, AdmitOutcome, FullAdmitOutcome, SubmoduleStep

__all__ = ["ResourceRunner", "topo_sort"]


def topo_sort(resources: Mapping[str, Resource]) -> tuple[str, ...]:
    """Order resource keys so that every resource comes after the ones it `depends_on`.

    Layered Kahn: each round takes every key whose dependencies are all placed, sorted alphabetically,
    so the order is reproducible whatever the mapping's order.

    Raises:
      ValueError: a dependency on an unknown key, on itself, or a cycle.
    """
    deps: dict[str, set[str]] = {}
    available = sorted(resources)
    for key in available:
        wanted = set(resources[key].depends_on())
        unknown = sorted(wanted - set(resources))
        if unknown:
            raise ValueError(f"resource {key!r} depends on unknown key(s) {unknown}; available: {available}")
        if key in wanted:
            raise ValueError(f"resource {key!r} depends on itself")
        deps[key] = wanted
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(deps):
        ready = sorted(key for key, wanted in deps.items() if key not in placed and wanted <= placed)
        if not ready:
            stuck = sorted(set(deps) - placed)
            raise ValueError(f"dependency cycle among resources {stuck}")
        order.extend(ready)
        placed.update(ready)
    return tuple(order)


class ResourceRunner:
    """One node's resources, swept in dependency order (ties alphabetical).

    Args:
      resources: the node's resources by resource key.

    Raises:
      ValueError: from `topo_sort`, for an unknown, self or cyclic dependency.
    """

    def __init__(self, resources: Mapping[str, Resource]):
        self.resources: dict[str, Resource] = dict(resources)
        self.order: tuple[str, ...] = topo_sort(self.resources)
        self._rank = {key: i for i, key in enumerate(self.order)}
        # Only resources that override the hook take part: the defaults publish nothing and admit all.
        self._publishers = tuple(k for k in self.order if _overrides(self.resources[k], "publish"))
        self._retrievers = tuple(k for k in self.order if _overrides(self.resources[k], "admit_retrieve"))

    def __getitem__(self, key: str) -> Resource:
        return self.resources[key]

    def _keys_for(self, step: SubmoduleStep) -> list[str]:
        """The step's declared keys in dependency order."""
        unknown = sorted(key for key in step.steps if key not in self._rank)
        if unknown:
            raise KeyError(
                f"step declares resource(s) {unknown} that this node does not have; "
                f"available: {list(self.order)}"
            )
        return sorted(step.steps, key=self._rank.__getitem__)

    # Request lifecycle.
    def ingest_request(
        self, request_id: str, overrides: Mapping[str, ResourceReqConfig] | None = None
    ) -> None:
        """Open the request in every resource; each gets `overrides[key]` (None where absent).

        Overrides for resources of other nodes are ignored: a request carries one mapping for all the
        nodes it visits.
        """
        overrides = overrides or {}
        for key in self.order:
            self.resources[key].ingest_request(request_id, overrides.get(key))

    def remove_request(self, request_id: str) -> None:
        """Return every claim the request holds, in every resource (also after a failure)."""
        for key in self.order:
            self.resources[key].remove_request(request_id)

    # Step lifecycle.
    def admit(self, step: SubmoduleStep) -> FullAdmitOutcome:
        """Admit the step resource by resource; stop at the first refusal.

        Atomic across resources: on a refusal, or an exception a resource raises, the resources that
        already admitted the step get `abort_step` (in reverse order), so no claim outlives the refused
        admit.

        Returns:
          `FULL_ADMIT_OK`; or the refusing resource's outcome (its reason object unchanged) with
          `failed_resource` naming it; or `ok=True, ready=False` when some resource is still waiting.
        """
        ctx = step.ctx
        ready = True
        admitted: list[str] = []
        for key in self._keys_for(step):
            try:
                outcome = self.resources[key].admit(step.steps[key], ctx)
            except BaseException:
                self._abort(step, admitted)
                raise
            if not outcome.ok:
                self._abort(step, admitted)
                return FullAdmitOutcome(outcome, failed_resource=key)
            admitted.append(key)
            ready = ready and outcome.ready
        return FULL_ADMIT_OK if ready else FullAdmitOutcome(AdmitOutcome(True, False, None))

    def _abort(self, step: SubmoduleStep, admitted: list[str]) -> None:
        for key in reversed(admitted):
            self.resources[key].abort_step(step.steps[key], step.ctx)

    def plan(self, step: SubmoduleStep) -> dict[str, Any]:
        """Plan each declared resource in order into `ctx.plan_results` (cleared first) and return it.

        A resource sees the plans of the resources it depends on; resources the step does not declare
        are skipped.
        """
        results = step.ctx.plan_results
        results.clear()  # a reused context must not hand a dependent last step's plan
        for key in self._keys_for(step):
            results[key] = self.resources[key].plan(step.steps[key], step.ctx)
        return results

    def commit(self, step: SubmoduleStep) -> None:
        """Commit each declared resource, in order: the step ran."""
        for key in self._keys_for(step):
            self.resources[key].commit(step.steps[key], step.ctx)

    def abort_step(self, step: SubmoduleStep) -> None:
        """Tell every declared resource the admitted step will not run, even if one of them raises.

        Where this differs from the original engine's runner, on purpose: that one only keeps going
        past a resource that raises; this one then re-raises the first such error, so a resource that
        failed to give back a claim is not silent. (The engine, aborting after its step raised, keeps
        the step's own exception and notes this one on it.)

        Raises:
          The first exception a resource raised, once every resource has been told.
        """
        first_error: BaseException | None = None
        for key in self._keys_for(step):
            try:
                self.resources[key].abort_step(step.steps[key], step.ctx)
            except Exception as error:  # every resource must hear about the abort
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    # State handed between instances.
    def publish(self, request_ids: Sequence[str]) -> dict[str, dict[str, PublishedInfo]]:
        """`{request_id: {resource_key: info}}` from every publishing resource, leaving out None (a
        request nothing is published for is absent). Not step-scoped: every publisher is asked."""
        out: dict[str, dict[str, PublishedInfo]] = {}
        for rid in request_ids:
            infos = {key: self.resources[key].publish(rid) for key in self._publishers}
            infos = {key: info for key, info in infos.items() if info is not None}
            if infos:
                out[rid] = infos
        return out

    def admit_retrieve(
        self,
        request_id: str,
        node_name: str,
        graph_walk: str,
        published: Mapping[str, PublishedInfo] | None = None,
    ) -> FullAdmitOutcome:
        """Hand each retrieving resource its part of `published` (by resource key; None where absent)
        for `request_id`; stop at the first refusal.

        The arguments come in the order of `Resource.admit_retrieve`, which each resource receives them in.

        Args:
          request_id: the request retrieving.
          node_name: the graph node this runner serves.
          graph_walk: the walk the request is on.
          published: what another instance published for the request, by resource key (what `publish`
            returns for it); None: nothing was published, every retrieving resource gets None.

        Returns:
          `FULL_ADMIT_OK`; or the refusing resource's outcome with `failed_resource` naming it; or
          `ok=True, ready=False` while some retrieval is still on its way.

        Raises:
          TypeError: `published` is neither None nor a mapping (checked before any resource is asked).
        """
        if published is None:
            published = {}
        elif not isinstance(published, Mapping):
            raise TypeError(
                f"published={brief(published)} must be None or a mapping of resource key to PublishedInfo "
                f"(what publish() returns for one request), got {type(published).__name__}"
            )
        ready = True
        for key in self._retrievers:
            resource = self.resources[key]
            outcome = resource.admit_retrieve(request_id, node_name, graph_walk, published.get(key))
            if not outcome.ok:
                return FullAdmitOutcome(outcome, failed_resource=key)
            ready = ready and outcome.ready
        return FULL_ADMIT_OK if ready else FullAdmitOutcome(AdmitOutcome(True, False, None))

    # Eviction, across the resources that support it.
    def evictable(self, keys: Sequence[str] | None = None) -> list[str]:
        """Keys (of `keys`, default all) whose resources support eviction, in order."""
        chosen = self.order if keys is None else [k for k in self.order if k in set(keys)]
        return [key for key in chosen if self.resources[key].supports_eviction]

    def offload(self, request_id: str, keys: Sequence[str] | None = None) -> int:
        """Offload the request from every evicting resource of `keys`; return the total reclaimed."""
        return sum(self.resources[key].offload(request_id) for key in self.evictable(keys))

    def is_offloaded(self, request_id: str) -> bool:
        """True if any resource holds the request's state on host memory."""
        return any(self.resources[key].is_offloaded(request_id) for key in self.evictable())

    def reload(self, request_id: str) -> bool:
        """Reload the request wherever it is offloaded; False if some resource has no room yet."""
        done = True
        for key in self.evictable():
            if self.resources[key].is_offloaded(request_id):
                done = self.resources[key].reload(request_id) and done
        return done

    def cleanup(self) -> None:
        for key in self.order:
            self.resources[key].cleanup()


def _overrides(resource: Resource, hook: str) -> bool:
    return getattr(type(resource), hook) is not getattr(Resource, hook)
