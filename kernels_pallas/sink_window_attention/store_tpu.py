"""Pallas TPU (Mosaic) store: a step's written tokens go into their ring slots by DMA, the cache aliased.

Equivalent to `store.store_step_xla` (same arguments, no `after`): for every request `b`, write range
`(step_offset, slot_start, len)` of its table row and `t < len`,
`cache[slot_b, :, :, slot_start + t] = step[b * R : (b + 1) * R, step_offset ± t]`. Shape legend:
`table.py`.

The caches stay where they are, in HBM (`memory_space=pl.ANY`), aliased input to output, so a donated
cache is updated in place and nothing but the written tokens' tiles moves. Where the libtpu jax loads
accepts it (`tpu_compiler`: 0.0.50 and later), the caches are also pinned to HBM: without the pin, XLA's
memory-space assignment moves a layer small enough for VMEM into VMEM and back around the call.

The wrapper arranges the step's keys and values like a slot, `[B, R, G, T, D]` (a request's rows and
heads lie together), in the cache's dtype and, for a reversed step order, with the token axis flipped
once: every write range is then one contiguous run of tokens on both sides. The grid walks the requests
("arbitrary"): program `b` starts its own write DMAs, then waits for those of request `b - 1`, so
consecutive requests' copies overlap (the last program also waits for its own). Distinct requests own
distinct slots and padding rows write nothing, so no two DMAs in flight touch the same bytes.

A DMA has a static shape but a range a dynamic length: a run of `n` units is copied as the binary
decomposition of `n`, one copy of `p` units at offset `n & ~(2p - 1)` for each power of two `p` with
`n & p`: at most log2(T) + 1 copies per range and K/V, none moving a byte twice or touching one past the
range. TPU lays out the last two dims of a buffer in (8, 128) tiles (two bf16 rows packed per 32-bit
word), and Mosaic slices a tiled dim of one only at multiples of the tile ("Offsets along tiled dimensions
must be aligned to tiles", found by compiling with libtpu), with one exception: the token axis of
`[.., C, D]` at any offset when a token row is 32-bit and at most one lane tile wide. Hence three paths:

  direct (32-bit, D = 128): the unit is one token; each range is copied HBM to HBM straight from the
    arranged step into the slot. The kernel reads and writes exactly the bytes written.
  tiled (bfloat16, or D a larger multiple of 128): the unit is a tile of `TOKEN_TILE` tokens (sublanes);
    each range's tiles are read into VMEM, merged with the step's tokens and written back, see below.
  lanes (D not a multiple of 128, `tpu_blocks.keys_in_lanes`): TPU's default layout of such a cache puts
    the tokens in lanes and D in sublanes, so the kernel works on the free view `[S, R, G, D, C]` (the
    wrapper swaps the last two axes on the way in and out; XLA makes both bitcasts). The unit is a lane
    tile of `LANES` tokens, merged as in the tiled path. Mosaic slices lanes only in whole tiles, so when
    `C % 128 != 0` the slot's last, partial tile `[C0, C)` (C0 = C rounded down to 128; all of the slot
    when C < 128) has its own buffer of exactly that width, read, merged and written whole by one static
    copy for any request whose ranges reach into it.

Merging (tiled and lanes paths). Per range the kernel keeps a window of `W` tokens that starts at a tile
and covers the range's tiles below C0; the request's step `[R, G, T, D]` comes in as a VMEM block and,
one row and head at a time, is padded to TP tokens in float32 (and transposed to `[D, TP]` in VMEM in the
lanes path: arranged so in HBM, a step of few tokens would be padded to 128 lanes there). Window entry `i`
of range `w` takes, wherever range `r` of the request writes slot offset `start_w + i`, the step rotated
along its token axis by `slot_start_r - start_w - first_r` (a dynamic rotate, which Mosaic supports for
32-bit values only: the merge runs in float32, exact for bfloat16). Two ranges of a request may share a
tile (the end of the sink and the start of the ring): every window (and the tail) merges all of the
request's ranges, and the wrapper trims later ranges' tile spans by earlier ones and every span at C0, so
each tile is written back by one copy only. The windows are double-buffered across requests (request `b`
reads and merges while `b - 1`'s are written back), or single where two sets would pass
`tpu_blocks.VMEM_BUDGET` (`b` first waits for `b - 1`'s write-back). Bytes: the step, plus the tiles
touched, read and written (for a decode step, one tile of 8 tokens, or of 128 in the lanes path, per
written token).

Compiled, the cache must be laid out as the kernel views it, or XLA copies the whole layer around any
Mosaic call (this one, and the attention kernel). TPU lays out `[.., C, D]` row-major when `D % 128 == 0`
and `C % 8 == 0`, and as the row-major `[.., D, C]` when `D % 128 != 0` and C pads to whole lane tiles less
than D does (and no more than S, R, G do: `tokens_in_lanes`; e.g. D = 64 with C >= 128, or 64 < C < 128).
Elsewhere the kernel declines (NotImplementedError; "auto" then takes the XLA loop): pad the slot.
Interpreted, any shape runs (tiles of one token where the tiled path gets `C % 8 != 0`).

Runs compiled on TPU, and on any backend in TPU interpret mode (`pltpu.InterpretParams`, race detector
included) and in the HLO interpreter (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention import tpu_compiler
from kernels_pallas.sink_window_attention.store_tpu_kernel import (
    direct_kernel,
    merge_kernel,
    powers_of_two,
)
from kernels_pallas.sink_window_attention.tpu_blocks import (
    LANES,
    VMEM_BUDGET,
    keys_in_lanes,
    tokens_in_lanes,
)

__all__ = ["SUPPORTED_DTYPES", "TOKEN_TILE", "store_step_tpu"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Token rows per HBM tile: the alignment Mosaic requires of a slice of a cache's token axis in sublanes
# (unless each token row is 32-bit and at most one lane tile wide). In lanes it is `LANES`.
TOKEN_TILE = 8
# VMEM the call may use without asking (below every chip's default scoped limit), as in `tpu.py`.
_SCOPED_VMEM_DEFAULT = 12 * 2**20
_MAX_VMEM = 96 * 2**20


def _arranged(x: jax.Array, num_requests: int, dtype, reverse: bool) -> jax.Array:
    """[N, T, G, D] -> [B, R, G, T, D] in `dtype`, the token axis flipped when `reverse`."""
    n_rows, steps, groups, dim = x.shape
    x = x.reshape(num_requests, n_rows // num_requests, steps, groups, dim).transpose(0, 1, 3, 2, 4)
    x = x.astype(dtype)
    return x[:, :, :, ::-1] if reverse else x


def _write_ranges(table: jax.Array, *, steps: int, capacity: int, reverse: bool):
    """Each request's ranges clamped as the kernels clamp them: (first, slot_start, len), each i32[B, 3]."""
    ranges = table[:, tbl.WRITES :].reshape(-1, tbl.NUM_WRITES, 3)
    step_offset, slot_start, length = ranges[..., 0], ranges[..., 1], ranges[..., 2]
    length = jnp.clip(length, 0, min(steps, capacity))
    first = steps - 1 - step_offset if reverse else step_offset
    first = jnp.clip(first, 0, steps - length)
    slot_start = jnp.clip(slot_start, 0, capacity - length)
    return first, slot_start, length


