"""Pallas TPU (Mosaic) sink+window attention: the wrapper that plans the key walk and calls the kernel.

The kernel body is `tpu_kernel`, its tiles and VMEM budget `tpu_blocks`, the per-row block lists
`tpu_plan`. Every grid step handles all `G` KV heads of its key block: one DMA moves `[G, block, D]` of K
(and of V), as in MaxText's ragged attention and JAX's ragged paged attention.

Neither store is copied: each phase has its own BlockSpec over the store as it lies in HBM (in TPU's
default layout for it, see `tpu_blocks`), and its index map reads a per-request list of the store blocks
the plan table touches (built with jnp before the call, scalar-prefetched into SMEM with the table). Steps
past a row's useful blocks repeat the last useful block index, so the pipeline issues no DMA, and `pl.when`
skips their compute (MaxText `ragged_mqa`). A row that touches no block of a store (a padding row, a row
without a source) keeps pointing at the block the previous row left in that buffer, so it issues no DMA
either (before any row has touched a store, its buffer holds block 0 of entry 0: fetched once, never
attended).

Why BlockSpecs and not manual DMA from `pl.ANY` refs: the Pallas pipeline double-buffers, clips the last
partial block of a store whose length is not a multiple of the block, and is exactly what both interpret
modes simulate; manual DMA would need hand-written double buffering and start clamping for the same effect.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.tpu_blocks import (
    SUBLANES,
    SUPPORTED_DTYPES,
    BlockSizes,
    choose_tiles,
    tokens_in_lanes,
)
from kernels_pallas.sink_window_attention.tpu_kernel import sink_window_kernel
from kernels_pallas.sink_window_attention.tpu_plan import read_ranges, store_plan
from kernels_pallas.sink_window_attention.tpu_terms import folded_sinks, own_bias, store_walk_bias, walk_lanes
from kernels_pallas.sink_window_attention.validate import validate_inputs

__all__ = ["BlockSizes", "sink_window_attention_tpu"]


def _blockable(store: jax.Array) -> jax.Array:
    """The store, or (empty) one never-read tile, or (shorter than a sublane tile) padded to one tile.

    Such stores are tiny, and Mosaic's dots take no blocks of a single row.
    """
    num, rows, heads, length, dim = store.shape
    if num == 0:
        return jnp.zeros((1, rows, heads, SUBLANES, dim), store.dtype)
    if length < SUBLANES:
        return jnp.pad(store, ((0, 0),) * 3 + ((0, SUBLANES - length), (0, 0)))
    return store


def _store_operand(store: jax.Array, transposed: bool, interpret) -> jax.Array:
    """[S, R, G, C, D] -> [S * R, G, C, D], or [S * R, G, D, C] when `transposed` (tokens in lanes), in HBM.

    Chosen by `tokens_in_lanes`, either is a view of the store as TPU lays it out, so XLA inserts no copy.
    The store is pinned to HBM: where a layer fits in VMEM (128 MiB on v5e and v6e), XLA's memory-space
    assignment would otherwise move the whole layer into VMEM and back around the kernels every step.
    """
    store = store.reshape(-1, *store.shape[2:])
    store = jnp.swapaxes(store, 2, 3) if transposed else store
    # Interpret mode refuses the pin (a Pallas TPU primitive); a JAX without it leaves the choice to XLA.
    pin = getattr(pltpu, "with_memory_space_constraint", None)
    return store if interpret or pin is None else pin(store, pltpu.HBM)


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
    rel_bias: jax.Array | None = None,
    sink_logits: jax.Array | None = None,
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
      rel_bias: None or [N, H, T, RB], the per-distance term (see `table`), laid out for the key walk
        before the call (`tpu_terms`).
      sink_logits: None or [H], learned sink logits seeding each query row's softmax.
      block_sizes: tile sizes; defaults to `BlockSizes.default(...)`.
      interpret: False on TPU; True (HLO interpreter) or `pltpu.InterpretParams(...)` on CPU.

    Returns:
      [N, T, H, D] in q's dtype.

    Raises:
      ValueError: inconsistent shapes or settings.
      NotImplementedError: dtypes this kernel does not handle (the public op falls back to XLA).
    """
    validate_inputs(
        q, k, v, cache_k, cache_v, source_k, source_v, table,
        max_retained=max_retained, query_window=query_window, scale=scale,
        rel_bias=rel_bias, sink_logits=sink_logits,
    )  # fmt: skip
    dtype = jnp.dtype(q.dtype)  # validate_inputs made every array share it
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"the TPU kernel supports float32 and bfloat16 inputs; got {dtype}")
    max_retained = int(max_retained)
    query_window = None if query_window is None else int(query_window)
    n_rows, steps, heads, dim = q.shape
    if n_rows == 0 or steps == 0:
        return jnp.zeros(q.shape, q.dtype)
    kv_heads = k.shape[2]
    rows_per_request = cache_k.shape[1]
    group = heads // kv_heads
    query_rows = steps * group
    source_k, source_v, cache_k, cache_v = map(_blockable, (source_k, source_v, cache_k, cache_v))
    num_sources, source_len = source_k.shape[0], source_k.shape[3]
    num_slots, slot_len = cache_k.shape[0], cache_k.shape[3]
    transposed = (tokens_in_lanes(source_k.shape), tokens_in_lanes(cache_k.shape))
    tiles = choose_tiles(
        max_retained=max_retained, steps=steps, group=group, kv_heads=kv_heads, head_dim=dim,
        itemsize=dtype.itemsize, source_len=source_len, slot_len=slot_len, transposed=transposed,
        block_sizes=block_sizes, rel_bias=rel_bias is not None, sink_logits=sink_logits is not None,
    )  # fmt: skip
    block_q, block_source, block_slot = tiles.block_q, tiles.block_source, tiles.block_slot
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)

    with jax.named_scope("sink_window_attention_tpu"):
        table = jnp.asarray(table, jnp.int32)
        # Distinct blocks m ranges of total length <= K can touch: ceil(K / block) + 2m - 1.
        source_steps = min(pl.cdiv(source_len, block_source), pl.cdiv(max_retained, block_source) + 3)
        slot_steps = min(pl.cdiv(slot_len, block_slot), pl.cdiv(max_retained, block_slot) + 5)
        source_ids = jnp.clip(table[:, tbl.SOURCE], 0, num_sources - 1)
        slot_ids = jnp.clip(table[:, tbl.SLOT], 0, num_slots - 1)
        source_plan = store_plan(
            table, tbl.SOURCE_READS, block_source, pl.cdiv(source_len, block_source), source_steps,
            source_ids, rows_per_request,
        )  # fmt: skip
        slot_plan = store_plan(
            table, tbl.SLOT_READS, block_slot, pl.cdiv(slot_len, block_slot), slot_steps, slot_ids,
            rows_per_request,
        )  # fmt: skip
        source_k, source_v = (_store_operand(x, transposed[0], interpret) for x in (source_k, source_v))
        cache_k, cache_v = (_store_operand(x, transposed[1], interpret) for x in (cache_k, cache_v))

        # Fold the H/G query heads of each KV head with the tokens: [N, G, T * H/G, D], token-major.
        q_folded = q.reshape(n_rows, steps, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
        q_folded = q_folded.reshape(n_rows, kv_heads, query_rows, dim)
        k_heads, v_heads = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [N, G, T, D]

        def store_index(blocks_at, entries_at, num_steps, first_step, tokens_in_lanes):
            def index(n, qb, step, *prefetch):
                block = prefetch[blocks_at][
                    lax.div(n, jnp.int32(rows_per_request)) * num_steps
                    + jnp.clip(step - first_step, 0, num_steps - 1)
                ]
                entry = prefetch[entries_at][n]
                return (entry, 0, 0, block) if tokens_in_lanes else (entry, 0, block, 0)

            return index

        def store_spec(block, index, tokens_in_lanes):
            shape = (dim, block) if tokens_in_lanes else (block, dim)
            return pl.BlockSpec((None, kv_heads, *shape), index)

        source_index = store_index(2, 3, source_steps, 0, transposed[0])
        slot_index = store_index(5, 6, slot_steps, source_steps, transposed[1])
        # Block shapes: every KV head (G is the full dim), then the key and head dims; key blocks are
        # multiples of the tile (8 rows or 128 lanes) or the full dim, and D is always the full dim.
        per_row = lambda n, qb, step, *_: (n, 0, 0, 0)  # noqa: E731
        in_specs = [
            pl.BlockSpec((None, kv_heads, block_q, dim), lambda n, qb, step, *_: (n, 0, qb, 0)),
            store_spec(block_source, source_index, transposed[0]),
            store_spec(block_source, source_index, transposed[0]),
            store_spec(block_slot, slot_index, transposed[1]),
            store_spec(block_slot, slot_index, transposed[1]),
            pl.BlockSpec((None, kv_heads, steps, dim), per_row),
            pl.BlockSpec((None, kv_heads, steps, dim), per_row),
        ]
        operands = [q_folded, source_k, source_v, cache_k, cache_v, k_heads, v_heads]
        if rel_bias is not None:
            operands += _rel_bias_operands(
                rel_bias, table, (source_plan[0], slot_plan[0]), (block_source, block_slot),
                (source_steps, slot_steps), kv_heads, rows_per_request,
            )  # fmt: skip
            in_specs += _rel_bias_specs(
                kv_heads, block_q, steps, (block_source, block_slot), (source_steps, slot_steps),
                rows_per_request,
            )  # fmt: skip
        if sink_logits is not None:
            operands.append(folded_sinks(sink_logits, kv_heads=kv_heads, steps=steps))
            in_specs.append(pl.BlockSpec((kv_heads, block_q, 1), lambda n, qb, step, *_: (0, qb, 0)))
        out_spec = pl.BlockSpec((None, kv_heads, block_q, dim), lambda n, qb, step, *_: (n, 0, qb, 0))
        grid = (n_rows, pl.cdiv(query_rows, block_q), source_steps + slot_steps + 1)
        kernel = functools.partial(
            sink_window_kernel, rows_per_request=rows_per_request, group=group, block_q=block_q,
            block_source=block_source, block_slot=block_slot, source_len=source_len, slot_len=slot_len,
            source_steps=source_steps, slot_steps=slot_steps, transposed=transposed,
            query_window=query_window, scale=scale, rel_bias=rel_bias is not None,
            sink_logits=sink_logits is not None,
        )  # fmt: skip
        keys_per_row = max_retained + steps
        itemsize = dtype.itemsize
        cost = pl.CostEstimate(
            flops=4 * n_rows * heads * steps * keys_per_row * dim,
            transcendentals=n_rows * heads * steps * keys_per_row,
            bytes_accessed=itemsize * (2 * q.size + 2 * k.size + 2 * n_rows * kv_heads * max_retained * dim)
            + 4 * sum(x.size for x in operands[7:]),
        )
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
                dimension_semantics=("parallel", "parallel", "arbitrary"),
                vmem_limit_bytes=tiles.vmem_limit_bytes,
            ),
            interpret=interpret,
            name="sink_window_attention_tpu",
            cost_estimate=cost,
        )(table.reshape(-1), read_ranges(table), *source_plan, *slot_plan, *operands)
        out = out.reshape(n_rows, kv_heads, steps, group, dim).transpose(0, 2, 1, 3, 4)
        return out.reshape(n_rows, steps, heads, dim)


