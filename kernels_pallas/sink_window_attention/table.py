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

The helpers at the end are the table's arithmetic, shared by the reference and the kernels. They take the
array namespace (`numpy`, `jax.numpy`) from the caller, so this module imports neither and the same code
runs in the float64 oracle, in XLA and inside a Pallas kernel body.
"""

from types import ModuleType
from typing import Any

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
SOURCE_READS = tuple(i for i, s in enumerate(READ_FROM_SOURCE) if s)  # (0, 2): read from the source bank
SLOT_READS = tuple(i for i, s in enumerate(READ_FROM_SOURCE) if not s)  # (1, 3, 4): read from the slot
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


def retained_position(j: Any, sink_kept: Any, window_start: Any, *, xp: ModuleType) -> Any:
    """Stream position of retained key `j`: `j` inside the sink, else `WINDOW_START + (j - SINK_KEPT)`.

    Args:
      j: integer array (any shape) of indices into a row's retained list.
      sink_kept: the row's `SINK_KEPT`, broadcastable against `j`.
      window_start: the row's `WINDOW_START`, broadcastable against `j`.
      xp: the array namespace providing `where` (`numpy` or `jax.numpy`).

    Returns:
      Integer array of `j`'s broadcast shape.
    """
    return xp.where(j < sink_kept, j, window_start + (j - sink_kept))


def query_window_visible(key_pos: Any, query_pos: Any, sink: Any, query_window: int) -> Any:
    """Whether a query sees a key under a query window: causal, and a sink or one of the last `query_window`.

    Only comparisons and `&` / `|`, so any array type (or plain ints) works; shapes broadcast.

    Args:
      key_pos: integer array of key stream positions.
      query_pos: integer array of query stream positions.
      sink: the row's `SINK` (positions below it stay visible to every later query).
      query_window: the band, >= 1: a query at `p` sees keys in `(p - query_window, p]` and the sinks.

    Returns:
      bool array of the broadcast shape.
    """
    return (key_pos <= query_pos) & ((key_pos < sink) | (key_pos > query_pos - query_window))