def _tile_plan(
    table: jax.Array, *, steps: int, capacity: int, num_slots: int, tile: int, window: int, reverse: bool
):
    """The merging paths' per-request plan, i32[B, PLAN_INTS].

    Per request: the slot; per range the window's start `a` (a tile multiple, the window `[a, a + W)`
    covering the range's tiles below C0 = C rounded down to the tile), the first token of the tiles to
    write and how many (trimmed so that no tile is written by two windows, and cut at C0); per range its
    first token on the arranged step axis and its clamped (slot_start, len); whether a range reaches the
    partial tile `[C0, C)`.
    """
    first, slot_start, length = _write_ranges(table, steps=steps, capacity=capacity, reverse=reverse)
    whole = capacity // tile * tile  # C0
    # Offsets are >= 0 here, so truncating division is floor division (and cheaper than `//`).
    floor = lax.div(slot_start, tile) * tile
    start = jnp.minimum(floor, max(whole - window, 0))
    span_start = jnp.where(length > 0, floor, 0)
    span_end = jnp.where(length > 0, lax.div(slot_start + length + tile - 1, tile) * tile, 0)
    # Ranges are disjoint and contiguous, so two ranges' tile spans can only share their end tiles: cut
    # each span where an earlier one already writes.
    starts, ends = [span_start[:, 0]], [span_end[:, 0]]
    for w in range(1, tbl.NUM_WRITES):
        lo, hi = span_start[:, w], span_end[:, w]
        for e_lo, e_hi in zip(starts, ends, strict=True):
            live = e_hi > e_lo
            lo = jnp.where(live & (e_lo <= lo) & (lo < e_hi), e_hi, lo)
            hi = jnp.where(live & (e_lo < hi) & (hi <= e_hi), e_lo, hi)
        starts.append(lo)
        ends.append(jnp.maximum(hi, lo))
    # The partial tile is the tail copy's alone.
    span_end = jnp.minimum(jnp.stack(ends, 1), whole)
    span_start = jnp.minimum(jnp.stack(starts, 1), span_end)
    tiles = lax.div(span_end - span_start, tile)
    tail = jnp.any((length > 0) & (slot_start + length > whole), axis=1).astype(jnp.int32)
    slot = jnp.clip(table[:, tbl.SLOT], 0, num_slots - 1)
    spans = jnp.stack([start, span_start, tiles], -1).reshape(-1, 3 * tbl.NUM_WRITES)
    ranges = jnp.stack([first, slot_start, length], -1).reshape(-1, 3 * tbl.NUM_WRITES)
    return jnp.concatenate([slot[:, None], spans, ranges, tail[:, None]], axis=1).astype(jnp.int32)


