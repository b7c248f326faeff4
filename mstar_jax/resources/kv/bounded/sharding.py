"""The bounded KV cache on a device mesh: slot pools on the `data` axis, KV heads on the `model` axis.

Shape legend: that of `cache.py`, with S slots per data shard, plus `data` and `model`, the mesh's
sizes. The global arrays a serving stack holds, and how `sharded_attend` splits them (docs/design.md §10):

    array                    global shape                   spec                    one shard sees
    cache K/V, each layer    [data * (S + 1), R, G', C, D]  (data, -, model, -, -)  [S + 1, R, G'/model, C, D]
    bank K/V, each layer     [V, R, G', L, D]               (-, -, model, -, -)     [V, R, G'/model, L, D]
    plan table               i32[data * B, ROW_INTS]        (data, -)               i32[B, ROW_INTS]
    q, attention output      [data * B * R, T, H, D]        (data, -, model, -)     [B * R, T, H/model, D]
    step k, v (repeated)     [data * B * R, T, G', D]       (data, -, model, -)     [B * R, T, G'/model, D]

**Data axis: independent slot pools.** The slot axis is shard-major: shard `d` owns global slots
`[d * (S + 1), (d + 1) * (S + 1))`, the last of which is its padding slot, so inside `shard_map` each
shard holds an ordinary single-device cache whose padding slot is `S`. A step's rows are shard-major
too: shard `d`'s `B` table rows (padded to the same `B` on every shard) name its LOCAL slots, and its
`B * R` query rows follow them. No row reads another shard's slots, so attention needs no collective.

**Model axis: KV heads,** each with the query heads of its GQA group, so every shard's groups stay
whole. The source bank is split the same way and replicated over data shards. With fewer KV heads than
model shards (`model % G == 0`) the heads are replicated: the store holds `G' = stored_heads(G, model)
= model` heads, head `j` a copy of head `j // (model // G)`, and each shard holds one. **Memory cost:**
the cache and the bank hold `model / G` copies of every KV head, so they take `model / G` times the
bytes of the `G` heads; each device holds one KV head of its data shard's `S + 1` slots (and of every
source). That buys attention with no collective; the query heads and the work still split `model` ways.
Step k/v come with `G` heads; `sharded_attend` repeats them (`repeat_kv_heads`) before the write.

The kernels run unchanged per shard: `sharded_attend` is `attend` under `jax.shard_map` with the
per-shard config (`sharded_config`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.sink_window_attention import sink_window_attention
from mstar_jax.checks import check_int
from mstar_jax.resources.kv.bounded.attention import attend, check_layer, check_step_width, readable_source
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

__all__ = [
    "BANK_SPEC",
    "CACHE_SPEC",
    "DATA",
    "MODEL",
    "ROWS_SPEC",
    "TABLE_SPEC",
    "BoundedKVShardings",
    "abstract_bank",
    "abstract_cache",
    "check_heads",
    "make_mesh",
    "place_on_mesh",
    "repeat_kv_heads",
    "sharded_attend",
    "sharded_config",
    "stored_heads",
]

DATA = "data"  # mesh axis of the independent slot pools
MODEL = "model"  # mesh axis of the KV heads

CACHE_SPEC = P(DATA, None, MODEL, None, None)  # [data * (S + 1), R, G', C, D]
BANK_SPEC = P(None, None, MODEL, None, None)  # [V, R, G', L, D], replicated over data shards
TABLE_SPEC = P(DATA, None)  # i32[data * B, ROW_INTS]
ROWS_SPEC = P(DATA, None, MODEL, None)  # q, out [data * B * R, T, H, D]; step k, v [.., G', D]


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, model)` mesh, data-major, over exactly `devices`, or the first `data * model` of
    `jax.devices()` when none are given.

    Raises:
      ValueError: for sizes that are not ints >= 1; when `devices` are given and there are not exactly
        `data * model` of them, or when they are not and fewer are present.
    """
    for name, size in (("data", data), ("model", model)):
        check_int(name, size, minimum=1)
    needed = data * model
    present = list(jax.devices() if devices is None else devices)
    if len(present) < needed or (devices is not None and len(present) != needed):
        platform = present[0].platform if present else "no"
        hint = (
            f" (on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count={needed} simulates {needed})"
            if platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh data={data} x model={model} needs {needed} devices; {len(present)} {platform} device(s) "
            f"are {'present' if devices is None else 'given'}{hint}"
        )
    return Mesh(np.asarray(present[:needed], dtype=object).reshape(data, model), (DATA, MODEL))


