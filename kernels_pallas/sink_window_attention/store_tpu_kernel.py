"""The Pallas TPU store kernels' bodies: DMA helpers, the direct copy and the tile merge (see `store_tpu`).

`store_tpu` plans the writes and calls these; the module docstring there says what each path does and why.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import table as tbl

# Per request of the merging paths, scalar-prefetched: the slot, then per range (window start, first token
# of the tiles to write, tiles to write), then per range (first token on the arranged axis, slot_start,
# len), then whether the slot's partial last lane tile is written.
PLAN_SLOT, PLAN_SPANS, PLAN_RANGES = 0, 1, 1 + 3 * tbl.NUM_WRITES
PLAN_TAIL = PLAN_RANGES + 3 * tbl.NUM_WRITES
PLAN_INTS = PLAN_TAIL + 1


def powers_of_two(limit: int) -> tuple[int, ...]:
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


def direct_kernel(
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


def _tokens(ndim: int, axis: int, start, size: int, *lead) -> tuple:
    """The index `(*lead, :, .., pl.ds(start, size) at axis, ..)` into an `ndim`-dim ref (axis < 0)."""
    index = [slice(None)] * (ndim - len(lead))
    index[axis] = pl.ds(start, size)
    return (*lead, *index)


def merge_kernel(
    # scalar prefetch
    plan_ref,  # i32[B * PLAN_INTS] per request: slot, tile spans, ranges, tail flag (see `_tile_plan`)
    # inputs
    step_k_ref,  # [R, G, T, D] request b's arranged step keys (VMEM block)
    step_v_ref,  # [R, G, T, D] request b's arranged step values
    cache_k_alias_ref,  # [S, R, G, C, D] aliased to cache_k_hbm_ref; lanes path [S, R, G, D, C]
    cache_v_alias_ref,  # [S, R, G, C, D] aliased to cache_v_hbm_ref; lanes path [S, R, G, D, C]
    # outputs
    cache_k_hbm_ref,  # [S, R, G, C, D]; lanes path [S, R, G, D, C]
    cache_v_hbm_ref,  # [S, R, G, C, D]; lanes path [S, R, G, D, C]
    # scratch
    step_scratch,  # f32[TP, D] one row and head of the step, zero past T (TP >= W, C - C0; whole tiles)
    read_sems,  # DMA semaphores [NUM_WRITES + 1 (the tail), 2 (K, V), chunks]
    write_sems,  # DMA semaphores [depth (request parity), NUM_WRITES + 1, 2 (K, V), chunks]
    *buffers,  # for K, then V: the windows [depth, NUM_WRITES, R, G, W, D] (lanes [.., D, W]) if W > 0,
    # then the tail [depth, R, G, D, C - C0] if C0 < C: the slot's tiles, then merged
    axis: int,
    depth: int,
    tile: int,
    window: int,
    tail: int,
    chunks: tuple[int, ...],
):
    del cache_k_alias_ref, cache_v_alias_ref
    b = pl.program_id(0)
    capacity = cache_k_hbm_ref.shape[axis]
    per_kv = len(buffers) // 2
    windows = [kv[0] if window else None for kv in (buffers[:per_kv], buffers[per_kv:])]
    tails = [kv[-1] if tail else None for kv in (buffers[:per_kv], buffers[per_kv:])]

    def copies_of(b, *, write: bool, sems):
        base, parity = b * PLAN_INTS, b % depth
        slot = plan_ref[base + PLAN_SLOT]

        def copy(hbm, vmem, sem):
            return pltpu.make_async_copy(*((vmem, hbm) if write else (hbm, vmem)), sem)

        copies = []
        for j, cache in enumerate((cache_k_hbm_ref, cache_v_hbm_ref)):
            for w in range(tbl.NUM_WRITES if window else 0):
                start, first_tile, tiles = (plan_ref[base + PLAN_SPANS + 3 * w + c] for c in range(3))
                for i, (take, offset, size) in enumerate(_decomposed(tiles, chunks)):
                    at_slot = pl.multiple_of(first_tile + offset * tile, tile)
                    at_window = pl.multiple_of(first_tile - start + offset * tile, tile)
                    hbm = cache.at[_tokens(5, axis, at_slot, size * tile, slot)]
                    vmem = windows[j].at[_tokens(6, axis, at_window, size * tile, parity, w)]
                    sem = sems.at[parity, w, j, i] if write else sems.at[w, j, i]
                    copies.append((take, copy(hbm, vmem, sem)))
            if tail:  # one static copy of the partial last tile, whole
                hbm = cache.at[_tokens(5, axis, capacity - tail, tail, slot)]
                sem = sems.at[parity, tbl.NUM_WRITES, j, 0] if write else sems.at[tbl.NUM_WRITES, j, 0]
                copies.append((plan_ref[base + PLAN_TAIL] != 0, copy(hbm, tails[j].at[parity], sem)))
        return copies

    write_back = functools.partial(copies_of, write=True, sems=write_sems)
    if depth == 1:  # the buffers are free once request b - 1's are written back

        @pl.when(b > 0)
        def _():
            _each(write_back(b - 1), start=False)

    reads = copies_of(b, write=False, sems=read_sems)
    _each(reads, start=True)
    _each(reads, start=False)

    # Entry i of a window (or the tail) starting at slot offset `start` sits at `start + i`; where range r
    # writes it, it takes the arranged step token first_r + (start + i - slot_start_r): the step rotated
    # along its token axis (a 32-bit rotate, which Mosaic supports at a dynamic amount; hence the float32
    # detour for bf16). The lanes path transposes the step, its tokens to lanes. One (row, head) at a
    # time, so that the values stay a few vregs (whole windows at once took as much VMEM again).
    base, parity = b * PLAN_INTS, b % depth
    ranges = [
        tuple(plan_ref[base + PLAN_RANGES + 3 * r + c] for c in range(3)) for r in range(tbl.NUM_WRITES)
    ]
    starts = [plan_ref[base + PLAN_SPANS + 3 * w] for w in range(tbl.NUM_WRITES if window else 0)]
    rows, groups, steps, dim = step_k_ref.shape
    steps_padded = step_scratch.shape[0]
    token_axis = 2 + axis  # of a [W, D] (or [D, W]) window of one row and head

    def merged(old, start, step):
        position = start + lax.broadcasted_iota(jnp.int32, old.shape, token_axis)
        out = old.astype(jnp.float32)
        for first, slot_start, length in ranges:
            inside = (position >= slot_start) & (position < slot_start + length)
            shift = lax.rem(slot_start - start - first, steps_padded)
            shift = jnp.where(shift < 0, shift + steps_padded, shift)
            rotated = pltpu.roll(step, shift, token_axis)
            out = jnp.where(inside, lax.slice_in_dim(rotated, 0, old.shape[token_axis], axis=token_axis), out)
        return out.astype(old.dtype)

    if steps_padded > steps:  # the rotate wraps around TP: what it brings past T is never taken
        step_scratch[steps:, :] = jnp.zeros((steps_padded - steps, dim), jnp.float32)

    def merge_head(h, carry):
        r, g = lax.div(h, groups), lax.rem(h, groups)  # h >= 0: truncation is floor
        for j, step_ref in enumerate((step_k_ref, step_v_ref)):
            step_scratch[:steps, :] = step_ref[r, g].astype(jnp.float32)
            step = step_scratch[...] if axis == -2 else step_scratch[...].T
            for w, start in enumerate(starts):
                windows[j][parity, w, r, g] = merged(windows[j][parity, w, r, g], start, step)
            if tail:
                tails[j][parity, r, g] = merged(tails[j][parity, r, g], capacity - tail, step)
        return carry

    lax.fori_loop(0, rows * groups, merge_head, 0)

    if depth == 2:
        _overlapped(write_back)
    else:
        _each(write_back(b), start=True)

        @pl.when(b == pl.num_programs(0) - 1)
        def _():
            _each(write_back(b), start=False)
