"""Pallas GPU kernel (Triton lowering) for sink+window attention over the plan table.

Equivalent to `reference.sink_window_attention_reference` (same arguments, output in q's dtype): each
attention row attends its retained keys, read through the table's five ranges in stream order, then the
step's own keys, with an optional causal `query_window` band that keeps the sinks visible. Shape legend:
`table.py`; inside the kernel BQ, BK are the query and key block sizes and DP the head dim padded to a
power of two.

Why the Triton lowering (`pl.pallas_call` with `jax.experimental.pallas.triton.CompilerParams`) rather
than Mosaic GPU:

* It can be tested without a GPU: the same kernel body runs in the Pallas HLO interpreter
  (`interpret=True`) on CPU, and lowering it for CUDA to Triton IR also works on a CPU-only host (the
  tests check both). Mosaic GPU compiles only on sm90+ and its kernels are written against TMA copies
  and warpgroup semantics that the HLO interpreter does not run.
* A retained block mixes keys from the source prefix and the slot (a sink inside the source, the ring
  after its wrap): every key picks its own store and offset. Triton expresses that directly as a masked
  pointer gather with one contiguous `D` row per key; Mosaic GPU moves contiguous tiles.
* It runs on H100/H200 with the Triton that jaxlib's CUDA plugin bundles (`jax>=0.10`): Triton compiler
  params select this lowering even where Mosaic GPU is the default GPU lowering. The Triton backend is
  deprecated upstream (jax >= 0.11 warns at every lowering; this module ignores that one warning) but still
  shipped; were it to go, importing it fails, this kernel raises NotImplementedError and the public op's
  "auto" falls back to XLA.

Layout of the work: the grid is (attention rows N, KV heads G, query blocks). One program owns one KV
head of one row and a block of BQ query rows, where query row `r` is step token `r // (H/G)` with query
head `g * (H/G) + r % (H/G)` (GQA: the heads sharing a KV head share every key load). It walks the
row's retained keys in blocks of BK up to the retained count read from the table at run time (so blocks
past it cost nothing), then the step's own keys up to `STEP_TOKENS`, keeping an online softmax with
float32 statistics. Every index is clamped into its array (bar the head dim's padding lanes, masked) and
every load masked. Each program writes one [BQ, DP] tile of a padded [N, G, MP, DP] output (MP = T * H/G
rounded up to BQ) that the wrapper slices and transposes to [N, T, H, D] (a small XLA op, O(output)).

A decode-shaped step (all of a row's query rows in one block) with `BlockSizes.split_keys` set (the
default past 128 keys) splits the walk instead (flash-decoding): the grid's third axis is the split,
each program walks `split_keys` of the retained keys (split 0 also the step's own keys and the sink
logits) and writes its float32 softmax state, and `gpu_merge.merge_splits` weighs the states together
in XLA, splits in a fixed order. Unsplit, a decode step of few rows ran N * G programs, each walking all its
keys alone: Gemma 3 270M's 8-row decode kept 8 of an H200's 132 multiprocessors busy.
"""

import functools
import importlib
import math
import types
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.gpu_blocks import MIN_DOT_DIM, BlockSizes, next_power_of_two
from kernels_pallas.sink_window_attention.gpu_merge import merge_splits
from kernels_pallas.sink_window_attention.validate import validate_inputs

