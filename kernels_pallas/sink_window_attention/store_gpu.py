"""Pallas GPU (Triton lowering) store: a step's written tokens go into their ring slots, the cache aliased.

Equivalent to `store.store_step_xla` (same arguments, no `after`): for every request `b`, write range
`(step_offset, slot_start, len)` of its table row and `t < len`,
`cache[slot_b, :, :, slot_start + t] = step[b * R : (b + 1) * R, step_offset ± t]`. Shape legend:
`table.py`; inside the kernel DP is the head dim padded to a power of two (Triton blocks are powers of
two) and BT the tokens of one program's tile.

The grid is (requests B, write ranges, R * G, token blocks): one program copies up to BT tokens of one
range of one cache row and KV head, a `[BT, DP]` tile: a masked gather of the range's step tokens
(counting down when reversed, so no flip is needed) and a masked pointer store of them at the range's
slot offsets, into the cache passed in and aliased to the output (`input_output_aliases`), so a donated
cache is updated in place. BT keeps a tile within 2048 elements (a value and a 64-bit pointer per element
sit in registers: 16 per thread at 4 warps builds for sm_90 without spills, a 64 x 128 tile spilled), so
a long range spreads over several programs. Masked lanes neither load nor store; an empty range (every
range of a padding row) stores nothing. Every index stays inside its array (loads clamped, stores
masked), so a malformed table cannot address memory past it.

Uses the Triton backend for the reasons `gpu.py` gives (testable in the HLO interpreter, lowers on a host
without a GPU) and its helpers: the Triton module is imported on use (a JAX without it makes this kernel
raise NotImplementedError, so "auto" falls back to XLA) and only its deprecation warning is ignored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.gpu import _ignore_triton_deprecation, _triton
from kernels_pallas.sink_window_attention.gpu_blocks import next_power_of_two

__all__ = ["SUPPORTED_DTYPES", "store_step_gpu"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Elements of one program's tile: at 4 warps, 16 per thread; 64 per thread spilled on sm_90 (ptxas).
_TILE_ELEMENTS = 2048
_NUM_WARPS = 4


def _store_kernel(
    # inputs
    table_ref,  # i32[B, ROW_INTS] the plan table
    k_ref,  # [N, T, G, D] the step's keys
    v_ref,  # [N, T, G, D] the step's values
    cache_k_alias_ref,  # [S, R, G, C, D] aliased to cache_k_ref
    cache_v_alias_ref,  # [S, R, G, C, D] aliased to cache_v_ref
    # outputs
    cache_k_ref,  # [S, R, G, C, D]
    cache_v_ref,  # [S, R, G, C, D]
    *,
    plgpu,
    reverse: bool,
    block_t: int,
    padded_dim: int,
):
    del cache_k_alias_ref, cache_v_alias_ref
    num_slots, rows, groups, capacity, dim = cache_k_ref.shape
    steps = k_ref.shape[1]
    b, w, rg, tb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    r, g = lax.div(rg, groups), lax.rem(rg, groups)
    slot = jnp.clip(table_ref[b, tbl.SLOT], 0, num_slots - 1)
    step_offset = table_ref[b, tbl.WRITES + 3 * w]
    slot_start = table_ref[b, tbl.WRITES + 3 * w + 1]
    length = jnp.clip(table_ref[b, tbl.WRITES + 3 * w + 2], 0, min(steps, capacity))

    t = tb * block_t + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
    d = lax.broadcasted_iota(jnp.int32, (1, padded_dim), 1)
    offset = slot_start + t
    # Store indices are not clamped: every lane keeps its own address, so no two lanes of a store share
    # one (the HLO interpreter stores masked lanes too, writing back what they read). The mask keeps every
    # stored lane inside the slot even for a malformed table. Loads may share addresses: clamp those.
    mask = (t < length) & (offset >= 0) & (offset < capacity) & (d < dim)
    token = jnp.clip(step_offset - t if reverse else step_offset + t, 0, steps - 1)
    n = b * rows + r
    for step_ref, cache_ref in ((k_ref, cache_k_ref), (v_ref, cache_v_ref)):
        values = plgpu.load(step_ref.at[n, token, g, jnp.minimum(d, dim - 1)], mask=mask, other=0)
        plgpu.store(cache_ref.at[slot, r, g, offset, d], values.astype(cache_ref.dtype), mask=mask)


def store_step_gpu(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    reverse: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Stores each request's written step tokens into its slot with masked stores (the Triton kernel).

    Inputs are checked by the public op (`store.store_step`); call that one.

    Args:
      cache_k, cache_v: [S, R, G, C, D] one layer's slots; donate them to update in place.
      k, v: [N, T, G, D] the step's keys and values, N = B * R; cast to the cache's dtype.
      table: i32[B, ROW_INTS] the plan table.
      reverse: the config's `reverse_step_order`.
      interpret: False on a GPU; True runs the kernel in the HLO interpreter on any backend.

    Returns:
      The updated (cache_k, cache_v).

    Raises:
      NotImplementedError: a cache dtype other than float32, bfloat16 and float16; TPU interpret params; a
        JAX without the Pallas Triton backend.
    """
    if not isinstance(interpret, bool):
        raise NotImplementedError(
            f"interpret={interpret!r}: the Triton kernel runs only in the HLO interpreter (interpret=True), "
            "not in TPU interpret mode"
        )
    dtype = jnp.dtype(cache_k.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"cache_k has dtype {dtype}; the Triton store supports {[str(t) for t in SUPPORTED_DTYPES]}"
        )
    plgpu = _triton()
    _, rows, groups, capacity, dim = cache_k.shape
    num_requests, steps = table.shape[0], k.shape[1]
    if min(num_requests, steps, capacity) == 0 or rows * groups * dim == 0:
        return cache_k, cache_v  # nothing can be written
    limit = min(steps, capacity)
    padded_dim = next_power_of_two(dim)
    # A program's tile stays within _TILE_ELEMENTS (a pointer and a value per element live in registers);
    # longer ranges take more programs along the grid's last axis.
    block_t = min(next_power_of_two(limit), max(1, _TILE_ELEMENTS // padded_dim))
    written_bytes = 2 * num_requests * rows * groups * limit * dim * dtype.itemsize  # at most, K and V
    kernel = functools.partial(
        _store_kernel,
        plgpu=plgpu,
        reverse=reverse,
        block_t=block_t,
        padded_dim=padded_dim,
    )
    whole = pl.no_block_spec
    _ignore_triton_deprecation()
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(cache_k.shape, dtype), jax.ShapeDtypeStruct(cache_v.shape, dtype)),
        grid=(num_requests, tbl.NUM_WRITES, rows * groups, pl.cdiv(limit, block_t)),
        in_specs=[whole] * 5,
        out_specs=(whole, whole),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * written_bytes),
        interpret=interpret,
        name="store_step_gpu",
    )(jnp.asarray(table), k, v, cache_k, cache_v)
