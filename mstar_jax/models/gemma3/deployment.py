"""A Gemma 3 deployment's `model.config`: which GGUF file, what the global layers keep, how prompts are read.

A deployment names the model `gemma3` (`mstar_jax.models.MODELS`); its config points at a GGUF file and
declares the two bounded caches (`resource_specs`) from that file's geometry: the `gemma` extra's file's
is declared (`GEMMA3_270M`), so checking a deployment of it needs no extra. Nothing heavier than the
standard library is imported until the specs are asked for: a deployment of another model never needs
the `gemma` extra.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import TYPE_CHECKING, Any, ClassVar

from mstar_jax.checks import INT32_MAX, check_bool, check_choice, check_int

if TYPE_CHECKING:
    from mstar_jax.deployment import Deployment
    from mstar_jax.devices import DeviceMemory
    from mstar_jax.memory import MemoryBudget
    from mstar_jax.models.gemma3.gguf import Gemma3Config
    from mstar_jax.resources.kv.bounded.config import BoundedKVSpec, SinkWindow

__all__ = ["DTYPES", "GEMMA3_NODE", "Gemma3DeploymentConfig", "memory_budget"]

GEMMA3_NODE = "gemma3"
"""The graph node both caches belong to."""

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3DeploymentConfig:
    """What a Gemma 3 deployment serves.

    Attributes:
      gguf: the model file; None is the `gemma` extra's Gemma 3 270M Q4_K_M.
      global_sink: positions the global layers keep from a stream's start (attention sinks).
      global_window: the latest positions the global layers keep (the local layers keep Gemma's 512).
      chunk: prompt tokens a prefill step reads per stream.
      max_slots: streams served at once (each holds one slot of both caches).
      dtype: the weights' and caches' dtype.
      greedy_screen: CPU and float32 only: greedy tokens through an int8 screen of the output
        projection (`Gemma3Streams(greedy_screen=True)`; built with the host's C++ compiler).
    """

    gguf: str | None = None
    global_sink: int = 4
    global_window: int = 1020
    chunk: int = 128
    max_slots: int = 4
    dtype: str = "float32"
    greedy_screen: bool = False

    UNREAD_WORKLOAD: ClassVar[tuple[str, ...]] = ("voices", "min_frames", "max_frames")
    """A speech model's workload settings: a deployment of this model refuses them."""
    UNREAD_COMPILE: ClassVar[tuple[str, ...]] = ("token_counts", "min_tokens", "max_tokens")
    """Token buckets: a text model's are its `chunk` and 1, so a deployment of this model refuses them."""

    def __post_init__(self):
        for name, minimum in (("global_sink", 0), ("global_window", 1), ("chunk", 1), ("max_slots", 1)):
            check_int(name, getattr(self, name), minimum=minimum, maximum=INT32_MAX)
        check_choice("dtype", self.dtype, DTYPES)
        if check_bool("greedy_screen", self.greedy_screen) and self.dtype != "float32":
            raise ValueError(f"greedy_screen=true needs dtype float32, not {self.dtype!r}")
        if self.gguf is not None:
            if not isinstance(self.gguf, str) or not self.gguf:
                raise ValueError(f"gguf={self.gguf!r} must be the path of a .gguf file, or null")
            path = pathlib.Path(self.gguf)
            if path.is_dir():
                raise ValueError(f"gguf={self.gguf!r} is a directory; it must be a .gguf file")
            if not path.is_file():
                raise ValueError(f"gguf={self.gguf!r}: no such file")

    @property
    def path(self) -> pathlib.Path:
        """The GGUF file (the packaged one is written to the user's cache once)."""
        if self.gguf is not None:
            return pathlib.Path(self.gguf)
        from mstar_jax.models.gemma3.gguf import default_gguf_path  # the `gemma` extra's model

        return default_gguf_path()

    @property
    def retention(self) -> SinkWindow:
        from mstar_jax.resources.kv.bounded.config import SinkWindow

        return SinkWindow(self.global_sink, self.global_window)

    def geometry(self) -> Gemma3Config:
        """The model's geometry: the extra's model declares it (`GEMMA3_270M`), so a deployment of it checks
        without the extra installed; another file's comes from its metadata, checked against its tensor
        table (no tensor is read).

        Raises:
          GGUFError: (a ValueError) for a file that is not a readable Gemma 3 GGUF file.
          ValueError: for a tensor missing, or of another shape than the geometry's.
        """
        if self.gguf is None:
            from mstar_jax.models.gemma3.gguf import GEMMA3_270M

            return GEMMA3_270M
        path = self.path.resolve()
        stat = path.stat()
        return _geometry(path, (stat.st_ino, stat.st_size, stat.st_mtime_ns))

    @property
    def jnp_dtype(self) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def resource_specs(self) -> tuple[BoundedKVSpec, BoundedKVSpec]:
        """The local and global layers' caches (`Gemma3Streams`' geometry), `max_slots` slots each."""
        from mstar_jax.models.gemma3.stream import GLOBAL_KV, LOCAL_KV, cache_configs
        from mstar_jax.resources.kv.bounded.config import BoundedKVSpec

        local, global_ = cache_configs(
            self.geometry(), global_retention=self.retention, max_slots=self.max_slots, dtype=self.jnp_dtype
        )
        return (
            BoundedKVSpec(LOCAL_KV, {GEMMA3_NODE}, local),
            BoundedKVSpec(GLOBAL_KV, {GEMMA3_NODE}, global_),
        )

    def abstract_params(self) -> Any:
        """The model's parameters as `ShapeDtypeStruct`s (`nnx.eval_shape`: nothing is allocated), for the
        memory budget; with `greedy_screen`, the screen's arrays beside them (as `Gemma3Streams` holds
        them)."""
        from mstar_jax.models.gemma3 import screen
        from mstar_jax.models.gemma3.model import abstract_model

        geometry = self.geometry()
        params = abstract_model(geometry, self.jnp_dtype)[1]
        if self.greedy_screen:
            return params, screen.abstract_arrays(geometry.vocab_size, geometry.d_model)
        return params


def memory_budget(deployment: Deployment, device: DeviceMemory) -> MemoryBudget:
    """What a Gemma 3 `deployment` allocates on one device, counted from its abstract parameters and its
    caches' specs (`mstar_jax.memory.params_budget`)."""
    from mstar_jax.memory import params_budget

    return params_budget(deployment, deployment.model_config.abstract_params(), device)


@functools.lru_cache(maxsize=8)
def _geometry(path: pathlib.Path, version: tuple[int, int, int]) -> Gemma3Config:
    """A file's checked geometry, once per version of the file (its inode, size and modification time):
    a deployment asks for it for its caches' specs and its memory budget, and each read parses the
    metadata and the tensor table."""
    from mstar_jax.models.gemma3.gguf import open_gguf, read_config, tensor_shapes
    from mstar_jax.models.gemma3.model import check_tensors

    reader = open_gguf(path)
    config = read_config(reader)
    check_tensors(config, tensor_shapes(reader))
    return config
