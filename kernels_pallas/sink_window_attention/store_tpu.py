"""Pallas TPU (Mosaic) store: a step's written tokens go into their ring slots by DMA, the cache aliased.

Equivalent to `store.store_step_xla` (same arguments, no `after`): for every request `b`, write range
`(step_offset, slot_start, len)` of its table row and `t < len`,
`cache[slot_b, :, :, slot_start + t] = step[b * R : (b + 1) * R, step_offset ± t]`. Shape legend:
`table.py`.

The caches stay where they are, in HBM (`memory_space=pl.ANY`), aliased input to output, so a donated
cache is updated in place and nothing but the written tokens' bytes moves. The wrapper arranges the step's
keys and values as `[B, R, G, T, D]` (a request's rows and heads lie together, as in its slot), in the
cache's dtype and, for a reversed step order, with the token axis flipped once: every write range is then
one contiguous run of tokens on both sides. The grid walks the requests ("arbitrary"): program `b` starts
its own DMAs, then waits for those of request `b - 1`, so consecutive requests' copies overlap (the last
program also waits for its own). Distinct requests own distinct slots and padding rows write nothing, so
no two DMAs in flight touch the same bytes.

A DMA has a static shape but a range a dynamic length: a run of `n` units is copied as the binary
decomposition of `n`, one copy of `p` units at offset `n & ~(2p - 1)` for each power of two `p` with
`n & p`: at most log2(T) + 1 copies per range and K/V, none moving a byte twice or touching one past the
range. TPU lays out the last two dims `(C, D)` in (8, 128) tiles (two bf16 rows packed per 32-bit word),
and Mosaic slices the token axis of such a buffer at any offset only when a token row is 32-bit and at
most one lane tile wide; elsewhere only at multiples of 8 ("Offsets along tiled dimensions must be aligned
to tiles", found by compiling with libtpu). Hence two paths:

  direct (32-bit, D <= 128): the unit is one token; each range is copied HBM to HBM straight from the
    arranged step into the slot. The kernel reads and writes exactly the bytes written.
  tiled (bfloat16, or D > 128): the unit is a tile of `TOKEN_TILE` tokens and each range's tiles are read
    into VMEM, merged with the step's tokens and written back. Per range the kernel keeps a window of `W`
    tokens that starts at a tile and covers the range; the request's step `[R, G, T, D]` comes in as a
    VMEM block, and window entry `i` of range `w` takes, wherever range `r` of the request writes slot
    offset `start_w + i`, the step rotated along its token axis by `slot_start_r - start_w - first_r`
    (a dynamic rotate, which Mosaic supports for 32-bit values only: the merge runs in float32, exact for
    bfloat16). Two ranges of a request may share a tile (the end of the sink and the start of the ring):
    every window merges all of the request's ranges, and the wrapper trims later ranges' tile spans by
    earlier ones, so each tile is written back by one window only. Bytes: the step, plus the tiles
    touched, read and written (at most the tokens written and two partial tiles per range).

Compiled, the cache must be laid out row-major, which TPU does for `C % 8 == 0` and `D % 128 == 0`;
otherwise XLA copies the whole layer around any Mosaic call (this one, and the attention kernel), so the
kernel declines (NotImplementedError; "auto" then takes the XLA loop): pad the slot to the tile.
Interpreted, any shape runs (tiles of one token where `C % 8 != 0`).

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

__all__ = ["SUPPORTED_DTYPES", "TOKEN_TILE", "store_step_tpu"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Token rows per HBM tile: the alignment Mosaic requires of a slice of a cache's token axis (unless each
# token row is 32-bit and at most one lane tile wide).
TOKEN_TILE = 8
LANES = 128
# Per request of the tiled path, scalar-prefetched: the slot, then per range (window start, offset of the
# first tile to write, tiles to write), then per range (first token on the arranged axis, slot_start, len).
_SLOT, _SPANS, _RANGES = 0, 1, 1 + 3 * tbl.NUM_WRITES
_PLAN_INTS = _RANGES + 3 * tbl.NUM_WRITES
# VMEM the call may use without asking (below every chip's default scoped limit), as in `tpu.py`.
_SCOPED_VMEM_DEFAULT = 12 * 2**20
_MAX_VMEM = 96 * 2**20


def _powers_of_two(limit: int) -> tuple[int, ...]:
    """The powers of two <= limit, largest first: the copy sizes of the binary decomposition."""
    return tuple(1 << i for i in reversed(range(max(limit, 0).bit_length())))


def _decomposed(count, chunks: tuple[int, ...]):
    """(predicate, offset, size) per chunk: copy `size` units at `offset` where `predicate` holds."""
    return [((count & p) != 0, count & ~(2 * p - 1), p) for p in chunks]


def _each(copies, *, start: bool) -> None:
    """Starts (or waits for) every copy whose predicate holds."""
    for take, copy in copies:
        pl.when(take)(copy.start if start else copy.wait)


def _overlapped(copies_of) -> None:
    """Starts request b's copies, waits for request b - 1's, and at the last request for its own."""
    b = pl.program_id(0)
    _each(copies_of(b), start=True)

    @pl.when(b > 0)
    def _():
        _each(copies_of(b - 1), start=False)

    @pl.when(b == pl.num_programs(0) - 1)
    def _():
        _each(copies_of(b), start=False)


def _direct_kernel(
    # scalar prefetch
    table_ref,  # i32[B * ROW_INTS] the plan table, flattened (SMEM)
    # inputs
    step_k_hbm_ref,  # [B, R, G, T, D] arranged step keys (token axis flipped when reversed)
    step_v_hbm_ref,  # [B, R, G, T, D] arranged step values
    cache_k_alias_ref,  # [S, R, G, C, D] aliased to cache_k_hbm_ref
    cache_v_alias_ref,  # [S, R, G, C, D] aliased to cache_v_hbm_ref
    # outputs
    cache_k_hbm_ref,  # [S, R, G, C, D]
    cache_v_hbm_ref,  # [S, R, G, C, D]
    # scratch
    sems,  # DMA semaphores [2 (request parity), NUM_WRITES, 2 (K, V), chunks]
    *,
    steps: int,
    capacity: int,
    num_slots: int,
    reverse: bool,
    chunks: tuple[int, ...],
):
    del cache_k_alias_ref, cache_v_alias_ref
    limit = min(steps, capacity)

    def copies_of(b):
        base = b * tbl.ROW_INTS
        slot = jnp.clip(table_ref[base + tbl.SLOT], 0, num_slots - 1)
        copies = []
        for w in range(tbl.NUM_WRITES):
            step_offset, slot_start, length = (table_ref[base + col] for col in tbl.write_cols(w))
            # Clamped only so that a malformed table cannot address past the arrays; the planner's
            # ranges already lie inside (and a padding row's are empty).
            length = jnp.clip(length, 0, limit)
            first = steps - 1 - step_offset if reverse else step_offset  # on the arranged token axis
            first = jnp.clip(first, 0, steps - length)
            slot_start = jnp.clip(slot_start, 0, capacity - length)
            for i, (take, offset, size) in enumerate(_decomposed(length, chunks)):
                for j, (src, dst) in enumerate(
                    ((step_k_hbm_ref, cache_k_hbm_ref), (step_v_hbm_ref, cache_v_hbm_ref))
                ):
                    copy = pltpu.make_async_copy(
                        src.at[b, :, :, pl.ds(first + offset, size), :],
                        dst.at[slot, :, :, pl.ds(slot_start + offset, size), :],
                        sems.at[b % 2, w, j, i],
                    )
                    copies.append((take, copy))
        return copies

    _overlapped(copies_of)


def _tiled_kernel(
    # scalar prefetch
    plan_ref,  # i32[B * _PLAN_INTS] per request: slot, tile spans, ranges (see `_tile_plan`)
    # inputs
    step_k_ref,  # [R, G, T, D] request b's arranged step keys (VMEM block)
    step_v_ref,  # [R, G, T, D] request b's arranged step values
    cache_k_alias_ref,  # [S, R, G, C, D] aliased to cache_k_hbm_ref
    cache_v_alias_ref,  # [S, R, G, C, D] aliased to cache_v_hbm_ref
    # outputs
    cache_k_hbm_ref,  # [S, R, G, C, D]
    cache_v_hbm_ref,  # [S, R, G, C, D]
    # scratch
    window_k_scratch,  # [2 (request parity), NUM_WRITES, R, G, W, D] the slot's tiles, then merged
    window_v_scratch,  # [2, NUM_WRITES, R, G, W, D]
    step_scratch,  # f32[R, G, TP, D] the step in float32, zero past T (TP >= W, a multiple of 8)
    read_sems,  # DMA semaphores [NUM_WRITES, 2 (K, V), chunks]
    write_sems,  # DMA semaphores [2 (request parity), NUM_WRITES, 2 (K, V), chunks]
    *,
    tile: int,
    window: int,
    chunks: tuple[int, ...],
):
    del cache_k_alias_ref, cache_v_alias_ref
    b = pl.program_id(0)
    pairs = ((cache_k_hbm_ref, window_k_scratch), (cache_v_hbm_ref, window_v_scratch))

    def copies_of(b, *, write: bool, sems):
        base = b * _PLAN_INTS
        slot = plan_ref[base + _SLOT]
        copies = []
        for w in range(tbl.NUM_WRITES):
            start, first_tile, tiles = (plan_ref[base + _SPANS + 3 * w + c] for c in range(3))
            for i, (take, offset, size) in enumerate(_decomposed(tiles, chunks)):
                at_slot = pl.multiple_of(first_tile + offset * tile, tile)
                at_window = pl.multiple_of(first_tile - start + offset * tile, tile)
                for j, (cache, scratch) in enumerate(pairs):
                    hbm = cache.at[slot, :, :, pl.ds(at_slot, size * tile), :]
                    vmem = scratch.at[b % 2, w, :, :, pl.ds(at_window, size * tile), :]
                    src, dst = (vmem, hbm) if write else (hbm, vmem)
                    sem = sems.at[b % 2, w, j, i] if write else sems.at[w, j, i]
                    copies.append((take, pltpu.make_async_copy(src, dst, sem)))
        return copies

    reads = copies_of(b, write=False, sems=read_sems)
    _each(reads, start=True)
    _each(reads, start=False)

    # Window entry i of range w sits at slot offset start_w + i; where range r writes it, it takes the
    # arranged step token first_r + (start_w + i - slot_start_r): the step rotated along its token axis
    # (a 32-bit rotate, which Mosaic supports at a dynamic amount; hence the float32 detour for bf16).
    base = b * _PLAN_INTS
    ranges = [tuple(plan_ref[base + _RANGES + 3 * r + c] for c in range(3)) for r in range(tbl.NUM_WRITES)]
    steps, dim = step_k_ref.shape[-2:]
    steps_padded = step_scratch.shape[2]
    offsets = lax.broadcasted_iota(jnp.int32, (window, dim), 0)
    if steps_padded > steps:  # the rotate wraps around TP: what it brings past T is never taken
        step_scratch[:, :, steps:, :] = jnp.zeros((*step_scratch.shape[:2], steps_padded - steps, dim))
    for step_ref, scratch in ((step_k_ref, window_k_scratch), (step_v_ref, window_v_scratch)):
        step_scratch[:, :, :steps, :] = step_ref[...].astype(jnp.float32)
        step = step_scratch[...]
        for w in range(tbl.NUM_WRITES):
            start = plan_ref[base + _SPANS + 3 * w]
            position = start + offsets
            merged = scratch[b % 2, w].astype(jnp.float32)
            for first, slot_start, length in ranges:
                inside = (position >= slot_start) & (position < slot_start + length)
                shift = lax.rem(slot_start - start - first, steps_padded)
                shift = jnp.where(shift < 0, shift + steps_padded, shift)
                rotated = pltpu.roll(step, shift, 2)[:, :, :window]
                merged = jnp.where(inside[None, None], rotated, merged)
            scratch[b % 2, w] = merged.astype(scratch.dtype)

    _overlapped(functools.partial(copies_of, write=True, sems=write_sems))


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
    table: jax.Array, *, steps: int, capacity: int, num_slots: int, tile: int, window: int, reverse
):
    """The tiled path's per-request plan, i32[B, _PLAN_INTS].

    Per request: the slot; per range the window's start `a` (a tile multiple, the window `[a, a + W)`
    inside the slot and covering the range), the offset of the first tile to write and how many (trimmed
    so that no tile is written by two windows); per range its first token on the arranged step axis and
    its clamped (slot_start, len).
    """
    first, slot_start, length = _write_ranges(table, steps=steps, capacity=capacity, reverse=reverse)
    # Offsets are >= 0 here, so truncating division is floor division (and cheaper than `//`).
    floor = lax.div(slot_start, tile) * tile
    start = jnp.minimum(floor, capacity - window)
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
    span_start, span_end = jnp.stack(starts, 1), jnp.stack(ends, 1)
    tiles = lax.div(span_end - span_start, tile)
    slot = jnp.clip(table[:, tbl.SLOT], 0, num_slots - 1)
    spans = jnp.stack([start, span_start, tiles], -1).reshape(-1, 3 * tbl.NUM_WRITES)
    ranges = jnp.stack([first, slot_start, length], -1).reshape(-1, 3 * tbl.NUM_WRITES)
    return jnp.concatenate([slot[:, None], spans, ranges], axis=1).astype(jnp.int32)


def _vmem_bytes(shape: tuple[int, ...], dtype) -> int:
    """VMEM of one buffer: the minor dim padded to 128 lanes, the second-minor to the sublane tile."""
    sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
    *major, rows, lanes = shape
    padded = -(-rows // sublanes) * sublanes * (-(-lanes // 128) * 128)
    size = padded * jnp.dtype(dtype).itemsize
    for d in major:
        size *= d
    return size


def _store_direct(cache_k, cache_v, step_k, step_v, table, *, reverse, interpret):
    """The one-token-unit path: each range's tokens DMA'd from the arranged step into the slot."""
    num_slots, rows, groups, capacity, dim = cache_k.shape
    num_requests, steps = table.shape[0], step_k.shape[3]
    limit = min(steps, capacity)
    chunks = _powers_of_two(limit)
    kernel = functools.partial(
        _direct_kernel, steps=steps, capacity=capacity, num_slots=num_slots, reverse=reverse, chunks=chunks
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


def _store_tiled(cache_k, cache_v, step_k, step_v, table, *, reverse, interpret):
    """The tile-unit path: each range's tiles read into VMEM, merged with the step's tokens, written back."""
    num_slots, rows, groups, capacity, dim = cache_k.shape
    num_requests, steps = table.shape[0], step_k.shape[3]
    dtype = cache_k.dtype
    limit = min(steps, capacity)
    tile = TOKEN_TILE if capacity % TOKEN_TILE == 0 else 1  # 1 only interpreted (see store_step_tpu)
    window = min(-(-(limit + tile - 1) // tile) * tile, capacity)
    chunks = _powers_of_two(window // tile)
    plan = _tile_plan(
        table, steps=steps, capacity=capacity, num_slots=num_slots, tile=tile, window=window, reverse=reverse
    )
    # The rotate needs at least W tokens (the kernel pads the step in VMEM).
    steps_padded = -(-max(steps, window) // TOKEN_TILE) * TOKEN_TILE
    step_block = (rows, groups, steps, dim)
    window_block = (tbl.NUM_WRITES, rows, groups, window, dim)
    # Step blocks (double-buffered by the pipeline, and their float32 copy), the parity-doubled windows.
    vmem = 4 * _vmem_bytes(step_block, dtype) + 3 * _vmem_bytes(
        (rows, groups, steps_padded, dim), jnp.float32
    )
    vmem += 4 * _vmem_bytes(window_block, dtype)
    if vmem > _MAX_VMEM:
        raise NotImplementedError(
            f"the TPU store's blocks {step_block}, {window_block} need {vmem} bytes of VMEM"
        )
    vmem_limit = None if vmem <= _SCOPED_VMEM_DEFAULT else int(vmem * 1.25) + 2**20
    # Tokens read and written back per request, at most: the written ones and each range's partial tiles.
    touched = min(limit + 2 * min(tbl.NUM_WRITES, limit) * (tile - 1), capacity)
    token_bytes = 2 * num_requests * rows * groups * dim * dtype.itemsize  # a token of every request, K and V
    step_spec = pl.BlockSpec((None, *step_block), lambda b, *_: (b, 0, 0, 0, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_tiled_kernel, tile=tile, window=window, chunks=chunks),
        out_shape=(jax.ShapeDtypeStruct(cache_k.shape, dtype),) * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_requests,),
            in_specs=[step_spec, step_spec, any_space, any_space],
            out_specs=[any_space, any_space],
            scratch_shapes=[
                pltpu.VMEM((2, *window_block), dtype),
                pltpu.VMEM((2, *window_block), dtype),
                pltpu.VMEM((rows, groups, steps_padded, dim), jnp.float32),
                pltpu.SemaphoreType.DMA((tbl.NUM_WRITES, 2, len(chunks))),
                pltpu.SemaphoreType.DMA((2, tbl.NUM_WRITES, 2, len(chunks))),
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

    Returns:
      The updated (cache_k, cache_v).

    Raises:
      NotImplementedError: a cache dtype other than float32 and bfloat16; compiled, a cache whose `C` is
        not a multiple of `TOKEN_TILE` or whose `D` is not a multiple of 128 (XLA would copy the whole
        layer around the kernel); staged windows too large for VMEM.
    """
    dtype = jnp.dtype(cache_k.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"cache_k has dtype {dtype}; the TPU store supports {[str(t) for t in SUPPORTED_DTYPES]}"
        )
    _, rows, groups, capacity, dim = cache_k.shape
    if not interpret and (capacity % TOKEN_TILE or dim % LANES):
        raise NotImplementedError(
            f"cache_k has shape {tuple(cache_k.shape)}: TPU lays out a layer whose slot tokens C are not a "
            f"multiple of {TOKEN_TILE} or whose head dim D is not a multiple of {LANES} other than "
            "row-major, so XLA would copy the whole layer around a Mosaic kernel; pad C (and D) to the tile"
        )
    num_requests, steps = table.shape[0], k.shape[1]
    if min(num_requests, steps, capacity) == 0 or rows * groups * dim == 0:
        return cache_k, cache_v  # nothing can be written
    table = jnp.asarray(table)
    step_k, step_v = (_arranged(x, num_requests, dtype, reverse) for x in (k, v))
    store = _store_direct if dtype.itemsize == 4 and dim <= LANES else _store_tiled
    return store(cache_k, cache_v, step_k, step_v, table, reverse=reverse, interpret=interpret)