def check_heads(query_heads: int, kv_heads: int, model: int) -> None:
    """Refuse head counts that the `model` axis cannot split into whole GQA groups.

    Raises:
      ValueError: unless `kv_heads % model == 0` (heads sharded) or `model % kv_heads == 0` (replicated),
        `query_heads % model == 0` and `query_heads % kv_heads == 0`.
    """
    _check_kv_heads(kv_heads, model)
    if query_heads % model:
        raise ValueError(f"query_heads={query_heads} must be divisible by model={model}")
    if query_heads % kv_heads:
        raise ValueError(f"query_heads={query_heads} must be divisible by kv_heads={kv_heads} (GQA)")


def _check_kv_heads(kv_heads: int, model: int) -> None:
    if kv_heads % model and model % kv_heads:
        raise ValueError(
            f"kv_heads={kv_heads} cannot be split over model={model} shards: one must divide the other "
            "(kv_heads % model == 0 shards them, model % kv_heads == 0 replicates them)"
        )


def stored_heads(kv_heads: int, model: int) -> int:
    """G': the KV heads the cache and bank store: `kv_heads`, or `model` copies when there are fewer.

    Raises:
      ValueError: if neither of `kv_heads` and `model` divides the other.
    """
    _check_kv_heads(kv_heads, model)
    return max(kv_heads, model)


def repeat_kv_heads(x: Any, model: int, *, axis: int = -2) -> Any:
    """Repeat `x`'s `G` KV heads on `axis` to the `G' = stored_heads(G, model)` the mesh stores.

    Equivalent to `jnp.repeat(x, G' // G, axis=axis)`: stored head `j` is head `j // (G' // G)`. The
    identity when `G % model == 0`. `axis=-2` suits step k/v `[N, T, G, D]`; use `axis=2` for a cache
    `[S + 1, R, G, C, D]` or a bank `[V, R, G, L, D]` (NumPy arrays stay NumPy).
    """
    heads = x.shape[axis]
    copies = stored_heads(heads, model) // heads
    if copies == 1:
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.repeat(x, copies, axis=axis)


def sharded_config(config: BoundedKVConfig, mesh: Mesh | AbstractMesh) -> BoundedKVConfig:
    """The config of one shard: `max_slots` per data shard, `num_heads` stored heads per model shard.

    Args:
      config: the global config: `max_slots` counts every data shard's slots (a multiple of the mesh's
        `data` size), `num_heads` is the model's KV heads G.
      mesh: a mesh with axes `data` and `model` (`make_mesh`).

    Raises:
      ValueError: for slots that do not split evenly over data shards, or KV heads the model axis
        cannot split.
    """
    return _shard_config(config, *_mesh_sizes(mesh))


