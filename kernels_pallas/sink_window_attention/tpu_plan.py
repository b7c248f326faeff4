"""Plan arithmetic of the TPU kernel: the store blocks each row walks, computed with jnp before the call.

Both results are scalar-prefetched into SMEM, where the kernel body and the BlockSpec index maps read them.
Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.sink_window_attention import table as tbl

# Per read range, scalar-prefetched: (start, end, offset) with retained index j = store offset + offset.
RANGE_INTS = 3


def read_ranges(table: jax.Array) -> jax.Array:
    """i32[B * NUM_READS * 3]: each read range as (start, end, offset), retained index j = o + offset."""
    lengths = table[:, tbl.READS + 1 : tbl.WRITES : 2]
    starts = table[:, tbl.READS : tbl.WRITES : 2]
    prefix = jnp.cumsum(lengths, axis=1) - lengths  # retained index of each range's first key
    return jnp.stack([starts, starts + lengths, prefix - starts], axis=2).reshape(-1)


def store_plan(table, reads, block, num_blocks, num_steps, store_ids, rows_per_request):
    """Which blocks of one store (source bank or slots) each row walks, for the index maps and the kernel.

    Args:
      table: i32[B, ROW_INTS].
      reads: the read ranges that live in this store.
      block: the store's block length; num_blocks: blocks in the store; num_steps: key steps of the phase.
      store_ids: i32[B], the request's source or slot index (already clipped into range).
      rows_per_request: R.

    Returns:
      blocks i32[B * num_steps]: the blocks a request's ranges touch, ascending, then the last one repeated
        (so skipped steps issue no DMA).
      entries i32[N]: row n's entry of the store's flattened `[S * R]` axis (`store_id * R + n % R`); a
        grid step reads all G KV heads of it.
      counts i32[B]: how many entries of `blocks` are useful.
      A request that touches no block holds the last block and entry of the most recent earlier row that
      touched one, so its steps issue no DMA either.
    """
    ids = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
    touched = jnp.zeros((table.shape[0], num_blocks), bool)
    for i in reads:
        start, length = table[:, tbl.read_start(i)], table[:, tbl.read_len(i)]
        first, last = start // block, (start + length - 1) // block
        touched |= (length[:, None] > 0) & (ids >= first[:, None]) & (ids <= last[:, None])
    order = jnp.argsort(jnp.where(touched, 0, 1), axis=1, stable=True)[:, :num_steps].astype(jnp.int32)
    counts = jnp.minimum(touched.sum(axis=1, dtype=jnp.int32), num_steps)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=1)
    blocks = jnp.where(jnp.arange(num_steps)[None, :] < counts[:, None], order, last)

    # Each request's first row finds the most recent earlier row (a request's rows share its plan).
    requests = table.shape[0]
    used = counts > 0
    first_row = jnp.arange(requests, dtype=jnp.int32) * rows_per_request
    last_user_row = jnp.where(used, first_row + rows_per_request - 1, -1)
    held_row = jnp.concatenate([jnp.full((1,), -1, jnp.int32), lax.cummax(last_user_row)[:-1]])
    has_held = held_row >= 0
    held_request = jnp.maximum(held_row, 0) // rows_per_request
    held_entry = store_ids[held_request] * rows_per_request + jnp.maximum(held_row, 0) % rows_per_request
    held_entry = jnp.where(has_held, held_entry, 0)
    blocks = jnp.where(used[:, None], blocks, jnp.where(has_held, blocks[held_request, -1], 0)[:, None])

    row = jnp.arange(requests * rows_per_request, dtype=jnp.int32)
    request = row // rows_per_request
    own_entry = store_ids[request] * rows_per_request + row % rows_per_request
    entries = jnp.where(used[request], own_entry, held_entry[request])
    return blocks.reshape(-1), entries, counts