__all__ = ["BlockSizes", "sink_window_attention_gpu"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TRITON_MODULE = "jax.experimental.pallas.triton"
# Emitted (jax >= 0.11) each time a Triton-backend pallas_call is lowered; matched from its start.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def _triton() -> types.ModuleType:
    """The Pallas Triton module, imported on use: a JAX without it makes this kernel decline the call."""
    try:
        return importlib.import_module(_TRITON_MODULE)
    except ImportError as e:
        raise NotImplementedError(
            f"this JAX ({jax.__version__}) has no Pallas Triton backend ({_TRITON_MODULE}): {e}"
        ) from e


def _ignore_triton_deprecation() -> None:
    """Ignores JAX's deprecation warning for the Triton backend, and only that warning.

    JAX warns when it lowers the pallas_call, which under a caller's `jax.jit` happens after this module's
    function has returned, so a `warnings.catch_warnings` around the call cannot catch it: the filter is
    installed process-wide (re-inserting it on every call is idempotent, and keeps it in front of filters a
    test harness installs per test, such as pytest's `filterwarnings = error`).
    """
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


def _online_softmax_step(
    carry, q, k, v, key_pos, key_ok, q_pos, bias, *, sink, query_window, scale, precision
):
    """Folds one block of keys into the running (max, sum, accumulator) of every query row.

    Args:
      carry: (m f32[BQ], l f32[BQ], acc f32[BQ, DP]).
      q: [BQ, DP] query block; k, v: [BK, DP] key and value block (zeros where masked).
      key_pos: i32[BK] stream positions of the keys; key_ok: bool[BK] keys that exist.
      q_pos: i32[BQ] stream positions of the queries.
      bias: None or f32[BQ, BK], the `rel_bias` term, added before scaling.
    """
    m_prev, l_prev, acc_prev = carry
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    s = (s if bias is None else s + bias) * scale
    visible = jnp.broadcast_to(key_ok[None, :], s.shape)
    if query_window is not None:
        visible = visible & tbl.query_window_visible(key_pos[None, :], q_pos[:, None], sink, query_window)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A row that has seen no visible key keeps max -inf; subtracting 0 instead keeps exp() at exactly 0
    # rather than exp(-inf - -inf) = NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m_prev - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return m_new, l_new, acc_prev * alpha[:, None] + pv


def _sink_window_kernel(
    # inputs (whole arrays; blocks are gathered by index arithmetic)
    table_ref,  # i32[B, ROW_INTS]
    q_ref,  # [N, T, H, D]
    k_ref,  # [N, T, G, D]
    v_ref,  # [N, T, G, D]
    cache_k_ref,  # [S, R, G, C, D]
    cache_v_ref,  # [S, R, G, C, D]
    source_k_ref,  # [V, R, G, L, D]
    source_v_ref,  # [V, R, G, L, D]
    *optional_and_outputs,  # [rel_bias f32[N, H, T, RB]], [sink_logits f32[H]], then the outputs
    has_rel_bias: bool,
    has_sink_logits: bool,
    rows_per_request: int,
    max_retained: int,
    query_window: int | None,
    scale: float,
    block_q: int,
    block_k: int,
    padded_dim: int,
    split_blocks: int | None,
):
    """One program: a row's KV head over one query block, or (split) over `split_blocks` key blocks.

    Unsplit, the outputs are o_ref [BQ, DP], the normalised tile. Split (grid axis 2 is the split, the
    query block is 0), they are the program's softmax state over its share of the retained keys:
    acc_ref f32[BQ, DP], m_ref f32[BQ], l_ref f32[BQ], merged by `gpu_merge.merge_splits`. Split 0 also
    takes the step's own keys and the sink logits, so each is counted once.
    """
    plgpu = _triton()
    outputs = 3 if split_blocks else 1
    optional = list(optional_and_outputs[:-outputs])
    rel_bias_ref = optional.pop(0) if has_rel_bias else None
    sink_logits_ref = optional.pop(0) if has_sink_logits else None
    n, g = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if split_blocks else 0
    qb = 0 if split_blocks else pl.program_id(2)
    _, steps, heads, dim = q_ref.shape
    kv_heads = k_ref.shape[2]
    group = heads // kv_heads
    num_slots, slot_tokens = cache_k_ref.shape[0], cache_k_ref.shape[3]
    num_sources, source_tokens = source_k_ref.shape[0], source_k_ref.shape[3]
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else lax.Precision.DEFAULT

    b = lax.div(n, rows_per_request)
    c = lax.rem(n, rows_per_request)
    slot = jnp.clip(table_ref[b, tbl.SLOT], 0, num_slots - 1)
    source = jnp.clip(table_ref[b, tbl.SOURCE], 0, num_sources - 1)
    stream_len = table_ref[b, tbl.STREAM_LEN]
    sink = table_ref[b, tbl.SINK]
    sink_kept = table_ref[b, tbl.SINK_KEPT]
    window_start = table_ref[b, tbl.WINDOW_START]
    own = jnp.clip(table_ref[b, tbl.STEP_TOKENS], 0, steps)
    starts = [table_ref[b, tbl.read_start(i)] for i in range(tbl.NUM_READS)]
    lens = [jnp.maximum(table_ref[b, tbl.read_len(i)], 0) for i in range(tbl.NUM_READS)]
    ends = []  # ends[i]: retained index one past read range i
    total = jnp.int32(0)
    for length in lens:
        total = total + length
        ends.append(total)
    retained = jnp.minimum(total, max_retained)

    # Head-dim lanes: padded to a power of two; the tail lanes are masked, never read. They are not
    # clamped to a real column: a clamp hides from Triton that a row's lanes are contiguous, and the
    # per-lane gathers that follow spilled registers at D 80 and 96 (ptxas, sm_90a).
    d = lax.broadcasted_iota(jnp.int32, (1, padded_dim), 1)
    d_ok = d < dim

    rows = qb * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    t = lax.div(rows, group)
    row_ok = t < steps
    t = jnp.minimum(t, steps - 1)
    h = g * group + lax.rem(rows, group)
    q = plgpu.load(q_ref.at[n, t[:, None], h[:, None], d], mask=row_ok[:, None] & d_ok, other=0)
    q_pos = stream_len + t

    def bias(key_index, key_ok):
        """f32[BQ, BK] of `rel_bias` for keys `key_index` of `retained ++ step keys`, or None."""
        if rel_bias_ref is None:
            return None
        column = tbl.rel_bias_column(key_index[None, :], t[:, None], total, steps)
        column = jnp.clip(column, 0, rel_bias_ref.shape[3] - 1)
        mask = row_ok[:, None] & key_ok[None, :]
        return plgpu.load(rel_bias_ref.at[n, h[:, None], t[:, None], column], mask=mask, other=0)

    step = functools.partial(
        _online_softmax_step,
        q_pos=q_pos,
        sink=sink,
        query_window=query_window,
        scale=scale,
        precision=precision,
    )

    def retained_block(kb, carry):
        j = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        key_ok = j < retained
        # Offset of key j inside its store: the last read range whose start index it has passed.
        offset = starts[0] + j
        for i in range(1, tbl.NUM_READS):
            offset = jnp.where(j >= ends[i - 1], starts[i] + (j - ends[i - 1]), offset)
        in_source = jnp.zeros(j.shape, bool)
        for i in tbl.SOURCE_READS:
            in_source |= (j >= (ends[i - 1] if i else 0)) & (j < ends[i])
        from_source = (key_ok & in_source)[:, None] & d_ok
        from_slot = (key_ok & ~in_source)[:, None] & d_ok
        at_source = jnp.clip(offset, 0, source_tokens - 1)[:, None]
        at_slot = jnp.clip(offset, 0, slot_tokens - 1)[:, None]

        def gather(source_ref, cache_ref):
            from_s = plgpu.load(source_ref.at[source, c, g, at_source, d], mask=from_source, other=0)
            from_c = plgpu.load(cache_ref.at[slot, c, g, at_slot, d], mask=from_slot, other=0)
            return jnp.where(from_source, from_s, from_c)

        key_pos = tbl.retained_position(j, sink_kept, window_start, xp=jnp)
        keys, values = gather(source_k_ref, cache_k_ref), gather(source_v_ref, cache_v_ref)
        return step(carry, q, keys, values, key_pos, key_ok, bias=bias(j, key_ok))

    def own_block(kb, carry):
        u = kb * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        key_ok = u < own
        mask = key_ok[:, None] & d_ok
        at = jnp.minimum(u, steps - 1)[:, None]
        k = plgpu.load(k_ref.at[n, at, g, d], mask=mask, other=0)
        v = plgpu.load(v_ref.at[n, at, g, d], mask=mask, other=0)
        return step(carry, q, k, v, stream_len + u, key_ok, bias=bias(total + u, key_ok))

    m, l = jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32)
    if sink_logits_ref is not None:  # the sink is one more logit with no value: seen before any key
        sink_logit = plgpu.load(sink_logits_ref.at[h]).astype(jnp.float32)
        if split_blocks:  # in split 0's state only
            m, l = jnp.where(split == 0, sink_logit, m), jnp.where(split == 0, 1.0, l)
        else:
            m, l = sink_logit, jnp.ones((block_q,), jnp.float32)
    carry = (m, l, jnp.zeros((block_q, padded_dim), jnp.float32))
    # Each loop's bound is computed where it starts: one more value live across the first loop spilled
    # float32 decode tiles at D 128 (ptxas, sm_90a).
    if split_blocks:
        start = split * split_blocks
        end = jnp.minimum(start + split_blocks, lax.div(retained + block_k - 1, block_k))
        carry = lax.fori_loop(start, end, retained_block, carry)
        own_blocks = jnp.where(split == 0, lax.div(own + block_k - 1, block_k), 0)
        m, l, acc = lax.fori_loop(0, own_blocks, own_block, carry)
        acc_ref, m_ref, l_ref = optional_and_outputs[-3:]
        # Only the step's query rows: a decode step's group of heads is often a quarter of the tile, and
        # the merge reads no other row (the rest of the tile is never written).
        plgpu.store(acc_ref, acc, mask=jnp.broadcast_to(row_ok[:, None], acc.shape))
        m_ref[...] = m
        l_ref[...] = l
        return
    carry = lax.fori_loop(0, lax.div(retained + block_k - 1, block_k), retained_block, carry)
    _, l, acc = lax.fori_loop(0, lax.div(own + block_k - 1, block_k), own_block, carry)
    o_ref = optional_and_outputs[-1]
    # Queries past STEP_TOKENS (bucket padding) and rows that saw no key give zeros, never NaN.
    live = row_ok & (t < own) & (l > 0)
    out = acc / jnp.where(live, l, 1.0)[:, None]
    o_ref[...] = jnp.where(live[:, None], out, 0.0).astype(o_ref.dtype)