def _vmem_bytes(shape: tuple[int, ...], dtype) -> int:
    """VMEM of one buffer: the minor dim padded to 128 lanes, the second-minor to the sublane tile."""
    sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
    *major, rows, lanes = shape
    padded = -(-rows // sublanes) * sublanes * (-(-lanes // LANES) * LANES)
    size = padded * jnp.dtype(dtype).itemsize
    for d in major:
        size *= d
    return size


def _store_direct(cache_k, cache_v, step_k, step_v, table, *, reverse, interpret):
    """The one-token-unit path: each range's tokens DMA'd from the arranged step into the slot."""
    num_slots, rows, groups, capacity, dim = cache_k.shape
    num_requests, steps = table.shape[0], step_k.shape[3]
    limit = min(steps, capacity)
    chunks = powers_of_two(limit)
    kernel = functools.partial(
        direct_kernel, steps=steps, capacity=capacity, num_slots=num_slots, reverse=reverse, chunks=chunks
    )
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    written = 2 * num_requests * rows * groups * limit * dim * cache_k.dtype.itemsize  # at most, K and V
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),) * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_requests,),
            in_specs=[any_space] * 4,
            out_specs=[any_space, any_space],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2, tbl.NUM_WRITES, 2, len(chunks)))],
        ),
        input_output_aliases={3: 0, 4: 1},  # operand indices count the scalar-prefetched table
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * written),
        interpret=interpret,
        name="store_step_tpu",
    )(table.reshape(-1), step_k, step_v, cache_k, cache_v)


