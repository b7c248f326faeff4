"""`decode_block`: K one-token steps in one program, against the same step run K times by hand.

A toy step stands in for a model: its "cache" counts, per slot, the entries each step's table writes,
and its token is a function of the input token, the row's stream position (the table's) and its seed,
so a block that fed the wrong token, planned the wrong position or wrote past a stop shows in the
outputs or the counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.serving.steps import decode_block, without_writes

K, B, VOCAB = 5, 3, 11
LENGTHS = tuple(tbl.write_cols(i)[2] for i in range(tbl.NUM_WRITES))


def toy_step(params, cache, banks, plan, tokens, lengths, seeds):
    """cache: i32[B] entries written per row; the next token mixes the input, the position and the seed."""
    table = plan.table
    cache = cache + table[:, LENGTHS].sum(axis=1)
    position = plan.stream_lengths()
    out = (tokens[:, 0] * 3 + position * 7 + seeds.astype(jnp.int32) + params) % VOCAB
    return cache, out


def tables(rng, steps: int) -> np.ndarray:
    """Random one-token step tables: each row at a stream position advancing by one a step, writing one
    entry (in a random one of the write ranges)."""
    out = np.zeros((steps, B, tbl.ROW_INTS), np.int32)
    start = rng.integers(0, 50, B)
    for j in range(steps):
        out[j, :, tbl.STREAM_LEN] = start + j
        out[j, :, tbl.STEP_TOKENS] = 1
        out[j, np.arange(B), np.take(LENGTHS, rng.integers(0, len(LENGTHS), B))] = 1
    return out


def by_hand(table, tokens, seeds, stops=None):
    """The step run once per table, each step's token the next one's input; a row that sampled a stop
    token writes nothing from its next step on and repeats it, and a row whose input is one nothing at
    all."""
    cache, alive, outs = jnp.zeros(B, jnp.int32), np.ones(B, bool), []
    if stops is not None:
        alive = ~(np.asarray(tokens) == stops).any(axis=1)
    for j in range(table.shape[0]):
        step_table = table[j] if stops is None else np.asarray(without_writes(jnp.asarray(table[j]), alive))
        cache, out = toy_step(1, cache, None, BoundedKVPlan(step_table, num_tokens=1), tokens, None, seeds)
        if stops is not None:
            out = np.where(alive, np.asarray(out), np.asarray(tokens)[:, 0])
        outs.append(np.asarray(out))
        tokens = np.asarray(out)[:, None]
        if stops is not None:
            alive &= ~(np.asarray(out)[:, None] == stops).any(axis=1)
    return np.asarray(cache), np.stack(outs, axis=1)


@pytest.mark.parametrize("seed", range(4))
def test_a_block_gives_what_its_steps_give_one_at_a_time(seed):
    rng = np.random.default_rng(seed)
    table = tables(rng, K)
    tokens = rng.integers(0, VOCAB, (B, 1)).astype(np.int32)
    seeds = rng.integers(0, 2**32, B, dtype=np.uint32)
    block = jax.jit(decode_block(toy_step, steps=K))
    plan = BoundedKVPlan(table, num_tokens=1, steps=K)
    cache, outs = block(1, jnp.zeros(B, jnp.int32), None, plan, tokens, np.ones(B, np.int32), seeds)
    want_cache, want = by_hand(table, tokens, seeds)
    np.testing.assert_array_equal(outs, want)
    np.testing.assert_array_equal(cache, want_cache)
    assert outs.shape == (B, K)


def test_a_row_that_samples_a_stop_token_writes_nothing_after_it():
    rng = np.random.default_rng(7)
    table = tables(rng, K)
    tokens = rng.integers(0, VOCAB, (B, 1)).astype(np.int32)
    seeds = rng.integers(0, 2**32, B, dtype=np.uint32)
    free, want_free = by_hand(table, tokens, seeds)
    stops = np.full((B, 4), -1, np.int32)
    stops[0, 0] = want_free[0, 1]  # row 0 stops at its second token; the others never
    stops[2, :2] = (want_free[2, 0], VOCAB + 3)  # row 2 at its first
    block = jax.jit(decode_block(toy_step, steps=K, stops=True))
    plan = BoundedKVPlan(table, num_tokens=1, steps=K)
    cache, outs = block(1, jnp.zeros(B, jnp.int32), None, plan, tokens, np.ones(B, np.int32), seeds, stops)
    want_cache, want = by_hand(table, tokens, seeds, stops)
    np.testing.assert_array_equal(outs, want)
    np.testing.assert_array_equal(cache, want_cache)
    first_stop = {row: min(j for j in range(K) if want_free[row, j] in stops[row]) for row in (0, 2)}
    assert first_stop[0] <= 1
    assert first_stop[2] == 0
    for row, at in first_stop.items():
        assert cache[row] == at + 1  # the steps up to the stop wrote; none after
        assert (np.asarray(outs[row, at:]) == int(outs[row, at])).all()  # its stop token, repeated
    assert cache[1] == free[1] == K
    np.testing.assert_array_equal(outs[:, : first_stop[2] + 1], want_free[:, : first_stop[2] + 1])


def test_a_row_whose_input_is_a_stop_token_writes_nothing():
    """A pipelined block dispatched before its row's stop token was read, planned past the block that
    sampled it: the row writes nothing (a live stream's next turn reads the token first)."""
    rng = np.random.default_rng(3)
    table = tables(rng, K)
    tokens = np.asarray([[4], [6], [4]], np.int32)
    seeds = rng.integers(0, 2**32, B, dtype=np.uint32)
    stops = np.full((B, 4), -1, np.int32)
    stops[0, 0] = stops[1, 1] = 4  # row 0 came in on its stop token; row 1 did not (its input is 6)
    block = jax.jit(decode_block(toy_step, steps=K, stops=True))
    plan = BoundedKVPlan(table, num_tokens=1, steps=K)
    cache, outs = block(1, jnp.zeros(B, jnp.int32), None, plan, tokens, np.ones(B, np.int32), seeds, stops)
    want_cache, want = by_hand(table, tokens, seeds, stops)
    np.testing.assert_array_equal(cache, want_cache)
    np.testing.assert_array_equal(outs, want)
    assert cache[0] == 0
    assert cache[2] == K  # row 2's input is 4 too, but not one of its stop tokens


def test_without_writes_empties_only_the_write_ranges_of_the_rows_left_out():
    rng = np.random.default_rng(1)
    table = rng.integers(0, 100, (B, tbl.ROW_INTS)).astype(np.int32)
    keep = np.array([True, False, True])
    out = np.asarray(without_writes(jnp.asarray(table), jnp.asarray(keep)))
    np.testing.assert_array_equal(out[keep], table[keep])
    assert (out[1, list(LENGTHS)] == 0).all()
    others = [c for c in range(tbl.ROW_INTS) if c not in LENGTHS]
    np.testing.assert_array_equal(out[1, others], table[1, others])


def test_a_block_plan_has_a_table_per_step():
    with pytest.raises(ValueError, match=r"a plan of steps=4 has a 3-D table \[4, B, ROW_INTS\]"):
        BoundedKVPlan(np.zeros((3, tbl.ROW_INTS), np.int32), num_tokens=1, steps=4)
    with pytest.raises(ValueError, match=r"a plan of steps=None has a 2-D table"):
        BoundedKVPlan(np.zeros((2, 3, tbl.ROW_INTS), np.int32))
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match=r"steps=.* must be None or an int >= 1"):
            BoundedKVPlan(np.zeros((2, 3, tbl.ROW_INTS), np.int32), steps=bad)
    plan = BoundedKVPlan.abstract(3, 1, steps=4)
    assert plan.table.shape == (4, 3, tbl.ROW_INTS)
    assert plan.num_requests == 3