@functools.cache  # `replace` re-validates the config (a callable retention is tabulated again)
def _shard_config(config: BoundedKVConfig, data: int, model: int) -> BoundedKVConfig:
    if config.max_slots % data:
        raise ValueError(f"max_slots={config.max_slots} must be divisible by the mesh's data={data} shards")
    heads = stored_heads(config.num_heads, model) // model
    return dataclasses.replace(config, max_slots=config.max_slots // data, num_heads=heads)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BoundedKVShardings:
    """Where each array of a sharded step lives, as `NamedSharding`s of one mesh (see the module table).

    Attributes:
      cache: every layer of the global cache (`CACHE_SPEC`).
      bank: every layer of the source bank (`BANK_SPEC`).
      table: the plan table (`TABLE_SPEC`).
      rows: q and the attention output (`ROWS_SPEC`).
      step_kv: step k and v as `sharded_attend` takes them, with G heads: `ROWS_SPEC` when the heads
        are sharded, split on rows only when they are replicated.
    """

    cache: NamedSharding
    bank: NamedSharding
    table: NamedSharding
    rows: NamedSharding
    step_kv: NamedSharding

    @classmethod
    def create(cls, mesh: Mesh, config: BoundedKVConfig) -> BoundedKVShardings:
        """The shardings of `config`'s arrays on `mesh` (checks that the mesh can split them)."""
        sharded_config(config, mesh)
        replicated = config.num_heads < mesh.shape[MODEL]
        return cls(
            cache=NamedSharding(mesh, CACHE_SPEC),
            bank=NamedSharding(mesh, BANK_SPEC),
            table=NamedSharding(mesh, TABLE_SPEC),
            rows=NamedSharding(mesh, ROWS_SPEC),
            step_kv=NamedSharding(mesh, P(DATA) if replicated else ROWS_SPEC),
        )


def abstract_cache(config: BoundedKVConfig, mesh: Mesh) -> BoundedKVCache:
    """The global cache as sharded `jax.ShapeDtypeStruct`s: `[data * (S + 1), R, G', C, D]` per layer."""
    shape = BoundedKVCache.slot_shape(sharded_config(config, mesh))
    return _global_layers(BoundedKVCache, shape, config, NamedSharding(mesh, CACHE_SPEC))


def abstract_bank(config: BoundedKVConfig, mesh: Mesh, num_sources: int) -> SourceBank:
    """The global source bank as sharded `jax.ShapeDtypeStruct`s: `[V, R, G', L, D]` per layer."""
    shape = SourceBank.source_shape(sharded_config(config, mesh), num_sources)
    return _global_layers(SourceBank, shape, config, NamedSharding(mesh, BANK_SPEC))


def _global_layers(cls: type, local: tuple[int, ...], config: BoundedKVConfig, sharding: NamedSharding):
    """A pytree of per-layer arrays whose shard is `local`, scaled up by the mesh axes in the spec."""
    sizes = {None: 1, **sharding.mesh.shape}
    shape = tuple(n * sizes[axis] for n, axis in zip(local, sharding.spec, strict=True))
    layer = jax.ShapeDtypeStruct(shape, config.dtype, sharding=sharding)
    return cls(k=(layer,) * config.num_layers, v=(layer,) * config.num_layers)


def _mesh_sizes(mesh: Mesh | AbstractMesh) -> tuple[int, int]:
    if set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(
            f"mesh axes {mesh.axis_names} must be ({DATA!r}, {MODEL!r}); build it with make_mesh"
        )
    return mesh.shape[DATA], mesh.shape[MODEL]


def sharded_attend(
    mesh: Mesh,
    cache: BoundedKVCache,
    bank: SourceBank,
    plan: BoundedKVPlan,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: BoundedKVConfig,
    scale: float | None = None,
    implementation: str = "auto",
    interpret: Any = False,
    write: bool = True,
) -> tuple[jax.Array, BoundedKVCache]:
    """`attend` on a `(data, model)` mesh: each shard attends and writes its own slots and heads.

    Equivalent to running `attend` with `sharded_config(config, mesh)` on every data shard's slice of
    the rows, cache and plan, for every model shard's heads; the kernels run unchanged inside
    `jax.shard_map` and nothing is communicated.

    Args:
      mesh: axes `data` and `model` (`make_mesh`).
      cache: the global cache, per layer `[data * (S + 1), R, G', C, D]`, shard-major (donate it).
      bank: the global source bank, per layer `[V, R, G', L, D]`.
      plan: the shard-major plan table `i32[data * B, ROW_INTS]`, each shard's rows naming local slots.
      layer: static layer index.
      q: [data * B * R, T, H, D] queries, shard-major then request-major.
      k, v: [data * B * R, T, G, D] the step's keys and values with the model's G KV heads.
      config: the global config (static): `max_slots = data * S`, `num_heads = G`.
      scale, implementation, interpret: as for `attend`.
      write: False attends without storing the step's keys (the cache is returned as it came).

    Returns:
      (out [data * B * R, T, H, D] in q's dtype, the updated global cache).

    Raises:
      TypeError, ValueError: for a `layer` that is not an int in `[0, config.num_layers)` (`check_layer`).
      ValueError: for head counts the mesh cannot split (`check_heads`), slots per shard that
        disagree with the cache, or q's token axis not the plan's `num_tokens` (`check_step_width`).
    """
    local = sharded_config(config, mesh)
    check_layer(layer, config)
    check_step_width(plan, q)
    check_heads(q.shape[-2], config.num_heads, mesh.shape[MODEL])
    if k.shape[-2] != config.num_heads or v.shape[-2] != config.num_heads:
        raise ValueError(
            f"step k/v heads {k.shape[-2]}/{v.shape[-2]} must be the config's num_heads={config.num_heads} "
            "(sharded_attend repeats them to the stored heads itself)"
        )
    if cache.k[layer].shape[0] != mesh.shape[DATA] * (local.max_slots + 1):
        raise ValueError(
            f"cache slot axis {cache.k[layer].shape[0]} must be data={mesh.shape[DATA]} x (slots per shard "
            f"{local.max_slots} + 1 padding slot); build the global cache from the global config"
        )
    k, v = repeat_kv_heads(k, mesh.shape[MODEL]), repeat_kv_heads(v, mesh.shape[MODEL])
    body = functools.partial(
        _attend_shard,
        config=local,
        write=write,
        scale=scale,
        implementation=implementation,
        interpret=interpret,
    )
    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(CACHE_SPEC, CACHE_SPEC, BANK_SPEC, BANK_SPEC, TABLE_SPEC, ROWS_SPEC, ROWS_SPEC, ROWS_SPEC),
        out_specs=(ROWS_SPEC, CACHE_SPEC, CACHE_SPEC) if write else ROWS_SPEC,
        # The Pallas kernels declare their outputs without the varying-manual-axes type that check_vma
        # needs; every shard's work is independent anyway (no collective to check).
        check_vma=False,
    )
    with jax.named_scope(f"sharded_bounded_kv_layer{layer}"):
        result = sharded(cache.k[layer], cache.v[layer], bank.k[layer], bank.v[layer], plan.table, q, k, v)
    if not write:
        return result, cache
    out, new_k, new_v = result
    replace_layer = lambda layers, new: (*layers[:layer], new, *layers[layer + 1 :])  # noqa: E731
    return out, dataclasses.replace(cache, k=replace_layer(cache.k, new_k), v=replace_layer(cache.v, new_v))


