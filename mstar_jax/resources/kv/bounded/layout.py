"""Host index math of the bounded KV cache: stream positions to plan-table rows, in pure NumPy.

Vectorised over the batch (no Python loop over rows), so planning a bucket of rows costs microseconds.
The row format is `kernels_pallas.sink_window_attention.table`; its legend holds here too.

A slot holds the written part of the sink, then a ring for the window. Stream position `i` (always
`>= source_len`: positions below it are read from the source) lives at

    offset i - source_len                                  when i < sink
    offset sink_capacity + (i - sink) mod window           when i >= max(sink, source_len)

After a wrap (sink 2, source_len 0, window 5, sink_capacity 2, n = 13, so the window holds 8..12):

    slot offset   0  1 | 2   3  4  5   6
    position      0  1 | 12  8  9  10  11
                  sink | ring, oldest entry (8) at offset 3 = 2 + (8 - 2) mod 5

    reads: read 1 (0, 2) -> positions 0, 1;  read 3 (3, 4) -> 8..11;  read 4 (2, 1) -> 12

A step writing `span` tokens then overwrites the ring entries its new positions evict; attention runs
before the write, so a step never reads what it overwrites.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kernels_pallas.sink_window_attention import table as tbl

__all__ = ["NOT_STORED", "padding_rows", "plan_table", "retained_positions", "slot_offsets"]

NOT_STORED = -1
"""`slot_offsets` of a position that no slot entry holds (past the sink with a zero window)."""

_INT32_MAX = np.iinfo(np.int32).max


def _rows(fields: dict[str, npt.ArrayLike]) -> dict[str, np.ndarray]:
    """Broadcasts per-row integer fields to one shape [B] (int64, so sums cannot overflow)."""
    return dict(zip(fields, _matrix(fields), strict=True))


def _matrix(fields: dict[str, npt.ArrayLike]) -> np.ndarray:
    """`_rows` as one int64 matrix, a row per field in order."""
    arrays = {}
    for name, value in fields.items():
        array = np.asarray(value)
        if array.dtype.kind not in "iub" and array.size:  # an empty list is float64, and fine
            raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
        if array.ndim > 1:
            raise ValueError(f"{name} must be a scalar or 1-D [B], got shape {array.shape}")
        arrays[name] = array
    lengths = {name: a.shape[0] for name, a in arrays.items() if a.ndim == 1}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"per-row fields must have one entry per request, got lengths {lengths}")
    matrix = np.empty((len(arrays), max(lengths.values(), default=1)), np.int64)
    for i, array in enumerate(arrays.values()):
        matrix[i] = array  # one row at a time: np.stack costs more than all the math below
    if matrix.size and matrix.min() < 0:
        i, r = np.argwhere(matrix < 0)[0]
        raise ValueError(f"{list(arrays)[i]}[{r}]={matrix[i, r]} must be >= 0")
    return matrix


def _first_bad_row(bad: np.ndarray) -> int | None:
    """Index of the first True entry of `bad`, or None."""
    return int(np.argmax(bad)) if bad.any() else None


def _check_sink_fits(source_len: np.ndarray, sink: np.ndarray, sink_capacity: int) -> None:
    """The written part of every row's sink must fit the slot's sink region."""
    if sink_capacity < 0:
        raise ValueError(f"{sink_capacity=} must be >= 0")
    r = _first_bad_row(sink - source_len > sink_capacity)
    if r is not None:
        raise ValueError(
            f"row {r}: sink[{r}]={sink[r]} over source_len[{r}]={source_len[r]} leaves "
            f"{sink[r] - source_len[r]} written sink entries, more than {sink_capacity=}; size "
            "sink_capacity for the shortest allowed source (config.min_source_len)"
        )


def _check_plan(
    rows: dict[str, np.ndarray],
    matrix: np.ndarray,
    end: np.ndarray,
    sink_capacity: int,
    slot_tokens: int | None,
) -> None:
    """Refuses rows whose ranges could leave the slot or overflow int32 (`matrix`: the fields as `_matrix`
    holds them, `end`: each row's stream end after the step); two reductions when all is well."""
    source_len, span, sink, window = rows["source_len"], rows["span"], rows["sink"], rows["window"]
    step_tokens = rows["step_tokens"]
    limit = _INT32_MAX if slot_tokens is None else min(slot_tokens, _INT32_MAX)
    suspect = (span > step_tokens) | (sink - source_len > sink_capacity) | (sink_capacity + window > limit)
    suspect |= end > _INT32_MAX
    if not suspect.any() and (not matrix.size or matrix.max() <= _INT32_MAX):  # every field fits int32
        return
    suspect |= (step_tokens > _INT32_MAX) | (sink > _INT32_MAX)
    suspect |= (rows["slot"] > _INT32_MAX) | (rows["source"] > _INT32_MAX)
    r = _first_bad_row(span > step_tokens)
    if r is not None:
        raise ValueError(f"span[{r}]={span[r]} exceeds step_tokens[{r}]={step_tokens[r]}")
    _check_sink_fits(source_len, sink, sink_capacity)
    r = _first_bad_row(sink_capacity + window > limit)
    if r is not None and slot_tokens is not None:
        raise ValueError(f"{sink_capacity=} + window[{r}]={window[r]} exceeds {slot_tokens=}")
    r = int(np.argmax(suspect))
    raise ValueError(f"row {r}: a stream position ({end[r]}), slot offset or index exceeds int32")


def _ring_split(
    first: np.ndarray,
    count: np.ndarray,
    sink: np.ndarray,
    window: np.ndarray,
    modulus: np.ndarray,
    ring_start: int,
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """Slot ranges of `count <= window` positions from `first >= sink`, split at the ring's wrap
    (`modulus`: `max(window, 1)`; a zero window has count 0, and the max avoids x % 0).

    Returns:
      (start_a, len_a, start_b, len_b): the run up to the ring's end, then the rest from its start
      (`start_b` is the ring's start, one int for every row).
    """
    p = np.mod(first - sink, modulus)
    len_a = np.minimum(count, window - p)
    return ring_start + p, len_a, ring_start, count - len_a


def plan_table(
    *,
    slot: npt.ArrayLike,
    source: npt.ArrayLike,
    source_len: npt.ArrayLike,
    written: npt.ArrayLike,
    span: npt.ArrayLike,
    step_tokens: npt.ArrayLike,
    sink: npt.ArrayLike,
    window: npt.ArrayLike,
    window_includes_step: npt.ArrayLike,
    sink_capacity: int,
    reverse: bool,
    slot_tokens: int | None = None,
) -> np.ndarray:
    """Plans one step: each request's reads of its retained keys and writes of its new entries.

    Args:
      slot: i[B] the request's slot.
      source: i[B] the source prefix it reads (index into the bank).
      source_len: i[B] that prefix's length for this request.
      written: i[B] entries the request wrote before this step; the stream holds
        `n = source_len + written` entries.
      span: i[B] step tokens written this step, at stream positions `[n, n + span)`.
      step_tokens: i[B] the row's real step tokens (`span <= step_tokens <= T`); the rest is padding.
      sink, window: i[B] the row's retention (`config.retention_for(source_len)`).
      window_includes_step: bool[B] whether the window counts the step's own tokens.
      sink_capacity: the slot offset where the ring starts (`config.sink_capacity`).
      reverse: whether step tokens join the stream last-first (`config.reverse_step_order`).
      slot_tokens: C, if given checked to hold every row's ring (`sink_capacity + window <= C`).

    Returns:
      i32[B, ROW_INTS], the rows of the plan table. Empty ranges are all zeros.

    Raises:
      TypeError: a field holds non-integers.
      ValueError: a negative field, `span > step_tokens`, a sink whose written part overflows
        `sink_capacity`, a window overflowing `slot_tokens`, or positions past int32; the message names
        the field and the row.
    """
    fields = {
        "slot": slot,
        "source": source,
        "source_len": source_len,
        "written": written,
        "span": span,
        "step_tokens": step_tokens,
        "sink": sink,
        "window": window,
        "window_includes_step": window_includes_step,
    }
    matrix = _matrix(fields)
    rows = dict(zip(fields, matrix, strict=True))
    if sink_capacity < 0:
        raise ValueError(f"{sink_capacity=} must be >= 0")
    source_len, span, sink, window = rows["source_len"], rows["span"], rows["sink"], rows["window"]
    n = source_len + rows["written"]
    end = n + span
    _check_plan(rows, matrix, end, sink_capacity, slot_tokens)

    sink_kept = np.minimum(sink, n)
    # W, the newest entries read besides the sink: window - span (at least 0) if it counts the step.
    reads = window - (rows["window_includes_step"] > 0) * np.minimum(span, window)
    window_start = np.maximum(sink, n - reads)

    # Filled column by column into [ROW_INTS, B]: np.stack would cost more than the whole layout. In int32
    # (every entry fits: `_check_plan`), so the transpose at the end copies half the bytes, no cast.
    out = np.zeros((tbl.ROW_INTS, n.shape[0]), np.int32)
    out[tbl.SLOT] = rows["slot"]
    out[tbl.SOURCE] = rows["source"]
    out[tbl.STREAM_LEN] = n
    out[tbl.SINK] = sink
    out[tbl.SINK_KEPT] = sink_kept
    out[tbl.WINDOW_START] = window_start
    out[tbl.STEP_TOKENS] = rows["step_tokens"]

    out[tbl.read_len(0)] = np.minimum(sink, source_len)
    out[tbl.read_len(1)] = np.maximum(sink_kept - source_len, 0)
    out[tbl.read_start(2)] = window_start
    out[tbl.read_len(2)] = np.maximum(source_len - window_start, 0)
    # Ring entries exist only for positions >= max(sink, source_len); window_start >= sink already.
    ring_first = np.maximum(window_start, source_len)
    modulus = np.maximum(window, 1)
    out[tbl.read_start(3)], out[tbl.read_len(3)], out[tbl.read_start(4)], out[tbl.read_len(4)] = _ring_split(
        ring_first, np.maximum(n - ring_first, 0), sink, window, modulus, sink_capacity
    )

    # n >= source_len, so every new sink entry is a written one.
    step_col, slot_col, len_col = tbl.write_cols(0)
    out[step_col] = end - 1 - n if reverse else 0
    out[slot_col] = n - source_len
    out[len_col] = np.maximum(np.minimum(sink, end) - n, 0)
    # Of the new window entries only the last `window` survive the step (none for a zero window:
    # then first >= end).
    first = np.maximum(np.maximum(sink, n), end - window)
    start_a, len_a, start_b, len_b = _ring_split(
        first, np.maximum(end - first, 0), sink, window, modulus, sink_capacity
    )
    ring_writes = ((1, first, start_a, len_a), (2, first + len_a, start_b, len_b))
    for i, first_position, slot_start, length in ring_writes:
        step_col, slot_col, len_col = tbl.write_cols(i)
        # The step token at the range's first position: position p holds token p - n, or
        # n + span - 1 - p when tokens join the stream last-first.
        out[step_col] = end - 1 - first_position if reverse else first_position - n
        out[slot_col] = slot_start
        out[len_col] = length

    # Empty ranges become all zeros, so no kernel ever forms an address from an unused start.
    read_ranges = out[tbl.READS : tbl.WRITES].reshape(tbl.NUM_READS, 2, -1)
    read_ranges[:, 0] *= read_ranges[:, 1] > 0
    write_ranges = out[tbl.WRITES :].reshape(tbl.NUM_WRITES, 3, -1)
    write_ranges[:, :2] *= write_ranges[:, 2:] > 0
    return np.ascontiguousarray(out.T)


def padding_rows(count: int, padding_slot: int) -> np.ndarray:
    """Table rows for bucket padding: they read nothing, write nothing and have no step tokens.

    Args:
      count: how many rows.
      padding_slot: the slot they name, one no request owns, so even a kernel that ignores the
        empty ranges touches no live slot.

    Returns:
      i32[count, ROW_INTS], writable.
    """
    if count < 0:
        raise ValueError(f"{count=} must be >= 0")
    if padding_slot < 0:
        raise ValueError(f"{padding_slot=} must be >= 0")
    out = np.zeros((count, tbl.ROW_INTS), np.int32)
    out[:, tbl.SLOT] = padding_slot
    return out


def slot_offsets(
    positions: npt.ArrayLike,
    *,
    source_len: npt.ArrayLike,
    sink: npt.ArrayLike,
    window: npt.ArrayLike,
    sink_capacity: int,
) -> np.ndarray:
    """Where written stream positions live in a slot (broadcast over all arguments).

    Args:
      positions: stream positions, each `>= source_len`.
      source_len, sink, window: the stream's source length and retention.
      sink_capacity: the slot offset where the ring starts.

    Returns:
      int64 slot offsets; `NOT_STORED` for positions past the sink when the window is 0.

    Raises:
      ValueError: a position below `source_len` (it lives in the source), a negative argument, or a
        sink whose written part overflows `sink_capacity`.
    """
    rows = _rows({"positions": positions, "source_len": source_len, "sink": sink, "window": window})
    positions, source_len, sink, window = rows["positions"], rows["source_len"], rows["sink"], rows["window"]
    r = _first_bad_row(positions < source_len)
    if r is not None:
        raise ValueError(
            f"positions[{r}]={positions[r]} is below source_len[{r}]={source_len[r]}: it lives in the source"
        )
    _check_sink_fits(source_len, sink, sink_capacity)
    ring = sink_capacity + np.mod(positions - sink, np.maximum(window, 1))
    stored = np.where(window > 0, ring, NOT_STORED)
    return np.where(positions < sink, positions - source_len, stored)


def retained_positions(
    *, source_len: int, written: int, span: int, sink: int, window: int, window_includes_step: bool
) -> np.ndarray:
    """The stream positions one request attends before its own step tokens, in stream order.

    `R = [0, min(sink, n)) ∪ [max(sink, n - W), n)` with `n = source_len + written` and `W` the window
    the step reads (`max(0, window - span)` when the window includes the step, else `window`).

    Returns:
      int64[K_row] positions.
    """
    for name, value in (("source_len", source_len), ("written", written), ("span", span)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    if sink < 0 or window < 0:
        raise ValueError(f"{sink=} and {window=} must be >= 0")
    n = source_len + written
    reads = max(window - span, 0) if window_includes_step else window
    return np.concatenate([np.arange(min(sink, n)), np.arange(max(sink, n - reads), n)]).astype(np.int64)
