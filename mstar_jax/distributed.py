"""Many hosts: `jax.distributed.initialize` wiring, and which data shards each process serves.

A multi-process deployment runs one Python process per host (or per group of devices), all in the same
SPMD program over one global `(data, model)` mesh (docs/design.md §10). Every process calls
`initialize` before anything touches a device; process 0 also runs the coordinator service the others
connect to. A request's slots live in one data shard, and a process can only write the slots its own
devices hold, so each process admits requests into its `local_data_shards(mesh)` only: every data
shard's devices (its `model` devices) must then belong to one process.

Settings come from explicit arguments or from the environment (`DistributedSettings.from_env`):

    MSTAR_COORDINATOR_ADDRESS   host:port of process 0's coordinator service (all processes agree)
    MSTAR_NUM_PROCESSES         how many processes take part, >= 1
    MSTAR_PROCESS_ID            this process, in [0, MSTAR_NUM_PROCESSES)
    MSTAR_LOCAL_DEVICE_IDS      optional: comma-separated ids of the devices this process uses

JAX's own `JAX_COORDINATOR_BIND_ADDRESS` (where process 0 listens; default every interface on the
address's port) and `JAX_PARTITION_INDEX` still apply. Cluster auto-detection (Slurm, Open MPI, TPU
metadata) is off: the settings are the whole truth.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mstar_jax.checks import check_int
from mstar_jax.resources.kv.bounded.host import to_host
from mstar_jax.resources.kv.bounded.sharding import DATA, MODEL

__all__ = [
    "ENV_COORDINATOR_ADDRESS",
    "ENV_LOCAL_DEVICE_IDS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "DistributedSettings",
    "host_local",
    "initialize",
    "local_data_shards",
    "most_of_all",
    "spans_processes",
]

ENV_COORDINATOR_ADDRESS = "MSTAR_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MSTAR_NUM_PROCESSES"
ENV_PROCESS_ID = "MSTAR_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "MSTAR_LOCAL_DEVICE_IDS"
_REQUIRED_ENV = (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DistributedSettings:
    """How this process joins a multi-process JAX job. Validated at construction.

    Attributes:
      coordinator_address: `host:port` of process 0's coordinator service, the same in every process.
      num_processes: how many processes take part, >= 1.
      process_id: this process, in `[0, num_processes)`; process 0 runs the coordinator.
      local_device_ids: the ids of the devices this process uses (any sequence, kept as a tuple of
        distinct ints >= 0); None for all the devices it sees (or JAX's own `JAX_LOCAL_DEVICE_IDS`).
      initialization_timeout_s: how long to wait for every process to connect, in seconds, >= 1.

    Raises:
      TypeError: for a field of the wrong type.
      ValueError: for an address that is not `host:port`, or a count, id or timeout out of range.
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self):
        _check_address(self.coordinator_address)
        check_int("num_processes", self.num_processes, minimum=1, type_error=True)
        check_int("process_id", self.process_id, minimum=0, type_error=True)
        if self.process_id >= self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} must be < num_processes={self.num_processes} "
                f"(process ids are 0, 1, ..., {self.num_processes - 1})"
            )
        if self.local_device_ids is not None:
            object.__setattr__(self, "local_device_ids", _device_ids(self.local_device_ids))
        check_int("initialization_timeout_s", self.initialization_timeout_s, minimum=1, type_error=True)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> DistributedSettings | None:
        """The settings the `MSTAR_*` variables describe (module docstring), or None when none is set.

        Args:
          environ: the variables to read; `os.environ` when None.
          **overrides: fields to set in code rather than from the environment (e.g.
            `initialization_timeout_s`).

        Raises:
          ValueError: when some of the three required variables are set but not all, or a value does not
            parse; naming the variable and its value.
        """
        environ = os.environ if environ is None else environ
        present = [name for name in _REQUIRED_ENV if environ.get(name)]
        if not present and not environ.get(ENV_LOCAL_DEVICE_IDS):
            return None
        missing = [name for name in _REQUIRED_ENV if name not in present]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} must be set too: a multi-process run needs all of "
                f"{', '.join(_REQUIRED_ENV)} (only {', '.join(present) or ENV_LOCAL_DEVICE_IDS} found)"
            )
        ids = environ.get(ENV_LOCAL_DEVICE_IDS)
        fields: dict[str, Any] = {
            "coordinator_address": environ[ENV_COORDINATOR_ADDRESS].strip(),
            "num_processes": _env_int(environ, ENV_NUM_PROCESSES),
            "process_id": _env_int(environ, ENV_PROCESS_ID),
            "local_device_ids": None if not ids else _env_ids(ids),
        }
        try:
            return cls(**{**fields, **overrides})
        except (TypeError, ValueError) as error:
            raise type(error)(f"{error} (settings read from {', '.join(_REQUIRED_ENV)})") from None


_initialized: DistributedSettings | None = None  # what `initialize` joined with, in this process


