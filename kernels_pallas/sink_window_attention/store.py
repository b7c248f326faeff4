"""The public store op: copy each request's written step tokens into its ring slot, in place.

Shape legend: see `kernels_pallas.sink_window_attention.table`. Every implementation computes, for every
request `b`, write range `(step_offset, slot_start, len)` of its table row and `t < len`,

    cache[slot_b, :, :, slot_start + t] = step[b * R : (b + 1) * R, step_offset ± t]   (- when reversed)

and leaves every other cache entry untouched. Implementations:

  "xla"         `store_step_xla`: a `fori_loop` of 3·B read-modify-writes of one block each (always there;
                O(bytes written) per iteration, but the iterations run one after another).
  "pallas_tpu"  `store_tpu.store_step_tpu`: a Mosaic kernel of DMAs into the aliased cache (straight from
                the step for 32-bit rows of at most 128 lanes, else read-merge-write of 8-token tiles, or
                of 128-token lane tiles where TPU keeps a cache's tokens in lanes).
  "pallas_gpu"  `store_gpu.store_step_gpu`: a Triton kernel of masked stores, the cache aliased.
  "auto"        the Pallas kernel of the platform the program is LOWERED for (TPU or CUDA), the XLA loop
                elsewhere and wherever the kernel declines (NotImplementedError): the choice is made with
                `jax.lax.platform_dependent`, so lowering for TPU from a CPU host carries the TPU kernel.

The Pallas kernels are imported on use, so importing this package loads neither lowering stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.dispatch import by_lowering_platform, jitted_kernel

if TYPE_CHECKING:
    from jax.experimental.pallas import tpu as pltpu

__all__ = ["store_step", "store_step_after", "store_step_xla", "validate_store_inputs"]

Implementation = Literal["auto", "xla", "pallas_tpu", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def validate_store_inputs(cache_k, cache_v, k, v, table, *, reverse) -> None:
    """Checks the shapes, dtypes and settings of a `store_step` call.

    Works on arrays, tracers and `jax.ShapeDtypeStruct`s (only `.shape` and `.dtype` are read).

    Raises:
      ValueError: naming the offending argument, what it is and what is expected.
      TypeError: `reverse` is not a bool.
    """
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse={reverse!r} must be a bool (the config's reverse_step_order; it is static)")
    ranks = {"cache_k": 5, "cache_v": 5, "k": 4, "v": 4, "table": 2}
    arrays = {"cache_k": cache_k, "cache_v": cache_v, "k": k, "v": v, "table": table}
    for name, x in arrays.items():
        if len(_shape(x)) != ranks[name]:
            raise ValueError(
                f"{name} has shape {_shape(x)} (rank {len(_shape(x))}); expected rank {ranks[name]}"
            )
    for name in ("cache_k", "cache_v", "k", "v"):
        dtype = arrays[name].dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {dtype}; expected a floating dtype (float32, bfloat16)")
    if _shape(cache_v) != _shape(cache_k) or cache_v.dtype != cache_k.dtype:
        raise ValueError(
            f"cache_v is {cache_v.dtype}{list(_shape(cache_v))}; expected cache_k's "
            f"{cache_k.dtype}{list(_shape(cache_k))} (one layer's keys and values share shape and dtype)"
        )
    _, rows, groups, _, dim = _shape(cache_k)
    n_rows, _, k_groups, k_dim = _shape(k)
    if (k_groups, k_dim) != (groups, dim):
        raise ValueError(
            f"k has shape {_shape(k)}; expected [N, T, G, D] with G = {groups}, D = {dim} "
            f"to match the cache {_shape(cache_k)}"
        )
    if _shape(v) != _shape(k):
        raise ValueError(f"v has shape {_shape(v)}; expected k's shape {_shape(k)}")
    if table.dtype != np.int32:
        raise ValueError(f"table has dtype {table.dtype}; expected int32 (the plan table, i32[B, ROW_INTS])")
    if _shape(table)[1] != tbl.ROW_INTS:
        raise ValueError(
            f"table has shape {_shape(table)}; expected [B, ROW_INTS] with ROW_INTS = {tbl.ROW_INTS}"
        )
    if _shape(table)[0] * rows != n_rows:
        raise ValueError(
            f"table has {_shape(table)[0]} rows and the cache {rows} rows per request, so k should have "
            f"{_shape(table)[0] * rows} rows (B * R, request-major); k has {n_rows}"
        )


def store_step_xla(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    reverse: bool,
    after: Any = None,
) -> tuple[jax.Array, jax.Array, Any]:
    """The XLA store: one read-modify-write per write range, in a `fori_loop` over the 3·B ranges.

    Each write range becomes one read-modify-write of a `min(T, C)`-token block with
    `lax.dynamic_update_slice`. The block start is clamped into the slot and the range placed inside it
    explicitly, because `dynamic_update_slice` would otherwise clamp silently and overwrite the wrong
    entries; ranges never cross the ring's wrap (the plan splits them there). A `vmap`-ed per-row update
    would lower to a scatter plus a full copy of the cache; this costs O(B * min(T, C)) entries per layer,
    in 3·B sequential iterations. (XLA:CPU is the exception for bfloat16 caches: it converts the layer to
    update it, copying it whole per range; keep CPU caches in float32.)

    Args:
      cache_k, cache_v: [S, R, G, C, D] one layer's slots.
      k, v: [N, T, G, D] the step's keys and values, N = B * R; cast to the cache's dtype.
      table: i32[B, ROW_INTS] the plan table.
      reverse: the config's `reverse_step_order` (a range copies step tokens counting down).
      after: values computed from reads of this cache (the attention output), returned unchanged. They
        ride in the loop's carry so every read is sequenced before the in-place store; otherwise XLA
        may order the store first and copy the whole layer to keep the reads' view (measured on CPU).

    Returns:
      The updated (cache_k, cache_v) and `after`.
    """
    table = jnp.asarray(table)  # the loop indexes it with a traced row
    num_requests = table.shape[0]
    _, rows, groups, capacity, dim = cache_k.shape
    steps = k.shape[1]
    block = min(steps, capacity)
    # [B, R, G, T, D]: a request's rows and heads move together into its slot.
    k_req = k.reshape(num_requests, rows, steps, groups, dim).transpose(0, 1, 3, 2, 4).astype(cache_k.dtype)
    v_req = v.reshape(num_requests, rows, steps, groups, dim).transpose(0, 1, 3, 2, 4).astype(cache_v.dtype)
    offsets = jnp.arange(block, dtype=jnp.int32)

    def store_range(i, carry):
        ck, cv, after = carry
        b, w = i // tbl.NUM_WRITES, i % tbl.NUM_WRITES
        row = table[b]
        base = tbl.WRITES + 3 * w
        step_offset, slot_start, length = row[base], row[base + 1], row[base + 2]
        start = jnp.clip(slot_start, 0, capacity - block)
        t = offsets - (slot_start - start)  # index of each block entry within the range
        token = step_offset - t if reverse else step_offset + t
        token = jnp.clip(token, 0, steps - 1)
        inside = ((t >= 0) & (t < length))[None, None, :, None]
        corner = (row[tbl.SLOT], 0, 0, start, 0)
        size = (1, rows, groups, block, dim)
        new_k = jnp.take(lax.dynamic_index_in_dim(k_req, b, keepdims=False), token, axis=2)
        new_v = jnp.take(lax.dynamic_index_in_dim(v_req, b, keepdims=False), token, axis=2)
        old_k = lax.dynamic_slice(ck, corner, size)[0]
        old_v = lax.dynamic_slice(cv, corner, size)[0]
        ck = lax.dynamic_update_slice(ck, jnp.where(inside, new_k, old_k)[None], corner)
        cv = lax.dynamic_update_slice(cv, jnp.where(inside, new_v, old_v)[None], corner)
        # Opaque to XLA, so `after` is not a loop invariant it could hoist out of the carry.
        return ck, cv, lax.optimization_barrier(after)

    return lax.fori_loop(0, num_requests * tbl.NUM_WRITES, store_range, (cache_k, cache_v, after))


# (module, function) of each Pallas implementation, imported on use (see `dispatch.jitted_kernel`).
_KERNELS = {"pallas_tpu": ("store_tpu", "store_step_tpu"), "pallas_gpu": ("store_gpu", "store_step_gpu")}


def _pallas_implementation(name: str):
    return jitted_kernel(*_KERNELS[name], ("reverse", "interpret"))


def store_step_after(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    after: Any,
    *,
    reverse: bool,
    implementation: Implementation = "auto",
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array, Any]:
    """`store_step`, ordered after the reads of the cache that computed `after` (e.g. the attention output).

    The XLA loop threads `after` through its carry (see `store_step_xla`); the Pallas kernels alias the
    cache, so XLA's data dependencies already put them after every read of it, and `after` passes through.

    Returns:
      The updated (cache_k, cache_v) and `after`.
    """
    validate_store_inputs(cache_k, cache_v, k, v, table, reverse=reverse)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected one of {IMPLEMENTATIONS}")
    table = jnp.asarray(table)
    reverse = bool(reverse)

    def xla(ck, cv, k, v, table, after):
        return store_step_xla(ck, cv, k, v, table, reverse=reverse, after=after)

    def pallas(name: str):
        def run(ck, cv, k, v, table, after):
            kernel = _pallas_implementation(name)
            return (*kernel(ck, cv, k, v, table, reverse=reverse, interpret=interpret), after)

        return run

    arrays = (cache_k, cache_v, k, v, table, after)
    if implementation == "xla":
        return xla(*arrays)
    if implementation != "auto":
        return pallas(implementation)(*arrays)
    return by_lowering_platform(*arrays, tpu=pallas("pallas_tpu"), cuda=pallas("pallas_gpu"), default=xla)


def store_step(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    reverse: bool,
    implementation: Implementation = "auto",
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Stores each request's written step tokens into its slot; in place when the cache is donated.

    Equivalent to (a loop over requests `b`, write ranges `w` of row `b`, and `t < len`):

        cache[slot_b, :, :, slot_start + t] = step[b * R : (b + 1) * R, step_offset ± t]

    with `-` when `reverse`. Write ranges never cross the ring's wrap (the planner splits them there);
    padding rows have every range empty and write nothing. Jittable: everything but the arrays is static.

    Args:
      cache_k, cache_v: [S, R, G, C, D] one layer's slots (same shape and dtype).
      k, v: [N, T, G, D] the step's keys and values, N = B * R, request-major; any floating dtype, cast to
        the cache's.
      table: i32[B, ROW_INTS] the plan table (see `table.py`); its write ranges say what goes where.
      reverse: the config's `reverse_step_order` (ranges copy step tokens counting down).
      implementation: "xla", "pallas_tpu", "pallas_gpu", or "auto" (the Pallas kernel of the platform the
        program is lowered for, the XLA loop elsewhere and wherever the kernel declines).
      interpret: passed to the Pallas kernels: True (HLO interpreter) or `pltpu.InterpretParams` (TPU
        interpret mode, TPU kernel only) runs them on CPU. Under "auto" a CPU program still takes the XLA
        loop; ignored by the XLA path.

    Returns:
      The updated (cache_k, cache_v).

    Raises:
      ValueError: bad shapes or dtypes, or an unknown implementation.
      TypeError: `reverse` is not a bool.
      NotImplementedError: an explicitly requested Pallas kernel does not support the case.
    """
    new_k, new_v, _ = store_step_after(
        cache_k,
        cache_v,
        k,
        v,
        table,
        None,
        reverse=reverse,
        implementation=implementation,
        interpret=interpret,
    )
    return new_k, new_v