def _attend_shard(cache_k, cache_v, bank_k, bank_v, table, q, k, v, *, config, write, **options):
    """One shard's `attend` on one layer: a local cache `[S + 1, ...]` whose padding slot is S."""
    if not write:
        bank_k, bank_v = readable_source(bank_k, config), readable_source(bank_v, config)
        return sink_window_attention(
            q, k, v, cache_k, cache_v, bank_k, bank_v, table, max_retained=config.max_retained,
            query_window=config.query_window, **options,
        )  # fmt: skip
    cache = BoundedKVCache(k=(cache_k,), v=(cache_v,))
    bank = SourceBank(k=(bank_k,), v=(bank_v,))
    out, cache = attend(cache, bank, BoundedKVPlan(table), 0, q, k, v, config=config, **options)
    return out, cache.k[0], cache.v[0]


def place_on_mesh(manager: Any, mesh: Mesh) -> None:
    """Move a `BoundedKVManager(data_shards=data, model_shards=model)`'s cache and bank onto `mesh`.

    Raises:
      ValueError: when the manager's data shards or stored KV heads are not what the mesh needs
        (`BoundedKVManager(data_shards=data, model_shards=model)`).
    """
    data, model = _mesh_sizes(mesh)
    config = manager.config
    if manager.data_shards != data:
        raise ValueError(f"the manager has data_shards={manager.data_shards}; the mesh has data={data}")
    if manager.stored_heads != stored_heads(config.num_heads, model):
        raise ValueError(
            f"the manager stores {manager.stored_heads} KV heads; mesh model={model} needs "
            f"{stored_heads(config.num_heads, model)} (build it with model_shards={model})"
        )
    manager.cache = jax.device_put(manager.cache, NamedSharding(mesh, CACHE_SPEC))
    manager.bank = jax.device_put(manager.bank, NamedSharding(mesh, BANK_SPEC))
