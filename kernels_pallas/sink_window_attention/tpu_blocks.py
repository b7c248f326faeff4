"""Tile sizes of the TPU kernel and the VMEM they cost, counted as Mosaic lays tiles out.

VMEM holds 2-D tiles of 8 sublanes x 128 lanes of 32 bits: a block's last dim is padded to a multiple of
128 lanes and its second-to-last to the sublane tile (8 rows of float32, 16 of bfloat16, which packs two
rows per sublane). A `[G, 1024, 64]` block therefore costs as much as `[G, 1024, 128]`, which is why
counting a 64-wide head dim as 64 lanes overflowed the scoped VMEM at head_dim 64 on v4, v5e and v5p.

Store orientation. TPU lays out an array with the dim that pads least to whole 128-lane tiles in lanes
(`tokens_in_lanes`): a `[.., C, D]` store keeps `D` in lanes when `D` is a multiple of 128, and mostly puts
`C` in lanes and `D` in sublanes otherwise (measured with libtpu on v4, v5e, v5p and v6e). A kernel operand
must be row-major, so where the tokens are in lanes the kernel reads the store as `[.., D, C]` (a free view
of that layout) rather than make XLA transpose the whole layer before every call. The bounded cache pads
its slots so that one of the two always holds (`store_capacity` in `mstar_jax.resources.kv.bounded.config`;
`[.., C, D]` with `C % 8 != 0` is also laid out with `G` and `C` swapped).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

SUBLANES = 8
LANES = 128
MAX_BLOCK_KV = 4096
# One grid step's VMEM, estimated by `vmem_bytes`, may use this much on every generation: v4 has 16 MiB of
# VMEM in all (libtpu refuses a 2,048-key decode block there, needing 19.6 MiB), and the default scoped
# limit is 16 MiB on v4 and v5e. The call states its own `vmem_limit_bytes`, the estimate plus headroom;
# the estimate over-counts (24.3 MiB where libtpu needs 19.6), which keeps the blocks it picks legal on v4.
VMEM_BUDGET = 16 * 2**20
# Headroom over the estimate for Mosaic's internal scratch and the index arithmetic's registers spilled.
_VMEM_HEADROOM = 4 * 2**20


def keys_in_lanes(head_dim: int) -> bool:
    """Whether the head dim fills whole lane tiles (`D % 128 == 0`): then TPU always keeps it in lanes."""
    return head_dim % LANES == 0


def tokens_in_lanes(shape: tuple[int, ...]) -> bool:
    """Whether TPU's default layout of a `[S, R, G, C, D]` store is the row-major `[S, R, G, D, C]`.

    TPU makes minor (lanes) the dim that pads least to whole 128-lane tiles, a tie going to the more minor
    dim: C, where it pads less than D (so never when D % 128 == 0) and no more than S, R and G. Measured
    with libtpu on v4, v5e, v5p and v6e (D in {32, 64, 80, 192}, C from 16 to 3004, S up to 1025); a slot
    count that pads less than a ragged C takes the lanes (S = 1025, C = 300).
    """
    *major, capacity, dim = shape

    def padding(n: int) -> float:
        return -(-n // LANES) * LANES / max(n, 1)

    return padding(capacity) < padding(dim) and all(padding(capacity) <= padding(n) for n in major)


def sublane_tile(itemsize: int) -> int:
    """Rows per VMEM tile: 8 of 32 bits, more for packed narrower types (16 bfloat16)."""
    return SUBLANES * max(1, 4 // itemsize)


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """VMEM bytes of a `[rows, cols]` array: rows padded to the sublane tile, cols to 128 lanes."""
    return (
        pl.cdiv(rows, sublane_tile(itemsize))
        * sublane_tile(itemsize)
        * pl.cdiv(cols, LANES)
        * LANES
        * itemsize
    )


def vmem_bytes(
    *,
    kv_heads: int,
    block_q: int,
    block_source: int,
    block_slot: int,
    steps: int,
    head_dim: int,
    itemsize: int,
    transposed: tuple[bool, bool] = (False, False),
    rel_bias: bool = False,
    sink_logits: bool = False,
) -> int:
    """VMEM of one grid step: double-buffered blocks, f32 scratch and the score temporaries, as tiled.

    `transposed` says, for the source bank and the slots, whether the store is read as `[.., D, C]`;
    `rel_bias` and `sink_logits` whether the call carries them (f32 blocks beside the queries').
    """

    def heads(rows: int, cols: int, size: int = itemsize) -> int:
        return kv_heads * tile_bytes(rows, cols, size)

    def store(block: int, tokens_in_lanes: bool) -> int:
        return heads(head_dim, block) if tokens_in_lanes else heads(block, head_dim)

    source, slot = store(block_source, transposed[0]), store(block_slot, transposed[1])

    widest = max(block_source, block_slot, steps)
    buffers = 2 * 2 * (source + slot + heads(steps, head_dim) + heads(block_q, head_dim))
    if rel_bias:  # one f32 bias block per phase, its lanes padded to the tile as any block's
        buffers += 2 * sum(heads(block_q, keys, 4) for keys in (block_source, block_slot, steps))
    if sink_logits:
        buffers += 2 * heads(block_q, 1, 4)
    scratch = 2 * heads(block_q, 1, 4) + heads(block_q, head_dim, 4)
    # scores, probabilities and mask in f32, probabilities cast for the value dot, values with masked zeros
    temporaries = 3 * heads(block_q, widest, 4) + heads(block_q, widest) + max(source, slot)
    if rel_bias:  # the bias block sliced to the keys, and the biased scores
        temporaries += 2 * heads(block_q, widest, 4)
    return buffers + scratch + temporaries


def vmem_limit_bytes(estimate: int) -> int:
    """The `vmem_limit_bytes` a call with `estimate` bytes of VMEM asks for."""
    return estimate + _VMEM_HEADROOM


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockSizes:
    """Tile sizes of the TPU kernel.

    Attributes:
      block_kv: retained keys per grid step and store. A multiple of 8 (the sublane tile) when the head
        dim is in lanes; when the stores are read transposed (head dim not a multiple of 128) keys are in
        lanes and the kernel rounds the block up to a multiple of 128. A store shorter than the block is
        taken whole, which TPU allows because the block then equals the dim.
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
        transposed: tuple[bool, bool] = (False, False),
        vmem_budget: int = VMEM_BUDGET,
        rel_bias: bool = False,
        sink_logits: bool = False,
    ) -> BlockSizes:
        """Blocks for `max_retained` keys and `query_rows = T * H/G` folded queries per KV head.

        Decode is HBM-bound and each grid step has a fixed cost, so the key block is as large as
        `max_retained` needs (a power of two, 128 to 4096) while `vmem_bytes` stays within `vmem_budget`;
        for very wide K/V rows it shrinks below 128 (down to 16) unless a store is read transposed (keys in
        lanes; `transposed` as for `vmem_bytes`). A store shorter than the block is taken whole, so
        `source_len` and `slot_len` (L and C; None counts a full block) let a short source bank leave its
        VMEM to longer slot blocks. The query block caps the f32 accumulator at 512 rows of `D` floats
        summed over the G KV heads. `rel_bias` and `sink_logits` count their blocks as `vmem_bytes` does.
        """
        rows_cap = max(16, 512 // max(kv_heads, 1) // 16 * 16)
        block_q = None if query_rows <= rows_cap else rows_cap
        q_rows = query_rows if block_q is None else block_q
        block_kv = min(MAX_BLOCK_KV, max(LANES, pl.next_power_of_2(max(max_retained, 1))))
        smallest = LANES if any(transposed) else 16

        def vmem(block: int) -> int:
            source = block if source_len is None else max(1, min(block, source_len))
            slot = block if slot_len is None else max(1, min(block, slot_len))
            return vmem_bytes(
                kv_heads=kv_heads, block_q=q_rows, block_source=source, block_slot=slot, steps=steps,
                head_dim=head_dim, itemsize=itemsize, transposed=transposed, rel_bias=rel_bias,
                sink_logits=sink_logits,
            )  # fmt: skip

        while block_kv > smallest and vmem(block_kv) > vmem_budget:
            block_kv //= 2
        return cls(block_kv=block_kv, block_q=block_q)


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tiles:
    """The blocks one call uses and the VMEM it asks for.

    Attributes:
      block_q: folded query rows per grid step.
      block_source, block_slot: keys per grid step in each store (at most the store's length).
      vmem_limit_bytes: the scoped VMEM the call asks for: `vmem_bytes` of these blocks plus headroom.
    """

    block_q: int
    block_source: int
    block_slot: int
    vmem_limit_bytes: int


def choose_tiles(
    *,
    max_retained: int,
    steps: int,
    group: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    source_len: int,
    slot_len: int,
    transposed: tuple[bool, bool],
    block_sizes: BlockSizes | None = None,
    rel_bias: bool = False,
    sink_logits: bool = False,
) -> Tiles:
    """The tiles of a call: `block_sizes` (or `BlockSizes.default`) fitted to the stores' lengths.

    Keys lie in sublanes (blocks of 8 rows) or, for a store read transposed (`transposed`: source bank,
    slots), in lanes, where its block is rounded up to 128; a store shorter than the block is one block
    equal to the full dim, legal on TPU at any length. `rel_bias` and `sink_logits` say whether the call
    carries them.
    """
    query_rows = steps * group
    blocks = block_sizes or BlockSizes.default(
        max_retained=max_retained, query_rows=query_rows, kv_heads=kv_heads, head_dim=head_dim,
        itemsize=itemsize, steps=steps, source_len=source_len, slot_len=slot_len, transposed=transposed,
        rel_bias=rel_bias, sink_logits=sink_logits,
    )  # fmt: skip
    block_q = query_rows if blocks.block_q is None else min(blocks.block_q, query_rows)

    def block(store_len: int, tokens_in_lanes: bool) -> int:
        keys = pl.cdiv(blocks.block_kv, LANES) * LANES if tokens_in_lanes else blocks.block_kv
        return min(keys, store_len)

    block_source, block_slot = block(source_len, transposed[0]), block(slot_len, transposed[1])
    vmem = vmem_bytes(
        kv_heads=kv_heads, block_q=block_q, block_source=block_source, block_slot=block_slot, steps=steps,
        head_dim=head_dim, itemsize=itemsize, transposed=transposed, rel_bias=rel_bias,
        sink_logits=sink_logits,
    )  # fmt: skip
    return Tiles(
        block_q=block_q,
        block_source=block_source,
        block_slot=block_slot,
        vmem_limit_bytes=vmem_limit_bytes(vmem),
    )
