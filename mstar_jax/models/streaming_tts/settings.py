"""`StreamingTTSSettings`: everything a step of the streaming TTS model is compiled for besides its arrays.

The step functions (`model.talker_step`, `model.talker_combined_step`, `model.flow_step`) take the
settings as their static keyword argument `settings`, so a compiled program is a pure function of them
and its arrays: two models with equal settings share programs, and programs captured for one model can
be checked against another (`differences`). The field names are the model's attribute names.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from jax.sharding import Mesh

from mstar_jax.checks import check_number
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

__all__ = ["StreamingTTSSettings"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StreamingTTSSettings:
    """The static settings of the streaming TTS model's steps (frozen, hashable: a jit static argument).

    Attributes:
      config: the model's geometry.
      talker_kv, flow_kv: the two caches' configs.
      implementation, interpret: passed to the attention op (see `sink_window_attention`).
      temperature: sampling temperature of the talker (0: greedy), a float.
      mesh: the `(data, model)` mesh the steps run on (None: one device). Equal meshes have the same
        axes and the same devices in the same places.
    """

    config: StreamingTTSConfig
    talker_kv: BoundedKVConfig
    flow_kv: BoundedKVConfig
    implementation: str = "auto"
    interpret: Any = False
    temperature: float = 1.0
    mesh: Mesh | None = None

    def __post_init__(self):
        if not isinstance(self.config, StreamingTTSConfig):
            raise TypeError(f"config={self.config!r} must be a StreamingTTSConfig")
        for name in ("talker_kv", "flow_kv"):
            if not isinstance(getattr(self, name), BoundedKVConfig):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a BoundedKVConfig")
        if not isinstance(self.implementation, str):
            raise TypeError(f"implementation={self.implementation!r} must be a str (e.g. 'auto', 'xla')")
        try:
            hash(self.interpret)
        except TypeError:
            raise TypeError(
                f"interpret={self.interpret!r} must be hashable (a bool or pltpu.InterpretParams): it is a "
                "static argument of every compiled step"
            ) from None
        # 1 and 1.0 are one setting; a float keeps the executable store's key the same for both.
        object.__setattr__(
            self, "temperature", check_number("temperature", self.temperature, minimum=0, note="0: greedy")
        )
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh={self.mesh!r} must be a jax.sharding.Mesh or None")

    def differences(self, other: StreamingTTSSettings) -> tuple[tuple[str, Any, Any], ...]:
        """The settings that differ from `other`'s, as `(name, self's value, other's value)`.

        A differing config names its differing fields (`config.seed`). Function fields are left out of
        that (a cache config compares its retention by the table it makes, not the callable's identity),
        so a value whose other fields all agree is named whole.
        """
        if not isinstance(other, StreamingTTSSettings):
            raise TypeError(f"other={other!r} must be a StreamingTTSSettings")
        found = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine == theirs:
                continue
            inner = []
            if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
                pairs = (
                    (f.name, getattr(mine, f.name), getattr(theirs, f.name)) for f in dataclasses.fields(mine)
                )
                inner = [
                    (f"{field.name}.{name}", a, b)
                    for name, a, b in pairs
                    if a != b and not (_is_function(a) and _is_function(b))
                ]
            found.extend(inner or [(field.name, mine, theirs)])
        return tuple(found)


def _is_function(value: Any) -> bool:
    return inspect.isfunction(value) or isinstance(value, functools.partial)