def _rel_bias_operands(rel_bias, table, blocks, block, num_steps, kv_heads, rows_per_request):
    """The source, slot and own bias operands, each laid out for its phase of the walk (`tpu_terms`)."""
    stores = zip((tbl.SOURCE_READS, tbl.SLOT_READS), blocks, block, num_steps, strict=True)
    options = {"kv_heads": kv_heads, "rows_per_request": rows_per_request}
    walks = [
        store_walk_bias(rel_bias, table, reads, of, block=b, num_steps=s, **options)
        for reads, of, b, s in stores
    ]
    return [*walks, own_bias(rel_bias, table, **options)]


def _rel_bias_specs(kv_heads, block_q, steps, block, num_steps, rows_per_request):
    """BlockSpecs of the bias operands: a phase's block follows its walk step and holds once the row's
    useful blocks are done (the counts are scalar-prefetched 5th and 8th), so skipped steps move nothing."""

    def phase_index(first_step, counts_at):
        def index(n, qb, step, *prefetch):
            count = prefetch[counts_at][lax.div(n, jnp.int32(rows_per_request))]
            return n, 0, qb, jnp.clip(step - first_step, 0, jnp.maximum(count - 1, 0))

        return index

    source_lanes, slot_lanes = (walk_lanes(b, s) for b, s in zip(block, num_steps, strict=True))
    return [
        pl.BlockSpec((None, kv_heads, block_q, source_lanes), phase_index(0, 4)),
        pl.BlockSpec((None, kv_heads, block_q, slot_lanes), phase_index(num_steps[0], 7)),
        pl.BlockSpec((None, kv_heads, block_q, steps), lambda n, qb, step, *_: (n, 0, qb, 0)),
    ]
