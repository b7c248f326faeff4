"""The TPU (Mosaic) kernel body: an online softmax over one row's retained keys, block by block, then its own.

Grid `(N, NQ, NK)`: attention row, query block (both parallel, so megacore chips split them), then the
key walk (`arbitrary`, it carries the online-softmax state). Every grid step handles all `G` KV heads of
its key block. The key walk has three phases:

  steps [0, NS)            source blocks  (reads 0 and 2, straight from the source bank)
  steps [NS, NS + NC)      slot blocks    (reads 1, 3 and 4, straight from the row's slot)
  step  NS + NC            the step's own T keys, then the output is normalised and written

The `H/G` query heads of each KV head are folded with the step tokens (`T * H/G` rows per KV head), and
the scores and the value update are dots batched over `G`, with f32 online-softmax state per KV head and
query row. Keys are masked per entry by the read ranges they fall in (the same for every KV head), which
also gives their stream positions for `query_window`; values of masked keys are zeroed so NaN or stale
bytes (evicted entries, the padding of a partial block) never reach the output.

Store blocks come in each store's orientation (see `tpu_blocks`): `[G, block, D]`, or `[G, D, block]`
where TPU keeps the store's tokens in lanes (`transposed`). Either way a key's mask and position lie along
the block's key axis, and the dots contract the head dim wherever it is, so no block is ever transposed
in VMEM.

The optional score terms arrive laid out for this walk (`tpu_terms`): a `rel_bias` block per phase, under
the keys of that step's store block, added to the scores before scaling; and each query row's sink logit,
which seeds the online softmax as a logit already seen (running max the logit, running sum 1, no value).
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.tpu_plan import RANGE_INTS

# A finite "minus infinity": exp(MASK - MASK) stays finite, so fully masked rows never produce NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def sink_window_kernel(
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
    source_k_ref,  # [G, block_source, D], or [G, D, block_source] when transposed[0]
    source_v_ref,  # as source_k_ref
    cache_k_ref,  # [G, block_slot, D], or [G, D, block_slot] when transposed[1]
    cache_v_ref,  # as cache_k_ref
    k_ref,  # [G, T, D]
    v_ref,  # [G, T, D]
    # With rel_bias, f32 source, slot and own bias blocks [G, bq, lanes]; with sink_logits, f32[G, bq, 1].
    # Then the output o_ref [G, bq, D] and the scratch: f32 running max m [G, bq, 1], running sum l
    # [G, bq, 1] and unnormalised output acc [G, bq, D].
    *refs,
    rel_bias: bool,
    sink_logits: bool,
    rows_per_request: int,
    group: int,
    block_q: int,
    block_source: int,
    block_slot: int,
    source_len: int,
    slot_len: int,
    source_steps: int,
    slot_steps: int,
    transposed: tuple[bool, bool],
    query_window: int | None,
    scale: float,
):
    del source_entries_ref, slot_entries_ref
    refs = list(refs)
    source_bias_ref, slot_bias_ref, own_bias_ref = [refs.pop(0) for _ in range(3)] if rel_bias else [None] * 3
    sinks_ref = refs.pop(0) if sink_logits else None
    o_ref, m_scratch, l_scratch, acc_scratch = refs
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
        if sinks_ref is None:
            m_scratch[...] = jnp.full(m_scratch.shape, MASK_VALUE, jnp.float32)
            l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        else:
            m_scratch[...] = sinks_ref[...]
            l_scratch[...] = jnp.ones(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    def dot(a, b, contracting):
        """A dot batched over the leading KV-head dim, accumulated in f32."""
        precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
        return lax.dot_general(
            a, b, (contracting, ((0,), (0,))), precision=precision, preferred_element_type=jnp.float32
        )

    def attend(keys, values, key_ok, key_pos, value_ok, bias, *, keys_minor):
        """One online-softmax update over every KV head.

        Args:
          keys, values: [G, bk, D] (keys_minor=False) or [G, D, bk] (keys_minor=True).
          key_ok, key_pos: [1, 1, bk] (the same keys are valid for every head).
          value_ok: key_ok laid along the values' key axis: [1, bk, 1], or [1, 1, bk] when keys_minor.
          bias: None or f32[G, bq, bk], the rel_bias term.

        Returns the updated (running sum, accumulator) so the last step need not reload them.
        """
        q = q_ref[...]
        key_dim = 2 if keys_minor else 1
        if keys.shape[key_dim] == 1 and not keys_minor:
            # A single key row (decode's own key): Mosaic cannot lower a bf16 dot of that shape, and the
            # VPU does it as well as the MXU would.
            s = jnp.sum(q.astype(jnp.float32) * keys.astype(jnp.float32), axis=2, keepdims=True)
        else:
            s = dot(q, keys, ((2,), (3 - key_dim,)))  # [G, bq, bk]
        s = (s if bias is None else s + bias) * scale
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
        if values.shape[key_dim] == 1 and not keys_minor:
            update = p * values.astype(jnp.float32)
        else:
            update = dot(p.astype(values.dtype), values, ((2,), (key_dim,)))  # [G, bq, D]
        acc = alpha * acc_scratch[...] + update
        m_scratch[...], l_scratch[...], acc_scratch[...] = m_next, total, acc
        return total, acc

    def attend_store(
        k_block_ref, v_block_ref, bias_ref, blocks_ref, steps, phase_step, block, store_len, reads, keys_minor
    ):
        block_start = blocks_ref[request * steps + phase_step] * block
        # Row form masks scores; the values' form is built from its own iota (no relayout in VMEM).
        offset = block_start + lax.broadcasted_iota(jnp.int32, (1, 1, block), 2)
        if keys_minor:  # values [G, D, block]: their mask is a row, as for the scores
            value_offset = offset
        else:  # values [G, block, D]: a column
            value_offset = block_start + lax.broadcasted_iota(jnp.int32, (1, block, 1), 1)
        key_ok = jnp.zeros((1, 1, block), bool)
        value_ok = jnp.zeros(value_offset.shape, bool)
        key_pos = jnp.zeros((1, 1, block), jnp.int32)
        if query_window is not None:
            sink_kept, window_start = col(tbl.SINK_KEPT), col(tbl.WINDOW_START)
        for i in reads:
            at = (request * tbl.NUM_READS + i) * RANGE_INTS
            start, end = ranges_ref[at], jnp.minimum(ranges_ref[at + 1], store_len)
            inside = (offset >= start) & (offset < end)
            key_ok |= inside
            value_ok |= (value_offset >= start) & (value_offset < end)
            if query_window is not None:
                j = offset + ranges_ref[at + 2]  # the retained index; positions as in table.py
                pos = tbl.retained_position(j, sink_kept, window_start, xp=jnp)
                key_pos = jnp.where(inside, pos, key_pos)
        bias = None
        if bias_ref is not None:  # its lanes past the block (padding to a lane tile) are not read
            bias = bias_ref[...] if bias_ref.shape[2] == block else bias_ref[:, :, :block]
        attend(k_block_ref[...], v_block_ref[...], key_ok, key_pos, value_ok, bias, keys_minor=keys_minor)

    @pl.when(step < source_counts_ref[request])
    def _source():
        attend_store(
            source_k_ref, source_v_ref, source_bias_ref, source_blocks_ref, source_steps, step, block_source,
            source_len, tbl.SOURCE_READS, transposed[0],
        )  # fmt: skip

    slot_step = step - source_steps

    @pl.when((slot_step >= 0) & (slot_step < slot_counts_ref[request]))
    def _slot():
        attend_store(
            cache_k_ref, cache_v_ref, slot_bias_ref, slot_blocks_ref, slot_steps, slot_step, block_slot,
            slot_len, tbl.SLOT_READS, transposed[1],
        )  # fmt: skip

    @pl.when(step == source_steps + slot_steps)
    def _own_and_finish():
        steps = k_ref.shape[1]
        step_tokens = col(tbl.STEP_TOKENS)
        own = lax.broadcasted_iota(jnp.int32, (1, 1, steps), 2)
        own_ok = lax.broadcasted_iota(jnp.int32, (1, steps, 1), 1) < step_tokens
        bias = None if own_bias_ref is None else own_bias_ref[...]
        total, acc = attend(
            k_ref[...], v_ref[...], own < step_tokens, col(tbl.STREAM_LEN) + own, own_ok, bias,
            keys_minor=False,
        )  # fmt: skip
        out = acc / jnp.where(total > 0, total, 1.0)
        o_ref[...] = jnp.where(total > 0, out, 0.0).astype(o_ref.dtype)
