"""Tile sizes and launch settings of the Pallas GPU (Triton) sink+window attention kernel.

Shape legend: see `kernels_pallas.sink_window_attention.table`; DP is the head dim padded to a power of two.
"""

import dataclasses

# Triton's tensor-core dot needs every operand dimension >= 16.
MIN_DOT_DIM = 16
# float32 tiles keep block_q * block_k * DP within this (see `BlockSizes.default`).
F32_DOT_VOLUME = 2**17
# A decode-shaped step splits its walk until each row has about this many programs over its KV heads
# (`BlockSizes.split_keys`), each walking at least DECODE_SPLIT_KEYS keys.
DECODE_PROGRAMS_PER_ROW = 8
DECODE_SPLIT_KEYS = 128


def is_power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_power_of_two(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockSizes:
    """Tile sizes and launch settings of the GPU kernel.

    Attributes:
      block_q: query rows per program (step tokens × the query heads of one KV head); a power of two.
      block_k: keys per inner-loop step; a power of two.
      num_warps: warps per program (Triton launch setting).
      num_stages: software-pipelining stages of the key loops (Triton launch setting).
      split_keys: None, or the retained keys each program walks when a step's query rows per KV head fit
        one `block_q` tile (a decode step): the walk is cut into ceil(K / split_keys) programs whose
        softmax states XLA then merges in a fixed order (flash-decoding), so a row's rounding depends on
        K and the tiles, never on the batch. A positive multiple of `block_k`. None: one program walks
        every key of its row.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    split_keys: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or not is_power_of_two(value):
                raise ValueError(f"BlockSizes.{name}={value!r} must be a positive power of two")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{name}={value!r} must be an int >= 1")
        split = self.split_keys
        if split is not None and (
            not isinstance(split, int) or isinstance(split, bool) or split < 1 or split % self.block_k
        ):
            raise ValueError(
                f"BlockSizes.split_keys={split!r} must be None or a positive multiple of "
                f"block_k={self.block_k}"
            )

    @classmethod
    def default(
        cls, *, query_rows: int, head_dim: int, max_retained: int, kv_heads: int, itemsize: int = 2
    ) -> "BlockSizes":
        """Default tiles for `query_rows = T * (H / G)` query rows per KV head.

        Small problems get small tiles (a decode step of 4 grouped heads needs 16 rows, not 128); keys are
        never blocked past the padded key count. The rule keys on DP (the head dim padded to a power of
        two: D 80 and 96 build like 128) and the dtype, and was read off `ptxas -v` for sm_90a
        (`mstar_jax.compile.offline_gpu`, 270 cases: D 64-256 × GQA 1/4/8 × decode and prefill chunks
        with and without a query window × K 32-8192; `tests/kernels/test_gpu_offline.py` keeps to it)
        and timed on an H200 (`benchmarks/kernel.py --sweep`, `docs/guides/benchmarks.md`):

        * 16-bit dtypes (tensor-core dots): block_q <= 64, block_k 64 (32 at DP 256), 2 stages, 8 warps
          once block_q * DP >= 4096, else 4. No spills; at most 224 registers (DP 256, [64, 32]) and
          128 KiB of shared memory. 4 warps spilled at DP 128 [64, 64] and DP 256 [64, 32], and hit
          255 registers at DP 128 [32, 64] and DP 256 [16, 32].
        * float32 (HIGHEST precision runs the dots on FMA units: a thread holds its share of both operands
          over the whole contraction, so registers grow with block_q * block_k * DP / warps): 1 stage,
          16 warps, block_q <= 4096 / DP and block_q * block_k * DP <= 2**17. No spills; at most 102
          registers (of 128 at 16 warps) and 80 KiB of shared memory. The 16-bit tiles with 2 stages
          spilled in all float32 cases but one (0.6-56 KB of spill stores) and took up to 256 KiB.
          A step of at most 16 query rows per KV head (decode) takes [16, 32] at 8 warps: no spills
          at D 64-256, split or not (at most 144 registers), where [16, 16] at 8 warps spilled 24 B
          (D 256) and 4 warps spilled at D 128 and 256. On the H200, Gemma 3's decode tile (8 rows,
          512 keys, D 256) ran in 81 µs so, against 192 µs at 16 warps; 2 stages ran 2-5× slower.
          A larger decode-shaped tile (17-64 rows at small DP) keeps 16 warps, split at half the key
          block: with both score terms, a split [16, 64] at D 128 and 16 warps spilled 40 B, [16, 32]
          none.
        * A decode-shaped step (query rows within one `block_q` tile) is split (flash-decoding) when its
          row has fewer than `DECODE_PROGRAMS_PER_ROW` KV heads: into that many programs over its KV
          heads, each walking at least `DECODE_SPLIT_KEYS` keys (and whole key blocks). On the H200:
          unsplit, Gemma 3 270M's decode of 8 rows (one KV head) ran a grid of 8 programs, each walking
          its row's 512-576 keys alone, 356 µs a layer, and split it ran 1.8× more tokens/s; but 128
          rows of 8 KV heads (1,024 programs) streamed 0.70 of copy bandwidth unsplit and 0.56 split
          128 keys a program. The split depends on G, K and the tiles, never on the batch.

        Args:
          query_rows: query rows per KV head, T * H/G.
          head_dim: D.
          max_retained: K.
          kv_heads: G.
          itemsize: bytes per element of the inputs (2: bfloat16 or float16; 4: float32).
        """
        padded_dim = max(next_power_of_two(head_dim), MIN_DOT_DIM)
        block_q = max(next_power_of_two(query_rows), MIN_DOT_DIM)
        max_keys = max(next_power_of_two(max_retained), MIN_DOT_DIM)
        if itemsize >= 4:
            block_q = min(block_q, max(MIN_DOT_DIM, 4096 // padded_dim))
            decode = query_rows <= block_q
            if query_rows <= MIN_DOT_DIM:  # one 16-row tile: 8 warps, 32 keys (see above)
                block_k, num_warps = min(32, max_keys), 8
            else:
                block_k, num_warps = min(64, F32_DOT_VOLUME // (block_q * padded_dim), max_keys), 16
            num_stages = 1
        else:
            block_q = min(block_q, 64)
            decode = query_rows <= block_q
            block_k = min(32 if padded_dim > 128 else 64, max_keys)
            num_warps, num_stages = (8 if block_q * padded_dim >= 4096 else 4), 2
        split_keys = None
        splits = -(-DECODE_PROGRAMS_PER_ROW // max(kv_heads, 1))
        if decode and splits > 1:
            per_split = -(-max_retained // splits)
            split_keys = max(DECODE_SPLIT_KEYS, block_k, -(-per_split // block_k) * block_k)
            if max_retained <= split_keys:
                split_keys = None
        if split_keys and num_warps == 16:  # a split's bounds and sink seed cost registers: half the keys
            block_k = max(MIN_DOT_DIM, block_k // 2)
        return cls(
            block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
            split_keys=split_keys,
        )  # fmt: skip