def sink_window_attention_gpu(
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
    interpret: bool = False,
) -> jax.Array:
    """Sink+window attention of each step token over `stream[retained] ++ step keys` (Pallas Triton).

    Same result as `reference.sink_window_attention_reference`; row `n` uses table row `n // R` and
    cache/source row `n % R`. Scores are float32 and the softmax statistics too; the value product runs
    in the inputs' dtype with float32 accumulation.

    Args:
      q: [N, T, H, D] queries, N = B * R.
      k, v: [N, T, G, D] the step's own keys and values.
      cache_k, cache_v: [S, R, G, C, D] one layer's slots.
      source_k, source_v: [V, R, G, L, D] one layer's sources.
      table: i32[B, ROW_INTS] plan table (see `table.py`).
      max_retained: K, the static bound on a row's retained keys; retained keys past it are not read.
      query_window: None (every query sees every key) or q >= 1 (causal band, sinks always visible).
      scale: score scale; defaults to 1 / sqrt(D).
      rel_bias: None or [N, H, T, RB], the per-distance term (see `table`); each program gathers its
        [BQ, BK] band of it per key block, as it gathers keys.
      sink_logits: None or [H], learned sink logits; they seed each query row's softmax state.
      block_sizes: tiles; `BlockSizes.default` when None.
      interpret: run the kernel body in the Pallas interpreter (any backend, e.g. CPU tests).

    Returns:
      [N, T, H, D] in q's dtype; queries past a row's STEP_TOKENS and rows with no visible key are zeros.

    Raises:
      ValueError, TypeError: what `validate.validate_inputs` rejects (the same errors as the public op), or
        compiled block sizes under 16.
      NotImplementedError: a case this kernel does not handle (a dtype other than float32, bfloat16 and
        float16, TPU interpret params, a JAX without the Pallas Triton backend); the public op's "auto"
        then falls back to XLA. Without `interpret` the kernel traces on any host but lowers only for
        CUDA (the lowering platform, not the host's default backend, decides where it runs: a CPU host
        can lower it with `lowering_platforms=("cuda",)`); lowering it for CPU raises Pallas's
        ValueError there.
    """
    validate_inputs(
        q, k, v, cache_k, cache_v, source_k, source_v, table,
        max_retained=max_retained, query_window=query_window, scale=scale,
        rel_bias=rel_bias, sink_logits=sink_logits,
    )  # fmt: skip
    max_retained = int(max_retained)
    query_window = None if query_window is None else int(query_window)
    if not isinstance(interpret, bool):
        raise NotImplementedError(
            f"interpret={interpret!r}: the Triton kernel runs only in the HLO "
            "interpreter (interpret=True), not in TPU interpret mode"
        )
    # validate_inputs makes all seven arrays share q's dtype.
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"q has dtype {q.dtype}; the Triton kernel supports {[str(t) for t in _SUPPORTED_DTYPES]}"
        )
    plgpu = _triton()
    n_rows, steps, heads, dim = q.shape
    kv_heads = k.shape[2]
    rows_per_request = cache_k.shape[1]  # R; validate_inputs checked B * R == N (B may be 0)
    if steps == 0 or n_rows == 0:
        return jnp.zeros(q.shape, q.dtype)

    # A config without a source prefix (or without written slot tokens) has empty stores: every table
    # range into them is empty, so one never-read zero entry keeps the clamped indices valid.
    if min(cache_k.shape[0], cache_k.shape[3]) == 0:
        cache_k = cache_v = jnp.zeros((1, rows_per_request, kv_heads, 1, dim), q.dtype)
    if min(source_k.shape[0], source_k.shape[3]) == 0:
        source_k = source_v = jnp.zeros((1, rows_per_request, kv_heads, 1, dim), q.dtype)

    group = heads // kv_heads
    query_rows = steps * group
    if block_sizes is None:
        block_sizes = BlockSizes.default(
            query_rows=query_rows,
            head_dim=dim,
            max_retained=max_retained,
            kv_heads=kv_heads,
            itemsize=q.dtype.itemsize,
        )
    padded_dim = next_power_of_two(dim)
    if not interpret:
        padded_dim = max(padded_dim, MIN_DOT_DIM)
        if min(block_sizes.block_q, block_sizes.block_k) < MIN_DOT_DIM:
            raise ValueError(f"{block_sizes=}: compiled Triton dots need block_q, block_k >= {MIN_DOT_DIM}")
    block_q, block_k = block_sizes.block_q, block_sizes.block_k
    q_blocks = pl.cdiv(query_rows, block_q)
    split_keys = block_sizes.split_keys
    # Decode-shaped (one query block) over more keys than a split: the walk spreads over programs.
    splits = pl.cdiv(max_retained, split_keys) if split_keys and q_blocks == 1 else 1
    split_blocks = split_keys // block_k if splits > 1 else None
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)

    optional = [x.astype(jnp.float32) for x in (rel_bias, sink_logits) if x is not None]
    itemsize = q.dtype.itemsize
    keys = max_retained + steps
    cost = pl.CostEstimate(
        flops=4 * n_rows * steps * heads * keys * dim,
        transcendentals=n_rows * steps * heads * keys,
        bytes_accessed=itemsize * (2 * q.size + k.size + v.size + 2 * n_rows * kv_heads * max_retained * dim)
        + 4 * (table.size + sum(x.size for x in optional)),
    )
    kernel = functools.partial(
        _sink_window_kernel,
        has_rel_bias=rel_bias is not None,
        has_sink_logits=sink_logits is not None,
        rows_per_request=rows_per_request,
        max_retained=max_retained,
        query_window=query_window,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        padded_dim=padded_dim,
        split_blocks=split_blocks,
    )
    if split_blocks:  # per split: acc f32[BQ, DP], m f32[BQ], l f32[BQ]
        out_shape = (
            jax.ShapeDtypeStruct((n_rows, kv_heads, splits, block_q, padded_dim), jnp.float32),
            *[jax.ShapeDtypeStruct((n_rows, kv_heads, splits, block_q), jnp.float32)] * 2,
        )
        out_specs = (
            pl.BlockSpec((None, None, None, block_q, padded_dim), lambda n, g, s: (n, g, s, 0, 0)),
            *[pl.BlockSpec((None, None, None, block_q), lambda n, g, s: (n, g, s, 0))] * 2,
        )
    else:
        out_shape = jax.ShapeDtypeStruct((n_rows, kv_heads, q_blocks * block_q, padded_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, block_q, padded_dim), lambda n, g, qb: (n, g, qb, 0))
    _ignore_triton_deprecation()
    tiles = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_rows, kv_heads, splits if split_blocks else q_blocks),
        in_specs=[pl.no_block_spec] * (8 + len(optional)),
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="sink_window_attention_gpu",
    )(table.astype(jnp.int32), q, k, v, cache_k, cache_v, source_k, source_v, *optional)
    if split_blocks:
        own = jnp.clip(table[:, tbl.STEP_TOKENS].astype(jnp.int32), 0, steps)
        acc, m, l = (x[:, :, :, :query_rows] for x in tiles)  # the rows the kernel wrote
        tiles = merge_splits(acc, m, l, own=jnp.repeat(own, rows_per_request), group=group, steps=steps)
        tiles = tiles.astype(q.dtype)
    # [N, G, T * H/G, D] -> [N, T, G, H/G, D] -> [N, T, H, D]: query head h = g * H/G + h'.
    out = tiles[:, :, :query_rows, :dim].reshape(n_rows, kv_heads, steps, group, dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(n_rows, steps, heads, dim)
