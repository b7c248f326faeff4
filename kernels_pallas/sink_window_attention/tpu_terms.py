"""The optional score terms of the TPU kernel, laid out with jnp before the call in the kernel's own walk.

`rel_bias [N, H, T, RB]` is indexed by each key's place in `retained ++ step keys`, which a store block
does not hold in order (a slot block may end the ring and begin it again). Mosaic has no lane gather, so
the kernel does not look the columns up: each phase gets the bias already gathered in its walk order,
`[N, G, T * H/G, steps * lanes]` (the queries' fold, see `tpu`), whose block for walk step `s` lies under
the store block that step reads. It holds a column per key the walk passes, about as many as `rel_bias`
has (`RB >= K + 2T - 1`; more where the last block of a store is mostly past its reads). The gather moves
all heads per index, and its output and index are tile-padded: compiled by libtpu, the temporaries come
to 0.26 to 5.75 times `rel_bias`'s bytes over the serving geometries of `benchmarks.accelerators
--score-terms` (v5p the most). An in-kernel rel-shift would need none of it, and lane gathers Mosaic
does not offer.

Shape legend: see `kernels_pallas.sink_window_attention.table`.
"""

import jax
import jax.numpy as jnp

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.tpu_blocks import LANES
from kernels_pallas.sink_window_attention.xla import rel_bias_at


def walk_lanes(block: int, num_steps: int) -> int:
    """Lanes of one walk step's bias block: the key block, or (when that is neither the whole walk nor a
    whole number of lane tiles) rounded up to 128, which a TPU block needs."""
    return block if num_steps == 1 or block % LANES == 0 else -(-block // LANES) * LANES


def _walk_bias(
    rel_bias: jax.Array, key_index: jax.Array, table: jax.Array, kv_heads: int, rows_per_request: int
):
    """f32[N, G, T * H/G, W] of `rel_bias` under keys `key_index` (i32[B, W], one list per request)."""
    key_index = jnp.repeat(key_index, rows_per_request, axis=0)
    retained = jnp.repeat(tbl.retained_count(table), rows_per_request)
    bias = rel_bias_at(rel_bias, key_index, retained, kv_heads)  # [N, G, T, H/G, W]: the fold, unmerged
    return bias.reshape(*bias.shape[:2], -1, bias.shape[-1])


def store_walk_bias(
    rel_bias: jax.Array,
    table: jax.Array,
    reads: tuple[int, ...],
    blocks: jax.Array,
    *,
    block: int,
    num_steps: int,
    kv_heads: int,
    rows_per_request: int,
) -> jax.Array:
    """f32[N, G, T * H/G, num_steps * lanes]: the bias under every key of one store's walk.

    Args:
      rel_bias: [N, H, T, RB].
      table: i32[B, ROW_INTS].
      reads: the read ranges in this store.
      blocks: i32[B * num_steps], the store blocks each request walks (`tpu_plan.store_plan`).
      block, num_steps: the store's key block and walk steps; lanes per step: `walk_lanes`.
      kv_heads, rows_per_request: G and R.
    """
    lanes = walk_lanes(block, num_steps)
    u = jnp.arange(lanes, dtype=jnp.int32)[None, None, :]
    offset = blocks.reshape(-1, num_steps, 1) * block + u  # [B, steps, lanes]: store offsets
    key_index = jnp.zeros(offset.shape, jnp.int32)
    prefix = jnp.zeros(table.shape[:1], jnp.int32)  # retained index of range i's first key
    for i in range(tbl.NUM_READS):
        start, length = table[:, tbl.read_start(i)][:, None, None], table[:, tbl.read_len(i)]
        if i in reads:
            inside = (u < block) & (offset >= start) & (offset < start + length[:, None, None])
            key_index = jnp.where(inside, offset - start + prefix[:, None, None], key_index)
        prefix = prefix + length
    key_index = key_index.reshape(table.shape[0], -1)
    return _walk_bias(rel_bias, key_index, table, kv_heads, rows_per_request)


def own_bias(rel_bias: jax.Array, table: jax.Array, *, kv_heads: int, rows_per_request: int) -> jax.Array:
    """f32[N, G, T * H/G, T]: the bias under the step's own keys (key `t` is `retained + t`)."""
    steps = rel_bias.shape[2]
    key_index = tbl.retained_count(table)[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    return _walk_bias(rel_bias, key_index, table, kv_heads, rows_per_request)


def folded_sinks(sink_logits: jax.Array, *, kv_heads: int, steps: int) -> jax.Array:
    """f32[G, T * H/G, 1]: each folded query row's sink logit (row `t * H/G + h'` is head `g * H/G + h'`)."""
    per_kv_head = sink_logits.astype(jnp.float32).reshape(kv_heads, 1, -1)  # [G, 1, H/G]
    return jnp.tile(per_kv_head, (1, steps, 1)).reshape(kv_heads, -1, 1)
