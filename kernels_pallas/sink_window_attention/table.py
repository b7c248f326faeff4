"""The plan table: the one contract between host planning and the attention kernels.

Shape legend (used across `kernels_pallas.sink_window_attention`):
  B requests (table rows), R rows per request, N = B * R attention rows, T step tokens,
  H query heads, G KV heads (H % G == 0), D head dim, S slots, C slot tokens,
  V sources, L max source length, K max retained keys. Ranges are start-inclusive, end-exclusive.

Each request owns one int32 row of `ROW_INTS` columns. Let `n = source_len + written` be the stream's
length before the step, `(sink, window)` its retention and `W` the window the step reads
(`window - span` when the window includes the step). The retained positions are
`[0, SINK_KEPT) ∪ [WINDOW_START, STREAM_LEN)`, attended in stream order, so retained key `j` sits at
stream position `j` when `j < SINK_KEPT`, else `WINDOW_START + (j - SINK_KEPT)`.

They are read through five ranges, concatenated in this order (the retained list):

  read 0  source  [start, start + len)   the sink's part inside the source
  read 1  slot    [start, start + len)   the sink's written part (slot offsets)
  read 2  source  [start, start + len)   the window's part still inside the source
  read 3  slot    [start, start + len)   the ring, up to its end
  read 4  slot    [start, start + len)   the ring after the wrap

Slot ranges are offsets into the slot's `C` tokens; source ranges are positions in the source.

Three write ranges store the step's first `span` tokens after attention:
`(step_offset, slot_start, len)` copies step tokens `step_offset + t` (or `step_offset - t` when the
config's `reverse_step_order` is set) to slot offsets `slot_start + t` for `t < len`.

A padding row has every range empty and `STEP_TOKENS == 0`: it reads and writes nothing.
"""

SLOT = 0  # slot index into the cache's S axis
SOURCE = 1  # source index into the bank's V axis
STREAM_LEN = 2  # n: stream entries before the step; step token i sits at position n + i
SINK = 3  # the policy's sink: positions < SINK stay visible to every query under a query window
SINK_KEPT = 4  # min(sink, n): how many retained keys belong to the sink
WINDOW_START = 5  # max(sink, n - W): stream position of the first window key
STEP_TOKENS = 6  # real step tokens (keys and queries) of the row; the rest is bucket padding
READS = 7  # five (start, len) pairs, see the module docstring
NUM_READS = 5
READ_FROM_SOURCE = (True, False, True, False, False)
WRITES = READS + 2 * NUM_READS  # three (step_offset, slot_start, len) triples
NUM_WRITES = 3
ROW_INTS = WRITES + 3 * NUM_WRITES


def read_start(i: int) -> int:
    """Column of read range `i`'s start."""
    return READS + 2 * i


def read_len(i: int) -> int:
    """Column of read range `i`'s length."""
    return READS + 2 * i + 1


def write_cols(i: int) -> tuple[int, int, int]:
    """Columns of write range `i`: (step_offset, slot_start, len)."""
    base = WRITES + 3 * i
    return base, base + 1, base + 2