def _store_merged(cache_k, cache_v, step_k, step_v, table, *, lanes, reverse, interpret):
    """The tiled and lanes paths: each range's tiles read into VMEM, merged with the step, written back.

    The caches are `[S, R, G, C, D]`, or `[S, R, G, D, C]` in the lanes path (tokens in lanes, tiles of
    `LANES`); the arranged step is `[B, R, G, T, D]` in both.
    """
    axis = -1 if lanes else -2
    num_slots, rows, groups = cache_k.shape[:3]
    capacity, dim = cache_k.shape[axis], cache_k.shape[-3 - axis]
    num_requests, steps = table.shape[0], step_k.shape[3]
    dtype = cache_k.dtype
    limit = min(steps, capacity)
    # Tiles of one token only interpreted (see store_step_tpu).
    tile = LANES if lanes else (TOKEN_TILE if capacity % TOKEN_TILE == 0 else 1)
    whole = capacity // tile * tile
    tail = capacity - whole
    window = min(-(-(limit + tile - 1) // tile) * tile, whole)
    chunks = powers_of_two(window // tile)
    plan = _tile_plan(
        table, steps=steps, capacity=capacity, num_slots=num_slots, tile=tile, window=window, reverse=reverse
    )

    # The rotate needs at least W (and the tail's) tokens, whole tiles of them (the kernel pads the step).
    align = LANES if lanes else TOKEN_TILE
    steps_padded = -(-max(steps, window, tail) // align) * align
    step_block = (rows, groups, steps, dim)
    window_block = (tbl.NUM_WRITES, rows, groups, *((dim, window) if lanes else (window, dim)))
    tail_block = (rows, groups, dim, tail)
    blocks = ([window_block] if window else []) + ([tail_block] if tail else [])

    def vmem_bytes(depth: int) -> int:
        """Step blocks (double-buffered by the pipeline), one row and head of the step in float32 and four
        temporaries of its size, `depth` copies of the windows and tail of K and V."""
        size = 4 * _vmem_bytes(step_block, dtype) + 5 * _vmem_bytes((steps_padded, dim), jnp.float32)
        return size + 2 * depth * sum(_vmem_bytes(block, dtype) for block in blocks)

    # Two requests' windows, so that one's are written back while the next one's are read and merged; one
    # (each request waiting for the last one's write-back) where two would pass the VMEM every chip has.
    depth = 2 if vmem_bytes(2) <= VMEM_BUDGET else 1
    vmem = vmem_bytes(depth)
    if vmem > _MAX_VMEM:
        raise NotImplementedError(f"the TPU store's blocks {step_block}, {blocks} need {vmem} bytes of VMEM")
    buffers = [pltpu.VMEM((depth, *block), dtype) for block in blocks]
    vmem_limit = None if vmem <= _SCOPED_VMEM_DEFAULT else int(vmem * 1.25) + 2**20
    # Tokens read and written back per request, at most: a range of n tokens touches at most
    # ceil((n + tile - 1) / tile) tiles, and the up to NUM_WRITES ranges of a request hold `limit` tokens.
    ranges = min(tbl.NUM_WRITES, limit)
    touched = min((limit + ranges * (2 * tile - 2)) // tile * tile, capacity)
    token_bytes = 2 * num_requests * rows * groups * dim * dtype.itemsize  # a token of every request, K and V
    step_spec = pl.BlockSpec((None, *step_block), lambda b, *_: (b, 0, 0, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        merge_kernel, axis=axis, depth=depth, tile=tile, window=window, tail=tail, chunks=chunks
    )
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(cache_k.shape, dtype),) * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_requests,),
            in_specs=[step_spec, step_spec, any_space, any_space],
            out_specs=[any_space, any_space],
            scratch_shapes=[
                pltpu.VMEM((steps_padded, dim), jnp.float32),
                pltpu.SemaphoreType.DMA((tbl.NUM_WRITES + 1, 2, max(len(chunks), 1))),
                pltpu.SemaphoreType.DMA((depth, tbl.NUM_WRITES + 1, 2, max(len(chunks), 1))),
                *buffers,
                *buffers,
            ],
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=token_bytes * (steps + 2 * touched)
        ),
        interpret=interpret,
        name="store_step_tpu",
    )(plan.reshape(-1), step_k, step_v, cache_k, cache_v)


def store_step_tpu(
    cache_k: jax.Array,
    cache_v: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    reverse: bool,
    interpret: bool | pltpu.InterpretParams = False,
    pin_to_hbm: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Stores each request's written step tokens into its slot with DMAs (the Mosaic TPU kernel).

    Inputs are checked by the public op (`store.store_step`); call that one.

    Args:
      cache_k, cache_v: [S, R, G, C, D] one layer's slots (float32 or bfloat16); donate them to update in
        place.
      k, v: [N, T, G, D] the step's keys and values, N = B * R; cast to the cache's dtype.
      table: i32[B, ROW_INTS] the plan table.
      reverse: the config's `reverse_step_order`.
      interpret: False on TPU; True (HLO interpreter) or `pltpu.InterpretParams(...)` elsewhere.
      pin_to_hbm: pin the caches to HBM for the call, so that XLA never moves a layer small enough for
        VMEM through VMEM around it; None (the default) pins where the libtpu jax loads accepts the pin
        on an aliased operand (`tpu_compiler.pins_aliased_operands`) and never when interpreting. True
        where it does not fails to compile.

    Returns:
      The updated (cache_k, cache_v).

    Raises:
      TypeError: `pin_to_hbm` is neither None nor a bool.
      ValueError: `pin_to_hbm=True` with `interpret` (interpret mode has no memory spaces to pin to).
      NotImplementedError: a cache dtype other than float32 and bfloat16; compiled, a cache that TPU does
        not lay out as the kernel views it (XLA would copy the whole layer around the kernel): `D` a
        multiple of 128 and `C` not a multiple of `TOKEN_TILE`, or `D` not a multiple of 128 and `C` not
        padding to lane tiles less than `D` does (see `tokens_in_lanes`); staged windows too large for
        VMEM.
    """
    if pin_to_hbm is not None and not isinstance(pin_to_hbm, bool):
        raise TypeError(f"pin_to_hbm={pin_to_hbm!r} must be None (decided by the libtpu loaded) or a bool")
    if pin_to_hbm and interpret:
        raise ValueError(f"pin_to_hbm=True with interpret={interpret!r}: interpret mode refuses the pin")
    if pin_to_hbm is None:
        pin_to_hbm = not interpret and tpu_compiler.pins_aliased_operands()
    dtype = jnp.dtype(cache_k.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"cache_k has dtype {dtype}; the TPU store supports {[str(t) for t in SUPPORTED_DTYPES]}"
        )
    _, rows, groups, capacity, dim = cache_k.shape
    num_requests, steps = table.shape[0], k.shape[1]
    if min(num_requests, steps, capacity) == 0 or rows * groups * dim == 0:
        return cache_k, cache_v  # nothing can be written
    lanes = not keys_in_lanes(dim)
    if not interpret and lanes and not tokens_in_lanes(cache_k.shape):
        raise NotImplementedError(
            f"cache_k has shape {tuple(cache_k.shape)}: TPU lays out a layer whose head dim D is not a "
            f"multiple of {LANES} with its slot tokens C in lanes only where C pads to whole lane tiles less "
            "than D does (and no more than S, R, G do), so XLA would copy the whole layer around a Mosaic "
            f"kernel; pad C (to a multiple of {LANES} at best)"
        )
    if not interpret and not lanes and capacity % TOKEN_TILE:
        raise NotImplementedError(
            f"cache_k has shape {tuple(cache_k.shape)}: TPU lays out a layer whose head dim D is a multiple "
            f"of {LANES} and whose slot tokens C are not a multiple of {TOKEN_TILE} other than row-major, so "
            f"XLA would copy the whole layer around a Mosaic kernel; pad C to a multiple of {TOKEN_TILE}"
        )
    table = jnp.asarray(table)
    step_k, step_v = (_arranged(x, num_requests, dtype, reverse) for x in (k, v))
    if lanes:  # the free view of TPU's layout: tokens in lanes (see tpu_blocks)
        cache_k, cache_v = (jnp.swapaxes(x, 3, 4) for x in (cache_k, cache_v))
    if pin_to_hbm:  # the very operands the call aliases
        cache_k, cache_v = (pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (cache_k, cache_v))
    if lanes:
        new = _store_merged(
            cache_k, cache_v, step_k, step_v, table, lanes=True, reverse=reverse, interpret=interpret
        )
        return tuple(jnp.swapaxes(x, 3, 4) for x in new)
    if dtype.itemsize == 4 and dim <= LANES:
        return _store_direct(cache_k, cache_v, step_k, step_v, table, reverse=reverse, interpret=interpret)
    return _store_merged(
        cache_k, cache_v, step_k, step_v, table, lanes=False, reverse=reverse, interpret=interpret
    )
