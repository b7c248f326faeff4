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

Two optional score terms ride on this order. `rel_bias [N, H, T, RB]` (Transformer-XL's per-distance
bias, as in the original engine) adds `rel_bias[n, h, i, (retained + i) - j + T - 1]` to the raw score of
query token `i` and key `j` of the row's concatenation `retained list ++ step keys` (retained key `j` is
`j`, step key `t` is `retained + t`; `retained` is the sum of the read lengths, `T` the static step
width), before the score is scaled. Distances are therefore counted in the compacted list, without the gap
between sink and window; `RB >= K + 2T - 1` covers every pair. `sink_logits [H]` (gpt-oss's learned
sinks) adds one logit per query head to the softmax denominator, in the units of the scaled scores; no key
carries it, so it only takes probability mass away.

The helpers at the end are the table's arithmetic, shared by the reference and the kernels. They take the
array namespace (`numpy`, `jax.numpy`) from the caller, so this module imports neither and the same code
runs in the float64 oracle, in XLA and inside a Pallas kernel body.
"""

from types import ModuleType
from typing import Any

#: Slot index into the cache's S axis.
SLOT = 0
#: Source index into the bank's V axis.
SOURCE = 1
#: n, the stream entries before the step; step token i sits at position n + i.
STREAM_LEN = 2
#: The policy's sink: positions below it stay visible to every query under a query window.
SINK = 3
#: min(sink, n): how many retained keys belong to the sink.
SINK_KEPT = 4
#: max(sink, n - W): the stream position of the first window key.
WINDOW_START = 5
#: Real step tokens (keys and queries) of the row; the rest is bucket padding.
STEP_TOKENS = 6
#: First column of the five (start, len) read pairs, see the module docstring.
READS = 7
#: How many read ranges a row has.
NUM_READS = 5
#: Per read range, whether it reads the source bank (else the row's slot).
READ_FROM_SOURCE = (True, False, True, False, False)
#: The read ranges in the source bank: (0, 2).
SOURCE_READS = tuple(i for i, s in enumerate(READ_FROM_SOURCE) if s)
#: The read ranges in the slot: (1, 3, 4).
SLOT_READS = tuple(i for i, s in enumerate(READ_FROM_SOURCE) if not s)
#: First column of the three (step_offset, slot_start, len) write triples.
WRITES = READS + 2 * NUM_READS
#: How many write ranges a row has.
NUM_WRITES = 3
#: Columns per table row.
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


def retained_count(rows: Any) -> Any:
    """Retained keys per row, the sum of its read lengths: `rows [..., ROW_INTS]` -> `[...]`."""
    return sum(rows[..., read_len(i)] for i in range(NUM_READS))


def rel_bias_column(key_index: Any, query_token: Any, retained: Any, steps: int) -> Any:
    """Column of `rel_bias` for query token `i` and key `j` of the concatenation: `retained + i - j + T - 1`.

    Args:
      key_index: integer array, `j` in `retained list ++ step keys` (step key `t` is `retained + t`).
      query_token: integer array, the query's step token `i`.
      retained: the row's retained count (the sum of its read lengths), broadcastable.
      steps: T, the static step width (the step arrays' token axis).

    Returns:
      Integer array of the broadcast shape, in `[0, retained + 2T - 1)` for real keys and queries.
    """
    return retained + query_token - key_index + (steps - 1)