def initialize(settings: DistributedSettings) -> None:
    """Join the multi-process job `settings` describe: `jax.distributed.initialize`, once per process.

    Call it before any JAX computation or device query (`jax.devices()` included). Process 0 starts the
    coordinator service; every process connects and waits until all `num_processes` have. On CPU,
    cross-process collectives use gloo over TCP (`jax_cpu_collectives_implementation`, set to "gloo"
    unless another implementation was chosen). Calling it again with equal settings does nothing.

    Raises:
      TypeError: if `settings` is not a `DistributedSettings`.
      RuntimeError: when called again with different settings; when `jax.distributed` was initialized
        some other way; when a JAX backend already started (from JAX); when the processes do not all
        connect within `initialization_timeout_s` (from JAX).
    """
    global _initialized
    if not isinstance(settings, DistributedSettings):
        raise TypeError(f"settings must be a DistributedSettings, got {type(settings).__name__}")
    if _initialized is not None:
        if settings != _initialized:
            raise RuntimeError(
                f"this process already joined a distributed job with {_initialized}; it cannot join "
                f"another with {settings} (a process joins once: restart it to change the settings)"
            )
        return
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jax.distributed.initialize was already called outside mstar_jax.distributed.initialize, so "
            "these settings cannot be checked against it; initialize through one of them only"
        )
    if jax.config.jax_cpu_collectives_implementation is None:
        # Without an implementation a CPU program spanning processes has no way to communicate.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        local_device_ids=None if settings.local_device_ids is None else list(settings.local_device_ids),
        cluster_detection_method="deactivate",
        initialization_timeout=settings.initialization_timeout_s,
    )
    _initialized = settings


def local_data_shards(mesh: Any, process_index: int | None = None) -> tuple[int, ...]:
    """The data shards whose devices all belong to this process: the slot pools it may admit into.

    Args:
      mesh: a mesh with axes `data` and `model` (`sharding.make_mesh`); only its `axis_names` and
        `devices` (each with a `process_index`) are read.
      process_index: the process asking; `jax.process_index()` when None.

    Returns:
      The indices `d` on the mesh's `data` axis, increasing, of the shards this process holds whole;
      empty when none of its devices is in the mesh.

    Raises:
      ValueError: for a mesh without exactly the axes `data` and `model`, or one where a data shard's
        devices belong to more than one process (no process could write all of its slots).
    """
    names = tuple(mesh.axis_names)
    if sorted(names) != sorted((DATA, MODEL)):
        raise ValueError(f"mesh axes {names} must be ({DATA!r}, {MODEL!r}); build it with make_mesh")
    devices = np.moveaxis(np.asarray(mesh.devices, dtype=object), names.index(DATA), 0)
    this = jax.process_index() if process_index is None else process_index
    local, split = [], []
    for shard, row in enumerate(devices):
        owners = sorted({device.process_index for device in row.flat})
        if len(owners) > 1:
            split.append(f"data shard {shard} on devices {[d.id for d in row.flat]} spans processes {owners}")
        elif owners == [this]:
            local.append(shard)
    if split:
        raise ValueError(
            f"{'; '.join(split)}: each process admits requests only into the slot pools its own devices "
            f"hold, so a data shard's {devices.shape[1]} model devices must belong to one process. Give "
            "each process whole data shards: a model size that divides every process's device count, "
            "with each process's devices consecutive along model (make_mesh over jax.devices() does that)"
        )
    return tuple(local)


def manager_shards(mesh: Any) -> dict[str, Any]:
    """The shard arguments of a `BoundedKVManager` on `mesh`: its data and model shards and, on a mesh
    of many processes, this process's own data shards (the only ones it admits into)."""
    local = local_data_shards(mesh) if spans_processes(mesh) else None
    return {"data_shards": mesh.shape[DATA], "model_shards": mesh.shape[MODEL], "local_data_shards": local}


def spans_processes(mesh: Any) -> bool:
    """True when some of `mesh`'s devices belong to another process (a multi-process deployment)."""
    this = jax.process_index()
    return any(device.process_index != this for device in np.asarray(mesh.devices, dtype=object).flat)


def most_of_all(value: int) -> int:
    """The largest `value` any process passes: how processes agree, e.g. on the next step's size.

    A collective over every process (gloo on CPU): each must call it, as often and in the same order.
    With one process it is `value`.
    """
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils  # imported here: only a multi-process job needs it

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def host_local(tree: Any) -> Any:
    """`tree`'s arrays in host memory at their global shapes, holding what this process's devices hold.

    Fully addressable arrays (every array of a single-process job) come back whole, as
    `jax.device_get` gives them; elsewhere entries only another process holds are zero. A process
    holds whole data shards (`local_data_shards`), so it gets every row of its own shards and every
    entry of an array replicated over `data`.
    """

    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in arrays):  # the single-process step path
        # `jax.device_get`, without its per-leaf overhead (a fifth of a step's host time at batch 1):
        # every copy starts before the first is awaited.
        for x in arrays:
            x.copy_to_host_async()
        # `__array__`, as `device_get` reads each: `np.asarray` would view the device buffer through the
        # buffer protocol, and every host copy would keep its device array alive.
        return treedef.unflatten([x.__array__() if isinstance(x, jax.Array) else x for x in leaves])
    return jax.tree.map(to_host, tree)


def _check_address(address: Any) -> None:
    if not isinstance(address, str):
        raise TypeError(
            f"coordinator_address={address!r} must be a str 'host:port', not {type(address).__name__}"
        )
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"coordinator_address={address!r} must be 'host:port' with a port in [1, 65535] "
            "(e.g. '10.0.0.1:1234', the address of process 0, the same in every process)"
        )


def _device_ids(ids: Any) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"local_device_ids={ids!r} must be a sequence of ints >= 0 or None")
    for i, value in enumerate(ids):
        check_int(f"local_device_ids[{i}]", value, minimum=0, type_error=True)
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"local_device_ids={list(ids)} must be non-empty and distinct (or None for all)")
    return tuple(ids)


def _env_int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name].strip()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def _env_ids(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"{ENV_LOCAL_DEVICE_IDS}={value!r} must be comma-separated integers, e.g. '0,1,2,3'"
        ) from None
