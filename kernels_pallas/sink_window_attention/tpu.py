"""Pallas TPU (Mosaic) sink+window attention: online softmax over a row's retained keys, then its own.

Grid `(N, NQ, NK)`: attention row, query block (both parallel, so megacore chips split them), then the
key walk (`arbitrary`, it carries the online-softmax state). Every grid step handles all `G` KV heads of
its key block: one DMA moves `[G, block, D]` of K (and of V), as in MaxText's ragged attention and JAX's
ragged paged attention, so decode pays the per-step overhead once per key block rather than once per
block and KV head. The key walk has three phases:

  steps [0, NS)            source blocks  (reads 0 and 2, straight from the source bank)
  steps [NS, NS + NC)      slot blocks    (reads 1, 3 and 4, straight from the row's slot)
  step  NS + NC            the step's own T keys, then the output is normalised and written

Neither store is copied: each phase has its own BlockSpec over the store as it lies in HBM, and its index
map reads a per-request list of the store blocks the plan table touches (built with jnp before the call,
scalar-prefetched into SMEM with the table). Steps past a row's useful blocks repeat the last useful block
index, so the pipeline issues no DMA, and `pl.when` skips their compute (MaxText `ragged_mqa`). A row that
touches no block of a store (a padding row, a row without a source) keeps pointing at the block the
previous row left in that buffer, so it issues no DMA either (before any row has touched a store, its
buffer holds block 0 of entry 0: fetched once, never attended).

Why BlockSpecs and not manual DMA from `pl.ANY` refs: the Pallas pipeline double-buffers, clips the last
partial block of a store whose length is not a multiple of the block, and is exactly what both interpret
modes simulate; manual DMA would need hand-written double buffering and start clamping for the same effect.

The `H/G` query heads of each KV head are folded with the step tokens (`T * H/G` rows per KV head), and
the scores and the value update are dots batched over `G` (a leading batch dim, which Mosaic lowers),
with f32 online-softmax state per KV head and query row. Keys are masked per entry by the read ranges
they fall in (the same for every KV head), which also gives their stream positions for `query_window`;
values of masked keys are zeroed so NaN or stale bytes (evicted entries, the padding of a partial block)
never reach the output.

VMEM per grid step (see `_vmem_bytes`, which `BlockSizes.default` budgets with): the K/V buffers,
`2 stores x 2 (K, V) x 2 buffers x G x block x D x itemsize` (16 MiB for G = 8, D = 128, bf16 and
blocks of 1024 in both stores), the double-buffered query, output and own-key blocks, the f32 state
`G x block_q x (D + 2)` and about three f32 `G x block_q x block` score temporaries. Past the smallest
default scoped VMEM limit (16 MiB on v5e) the call raises `vmem_limit_bytes` to fit.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import table as tbl

# A finite "minus infinity": exp(MASK - MASK) stays finite, so fully masked rows never produce NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# TPU vreg tile: 8 sublanes x 128 lanes of 32 bits; blocks' second-to-last dims must be multiples of 8.
SUBLANES = 8
# Key blocks the default chooser may pick, and the VMEM it lets one grid step use: 16 MiB, the scoped VMEM
# default we understand v5e to have (the smallest of current chips; not yet checked on hardware).
MAX_BLOCK_KV = 4096
DEFAULT_VMEM_BUDGET = 16 * 2**20
# Past this estimate the call sets `vmem_limit_bytes` itself (with headroom for Mosaic's own scratch).
_SCOPED_VMEM_DEFAULT = 12 * 2**20

# Per read range, scalar-prefetched: (start, end, offset) with retained index j = store offset + offset.
_RANGE_INTS = 3


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockSizes:
    """Tile sizes of the TPU kernel.

    Attributes:
      block_kv: retained keys per grid step and store (the K/V block's sublane dim; each step moves this
        many keys of all G KV heads). A multiple of 8 (the TPU sublane tile; bf16 packs 16 rows per vreg,
        so prefer multiples of 16 there). A store shorter than the block is taken whole, which TPU allows
        because the block then equals the dim.
      block_q: folded query rows (`T * H/G`) per KV head and grid step, a multiple of 8; None takes all.
    """

    block_kv: int
    block_q: int | None = None

    def __post_init__(self):
        if not isinstance(self.block_kv, int) or self.block_kv < 1 or self.block_kv % SUBLANES:
            raise ValueError(f"block_kv={self.block_kv!r} must be a positive multiple of {SUBLANES}")
        if self.block_q is not None and (
            not isinstance(self.block_q, int) or self.block_q < 1 or self.block_q % SUBLANES
        ):
            raise ValueError(f"block_q={self.block_q!r} must be None or a positive multiple of {SUBLANES}")

    @classmethod
    def default(
        cls,
        *,
        max_retained: int,
        query_rows: int,
        kv_heads: int = 1,
        head_dim: int = 128,
        itemsize: int = 2,
        steps: int = 1,
        source_len: int | None = None,
        slot_len: int | None = None,
    ) -> "BlockSizes":
        """Blocks for `max_retained` keys and `query_rows = T * H/G` folded queries per KV head.

        Decode is HBM-bound and each grid step has a fixed cost, so the key block is as large as
        `max_retained` needs (a power of two, 128 to 4096 rows) while a step's VMEM (`_vmem_bytes`)
        stays within `DEFAULT_VMEM_BUDGET`; for very wide K/V rows it shrinks below 128, down to 16. A
        store shorter than the block is taken whole, so `source_len` and `slot_len` (L and C; None counts
        a full block) let a short source bank leave its VMEM to longer slot blocks. The query block caps
        the f32 accumulator at 512 rows of `D` floats summed over the G KV heads.
        """
        rows_cap = max(16, 512 // max(kv_heads, 1) // 16 * 16)
        block_q = None if query_rows <= rows_cap else rows_cap
        q_rows = query_rows if block_q is None else block_q
        block_kv = min(MAX_BLOCK_KV, max(128, pl.next_power_of_2(max(max_retained, 1))))

        def vmem(block: int) -> int:
            source = block if source_len is None else max(1, min(block, source_len))
            slot = block if slot_len is None else max(1, min(block, slot_len))
            return _vmem_bytes(kv_heads, q_rows, source, slot, steps, head_dim, itemsize)

        while block_kv > 16 and vmem(block_kv) > DEFAULT_VMEM_BUDGET:
            block_kv //= 2
        return cls(block_kv=block_kv, block_q=block_q)


def _vmem_bytes(
    kv_heads: int, block_q: int, block_source: int, block_slot: int, steps: int, dim: int, itemsize: int
) -> int:
    """Estimated VMEM of one grid step: pipeline buffers (two each), f32 scratch and score temporaries."""
    kv = 2 * 2 * kv_heads * (block_source + block_slot) * dim * itemsize
    q_out = 2 * 2 * kv_heads * block_q * dim * itemsize
    own = 2 * 2 * kv_heads * steps * dim * itemsize
    # m and l are [.., 1] columns, padded to the 128 lanes of a vreg.
    scratch = 4 * kv_heads * block_q * (dim + 2 * 128)
    scores = 3 * 4 * kv_heads * block_q * max(block_source, block_slot, steps)
    return kv + q_out + own + scratch + scores


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _read_ranges(table: jax.Array) -> jax.Array:
    """i32[B * NUM_READS * 3]: each read range as (start, end, offset), retained index j = o + offset."""
    lengths = table[:, tbl.READS + 1 : tbl.WRITES : 2]
    starts = table[:, tbl.READS : tbl.WRITES : 2]
    prefix = jnp.cumsum(lengths, axis=1) - lengths  # retained index of each range's first key
    return jnp.stack([starts, starts + lengths, prefix - starts], axis=2).reshape(-1)


def _store_plan(table, reads, block, num_blocks, num_steps, store_ids, rows_per_request):
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


def _kernel(
    # scalar prefetch
    table_ref,  # i32[B * ROW_INTS]
    ranges_ref,  # i32[B * NUM_READS * 3]
    source_blocks_ref,  # i32[B * NS]
    source_entries_ref,  # i32[N] (index maps only)
    source_counts_ref,  # i32[B]
    slot_blocks_ref,  # i32[B * NC]
    slot_entries_ref,  # i32[N] (index maps only)
    slot_counts_ref,  # i32[B]
    # inputs
    q_ref,  # [G, bq, D]
    source_k_ref,  # [G, block_source, D]
    source_v_ref,  # [G, block_source, D]
    cache_k_ref,  # [G, block_slot, D]
    cache_v_ref,  # [G, block_slot, D]
    k_ref,  # [G, T, D]
    v_ref,  # [G, T, D]
    # outputs
    o_ref,  # [G, bq, D]
    # scratch
    m_scratch,  # f32[G, bq, 1] running max
    l_scratch,  # f32[G, bq, 1] running sum
    acc_scratch,  # f32[G, bq, D] unnormalised output
    *,
    rows_per_request: int,
    group: int,
    block_q: int,
    block_source: int,
    block_slot: int,
    source_len: int,
    slot_len: int,
    source_steps: int,
    slot_steps: int,
    query_window: int | None,
    scale: float,
):
    del source_entries_ref, slot_entries_ref
    # lax.div (truncating) rather than `//`: the operands are >= 0 and Mosaic lowers it without fix-ups.
    request = lax.div(pl.program_id(0), jnp.int32(rows_per_request))
    q_block, step = pl.program_id(1), pl.program_id(2)
    row_base = request * tbl.ROW_INTS
    # Scalars are read inside the branches that use them: a skipped step reads only the two counts.

    def col(c):
        return table_ref[row_base + c]

    def token():
        """Step token of each folded query row (token-major, then the group's heads): i32[1, bq, 1]."""
        rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (1, block_q, 1), 1)
        return lax.div(rows, jnp.int32(group))

    @pl.when(step == 0)
    def _init():
        m_scratch[...] = jnp.full(m_scratch.shape, MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    def dot(a, b, contracting):
        """A dot batched over the leading KV-head dim, accumulated in f32."""
        precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
        return lax.dot_general(
            a, b, (contracting, ((0,), (0,))), precision=precision, preferred_element_type=jnp.float32
        )

    def attend(keys, values, key_ok, key_pos, value_ok):
        """One online-softmax update over every KV head.

        Args:
          keys, values: [G, bk, D].
          key_ok, key_pos: [1, 1, bk]; value_ok: [1, bk, 1] (the same keys are valid for every head).

        Returns the updated (running sum, accumulator) so the last step need not reload them.
        """
        q = q_ref[...]
        if keys.shape[1] == 1:
            # A single key row (decode's own key, a one-entry store): Mosaic cannot lower a bf16 dot of
            # that shape, and the VPU does it as well as the MXU would.
            s = jnp.sum(q.astype(jnp.float32) * keys.astype(jnp.float32), axis=2, keepdims=True) * scale
        else:
            s = dot(q, keys, ((2,), (2,))) * scale  # [G, bq, bk]
        tokens = token()
        mask = (tokens < col(tbl.STEP_TOKENS)) & key_ok  # [1, bq, bk]
        if query_window is not None:
            query_pos = col(tbl.STREAM_LEN) + tokens
            mask &= tbl.query_window_visible(key_pos, query_pos, col(tbl.SINK), query_window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_scratch[...]
        m_next = jnp.maximum(m_prev, s.max(axis=2, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
        total = alpha * l_scratch[...] + p.sum(axis=2, keepdims=True)
        # Masked keys may be NaN (poisoned, evicted or partial-block padding): 0 * NaN would leak.
        values = jnp.where(value_ok, values, jnp.zeros_like(values))
        if values.shape[1] == 1:
            update = p * values.astype(jnp.float32)
        else:
            update = dot(p.astype(values.dtype), values, ((2,), (1,)))  # [G, bq, D]
        acc = alpha * acc_scratch[...] + update
        m_scratch[...], l_scratch[...], acc_scratch[...] = m_next, total, acc
        return total, acc

    def attend_store(k_block_ref, v_block_ref, blocks_ref, steps, phase_step, block, store_len, reads):
        block_start = blocks_ref[request * steps + phase_step] * block
        # Row form masks scores; column form masks values (each from its own iota: no relayout).
        offset = block_start + lax.broadcasted_iota(jnp.int32, (1, 1, block), 2)
        offset_column = block_start + lax.broadcasted_iota(jnp.int32, (1, block, 1), 1)
        key_ok = jnp.zeros((1, 1, block), bool)
        value_ok = jnp.zeros((1, block, 1), bool)
        key_pos = jnp.zeros((1, 1, block), jnp.int32)
        if query_window is not None:
            sink_kept, window_start = col(tbl.SINK_KEPT), col(tbl.WINDOW_START)
        for i in reads:
            at = (request * tbl.NUM_READS + i) * _RANGE_INTS
            start, end = ranges_ref[at], jnp.minimum(ranges_ref[at + 1], store_len)
            inside = (offset >= start) & (offset < end)
            key_ok |= inside
            value_ok |= (offset_column >= start) & (offset_column < end)
            if query_window is not None:
                j = offset + ranges_ref[at + 2]  # the retained index; positions as in table.py
                pos = tbl.retained_position(j, sink_kept, window_start, xp=jnp)
                key_pos = jnp.where(inside, pos, key_pos)
        attend(k_block_ref[...], v_block_ref[...], key_ok, key_pos, value_ok)

    @pl.when(step < source_counts_ref[request])
    def _source():
        attend_store(
            source_k_ref,
            source_v_ref,
            source_blocks_ref,
            source_steps,
            step,
            block_source,
            source_len,
            tbl.SOURCE_READS,
        )

    slot_step = step - source_steps

    @pl.when((slot_step >= 0) & (slot_step < slot_counts_ref[request]))
    def _slot():
        attend_store(
            cache_k_ref,
            cache_v_ref,
            slot_blocks_ref,
            slot_steps,
            slot_step,
            block_slot,
            slot_len,
            tbl.SLOT_READS,
        )

    @pl.when(step == source_steps + slot_steps)
    def _own_and_finish():
        steps = k_ref.shape[1]
        step_tokens = col(tbl.STEP_TOKENS)
        own = lax.broadcasted_iota(jnp.int32, (1, 1, steps), 2)
        own_ok = lax.broadcasted_iota(jnp.int32, (1, steps, 1), 1) < step_tokens
        total, acc = attend(k_ref[...], v_ref[...], own < step_tokens, col(tbl.STREAM_LEN) + own, own_ok)
        out = acc / jnp.where(total > 0, total, 1.0)
        o_ref[...] = jnp.where(total > 0, out, 0.0).astype(o_ref.dtype)


def sink_window_attention_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    source_k: jax.Array,
    source_v: jax.Array,
    table: jax.Array,
    *,
    max_retained: int,
    query_window: int | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Sink+window attention of each step token over `stream[retained] ++ step keys`, as a TPU kernel.

    Equivalent to `reference.sink_window_attention_reference` (which is float64 NumPy): for row `n`,
    with `row = table[n // R]` and `c = n % R`, gather the retained keys of the five read ranges
    (source ranges from `source_k[row[SOURCE], c]`, slot ranges from `cache_k[row[SLOT], c]`), append
    `k[n, :row[STEP_TOKENS]]`, and compute `softmax(q k^T * scale, masked) v` per query head against
    KV head `h // (H // G)`; queries past `STEP_TOKENS` and queries with no visible key give zeros.

    Args:
      q: [N, T, H, D] queries, N = B * R, float32 or bfloat16.
      k, v: [N, T, G, D] the step's own keys and values, q's dtype.
      cache_k, cache_v: [S, R, G, C, D] one layer's slots, q's dtype.
      source_k, source_v: [V, R, G, L, D] one layer's source bank, q's dtype.
      table: i32[B, ROW_INTS] plan table (see `table.py`).
      max_retained: K, the static bound on retained keys per row; the key walk is sized by it.
      query_window: None (every query sees every key) or an int >= 1 (causal band, sinks always visible).
      scale: score scale; defaults to 1 / sqrt(D).
      block_sizes: tile sizes; defaults to `BlockSizes.default(...)`.
      interpret: False on TPU; True (HLO interpreter) or `pltpu.InterpretParams(...)` on CPU.

    Returns:
      [N, T, H, D] in q's dtype.

    Raises:
      ValueError: inconsistent shapes or settings.
      NotImplementedError: dtypes this kernel does not handle (the public op falls back to XLA).
    """
    n_rows, steps, heads, dim = q.shape
    if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (n_rows, steps) or k.shape[3] != dim:
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [N, T, G, D] with N, T, D of q {q.shape}")
    kv_heads = k.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads H={heads} must be a multiple of KV heads G={kv_heads}")
    if table.ndim != 2 or table.shape[1] != tbl.ROW_INTS or table.shape[0] < 1 or n_rows % table.shape[0]:
        raise ValueError(f"table {table.shape} must be [B, {tbl.ROW_INTS}] with N={n_rows} a multiple of B")
    requests = table.shape[0]
    rows_per_request = n_rows // requests
    for name, store in (
        ("cache_k", cache_k),
        ("cache_v", cache_v),
        ("source_k", source_k),
        ("source_v", source_v),
    ):
        if store.ndim != 5 or store.shape[1:3] != (rows_per_request, kv_heads) or store.shape[4] != dim:
            raise ValueError(
                f"{name} {store.shape} must be [_, R={rows_per_request}, G={kv_heads}, _, D={dim}]"
            )
    if cache_k.shape != cache_v.shape or source_k.shape != source_v.shape:
        raise ValueError(
            f"K and V stores must match: {cache_k.shape=} {cache_v.shape=} "
            f"{source_k.shape=} {source_v.shape=}"
        )
    if not _is_int(max_retained) or max_retained < 0:
        raise ValueError(f"max_retained={max_retained!r} must be an int >= 0")
    if query_window is not None and (not _is_int(query_window) or query_window < 1):
        raise ValueError(f"query_window={query_window!r} must be None or an int >= 1")
    max_retained = int(max_retained)
    query_window = None if query_window is None else int(query_window)
    if not jnp.issubdtype(table.dtype, jnp.integer):
        raise ValueError(f"table dtype {table.dtype} must be an integer type")
    dtype = jnp.dtype(q.dtype)
    if dtype not in SUPPORTED_DTYPES or any(
        jnp.dtype(x.dtype) != dtype for x in (k, v, cache_k, cache_v, source_k, source_v)
    ):
        raise NotImplementedError(
            f"TPU kernel needs q, k, v, caches and sources all float32 or all bfloat16; got q {dtype}, "
            f"k {k.dtype}, cache {cache_k.dtype}, source {source_k.dtype}"
        )
    if isinstance(table, np.ndarray):  # host tables are checked for free; device tables would sync
        retained = table[:, [tbl.read_len(i) for i in range(tbl.NUM_READS)]].sum(axis=1)
        if (retained > max_retained).any():
            raise ValueError(f"table retains up to {retained.max()} keys per row, past {max_retained=}")
    if n_rows == 0 or steps == 0:
        return jnp.zeros(q.shape, q.dtype)

    group = heads // kv_heads
    query_rows = steps * group
    blocks = block_sizes or BlockSizes.default(
        max_retained=max_retained, query_rows=query_rows, kv_heads=kv_heads, head_dim=dim,
        itemsize=dtype.itemsize, steps=steps, source_len=source_k.shape[3], slot_len=cache_k.shape[3],
    )  # fmt: skip
    block_q = query_rows if blocks.block_q is None or blocks.block_q >= query_rows else blocks.block_q
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)

    with jax.named_scope("sink_window_attention_tpu"):
        table = jnp.asarray(table, jnp.int32)
        # An empty store cannot be blocked; its read ranges are empty, so a one-entry stand-in is never read.
        if source_k.shape[0] == 0 or source_k.shape[3] == 0:
            source_k = source_v = jnp.zeros((1, rows_per_request, kv_heads, 1, dim), dtype)
        if cache_k.shape[0] == 0 or cache_k.shape[3] == 0:
            cache_k = cache_v = jnp.zeros((1, rows_per_request, kv_heads, 1, dim), dtype)
        source_len, slot_len = source_k.shape[3], cache_k.shape[3]
        # A store shorter than the block is one block equal to the full dim, legal on TPU at any length.
        block_source, block_slot = min(blocks.block_kv, source_len), min(blocks.block_kv, slot_len)
        # Distinct blocks m ranges of total length <= K can touch: ceil(K / block) + 2m - 1.
        source_steps = min(pl.cdiv(source_len, block_source), pl.cdiv(max_retained, block_source) + 3)
        slot_steps = min(pl.cdiv(slot_len, block_slot), pl.cdiv(max_retained, block_slot) + 5)
        source_ids = jnp.clip(table[:, tbl.SOURCE], 0, source_k.shape[0] - 1)
        slot_ids = jnp.clip(table[:, tbl.SLOT], 0, cache_k.shape[0] - 1)
        source_plan = _store_plan(
            table,
            tbl.SOURCE_READS,
            block_source,
            pl.cdiv(source_len, block_source),
            source_steps,
            source_ids,
            rows_per_request,
        )
        slot_plan = _store_plan(
            table,
            tbl.SLOT_READS,
            block_slot,
            pl.cdiv(slot_len, block_slot),
            slot_steps,
            slot_ids,
            rows_per_request,
        )
        # [S, R, G, C, D] -> [S * R, G, C, D] is free (leading dims merge) and leaves one index per row.
        source_k, source_v, cache_k, cache_v = (
            x.reshape(-1, *x.shape[2:]) for x in (source_k, source_v, cache_k, cache_v)
        )

        # Fold the H/G query heads of each KV head with the tokens: [N, G, T * H/G, D], token-major.
        q_folded = q.reshape(n_rows, steps, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
        q_folded = q_folded.reshape(n_rows, kv_heads, query_rows, dim)
        k_heads, v_heads = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [N, G, T, D]

        def store_index(blocks_at, entries_at, num_steps, first_step):
            def index(n, qb, step, *prefetch):
                block = prefetch[blocks_at][
                    lax.div(n, jnp.int32(rows_per_request)) * num_steps
                    + jnp.clip(step - first_step, 0, num_steps - 1)
                ]
                return prefetch[entries_at][n], 0, block, 0

            return index

        source_index = store_index(2, 3, source_steps, 0)
        slot_index = store_index(5, 6, slot_steps, source_steps)
        # Block shapes: every KV head (G is the full dim), then (block rows, D); block rows are multiples
        # of 8 (BlockSizes) or the full dim, and D is always the full dim, as TPU requires.
        in_specs = [
            pl.BlockSpec((None, kv_heads, block_q, dim), lambda n, qb, step, *_: (n, 0, qb, 0)),
            pl.BlockSpec((None, kv_heads, block_source, dim), source_index),
            pl.BlockSpec((None, kv_heads, block_source, dim), source_index),
            pl.BlockSpec((None, kv_heads, block_slot, dim), slot_index),
            pl.BlockSpec((None, kv_heads, block_slot, dim), slot_index),
            pl.BlockSpec((None, kv_heads, steps, dim), lambda n, qb, step, *_: (n, 0, 0, 0)),
            pl.BlockSpec((None, kv_heads, steps, dim), lambda n, qb, step, *_: (n, 0, 0, 0)),
        ]
        out_spec = pl.BlockSpec((None, kv_heads, block_q, dim), lambda n, qb, step, *_: (n, 0, qb, 0))
        grid = (n_rows, pl.cdiv(query_rows, block_q), source_steps + slot_steps + 1)
        kernel = functools.partial(
            _kernel,
            rows_per_request=rows_per_request,
            group=group,
            block_q=block_q,
            block_source=block_source,
            block_slot=block_slot,
            source_len=source_len,
            slot_len=slot_len,
            source_steps=source_steps,
            slot_steps=slot_steps,
            query_window=query_window,
            scale=scale,
        )
        keys_per_row = max_retained + steps
        itemsize = dtype.itemsize
        cost = pl.CostEstimate(
            flops=4 * n_rows * heads * steps * keys_per_row * dim,
            transcendentals=n_rows * heads * steps * keys_per_row,
            bytes_accessed=itemsize * (2 * q.size + 2 * k.size + 2 * n_rows * kv_heads * max_retained * dim),
        )
        vmem = _vmem_bytes(kv_heads, block_q, block_source, block_slot, steps, dim, itemsize)
        # Within every chip's default scoped limit, leave the compiler's choice; past it, ask for room.
        vmem_limit = None if vmem <= _SCOPED_VMEM_DEFAULT else int(vmem * 1.25) + 2**20
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(q_folded.shape, dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=8,
                grid=grid,
                in_specs=in_specs,
                out_specs=out_spec,
                scratch_shapes=[
                    pltpu.VMEM((kv_heads, block_q, 1), jnp.float32),
                    pltpu.VMEM((kv_heads, block_q, 1), jnp.float32),
                    pltpu.VMEM((kv_heads, block_q, dim), jnp.float32),
                ],
            ),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit
            ),
            interpret=interpret,
            name="sink_window_attention_tpu",
            cost_estimate=cost,
        )(
            table.reshape(-1),
            _read_ranges(table),
            *source_plan,
            *slot_plan,
            q_folded,
            source_k,
            source_v,
            cache_k,
            cache_v,
            k_heads,
            v_heads,
        )
        out = out.reshape(n_rows, kv_heads, steps, group, dim).transpose(0, 2, 1, 3, 4)
        return out.reshape(n_rows, steps, heads, dim)
