"""Device state of the bounded KV cache: `write_step` against a NumPy loop, in-place updates, shapes.

`write_step` is checked against the write triples of `table.py` applied one token at a time, on random
tables from `layout.plan_table`. The in-place property is checked on the compiled program itself: no
instruction may produce a whole cache layer except the in-place `dynamic-update-slice`s (and the
parameters, tuples and loop plumbing that carry the donated buffer), and a deliberately copying variant
must be caught by the same detector.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kernels_pallas.sink_window_attention import sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.reference import sink_window_attention_reference
from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank, write_step
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, SinkWindow

# --- write_step against the write triples ----------------------------------------------------------------

SLOTS, ROWS, GROUPS, DIM = 4, 2, 2, 3  # S real slots (+1 padding slot), R, G, D
BATCH = 4  # table rows per step: up to 3 requests, the rest padding

_write = jax.jit(write_step, static_argnames="reverse")


def write_reference(cache: np.ndarray, step: np.ndarray, table: np.ndarray, reverse: bool) -> np.ndarray:
    """`cache[slot, :, :, slot_start + t] = step[rows of b, step_offset ± t]`, one token at a time.

    Args:
      cache: [S + 1, R, G, C, D] one layer's slots.
      step: [N, T, G, D] the step's keys (or values), N = B * R.
      table: i32[B, ROW_INTS].
      reverse: whether ranges copy step tokens counting down.
    """
    out = cache.copy()
    rows = cache.shape[1]
    for b, row in enumerate(table):
        for w in range(tbl.NUM_WRITES):
            step_offset, slot_start, length = (int(row[col]) for col in tbl.write_cols(w))
            for t in range(length):
                token = step_offset - t if reverse else step_offset + t
                out[row[tbl.SLOT], :, :, slot_start + t] = step[b * rows : (b + 1) * rows, token]
    return out


def _random_row(rng: np.random.Generator, sink_capacity: int, window_capacity: int, steps: int) -> dict:
    """One request's position and retention; a third of the rows aim at the sink, a third at the wrap."""
    source_len = int(rng.integers(0, 4))
    sink = int(rng.integers(0, source_len + sink_capacity + 1))
    window = int(rng.integers(0, window_capacity + 1))
    step_tokens = int(rng.integers(1, steps + 1))
    span = int(rng.integers(0, step_tokens + 1))
    written = int(rng.integers(0, 3 * (sink_capacity + window_capacity) + 3))
    aim = rng.integers(3)
    if aim == 0:  # a short stream under the longest sink: its first entries land in the written sink
        sink, written = source_len + sink_capacity, int(rng.integers(0, sink_capacity + 1))
    elif aim == 1 and window_capacity:  # the newest entry sits at the ring's last offset: the write wraps
        window, span = window_capacity, step_tokens
        written = max(sink - source_len, 0) + window - 1 + window * int(rng.integers(0, 3))
    return {
        "source_len": source_len, "sink": sink, "window": window, "step_tokens": step_tokens, "span": span,
        "written": written, "window_includes_step": bool(rng.random() < 0.3),
    }  # fmt: skip


def random_table(rng: np.random.Generator, *, sink_capacity: int, window_capacity: int, steps: int, reverse):
    """A plan table of up to 3 requests in distinct random slots, padding rows anywhere in the batch."""
    real = int(rng.integers(1, BATCH))
    rows = [_random_row(rng, sink_capacity, window_capacity, steps) for _ in range(real)]
    table = layout.padding_rows(BATCH, SLOTS)
    where = np.sort(rng.choice(BATCH, real, replace=False))
    table[where] = layout.plan_table(
        slot=rng.choice(SLOTS, real, replace=False),
        source=rng.integers(0, 3, real),
        **{name: [row[name] for row in rows] for name in rows[0]},
        sink_capacity=sink_capacity,
        reverse=reverse,
        slot_tokens=sink_capacity + window_capacity,
    )
    return table


def step_arrays(
    rng: np.random.Generator, table: np.ndarray, steps: int, reverse: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Random [N, T, G, D] keys and values, NaN at every token no write range copies (padding rows too)."""
    shape = (BATCH * ROWS, steps, GROUPS, DIM)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    copied = np.zeros((BATCH * ROWS, steps), bool)
    for b, row in enumerate(table):
        for w in range(tbl.NUM_WRITES):
            step_offset, _, length = (int(row[col]) for col in tbl.write_cols(w))
            t = np.arange(length)
            copied[b * ROWS : (b + 1) * ROWS, step_offset - t if reverse else step_offset + t] = True
    k[~copied], v[~copied] = np.nan, np.nan
    return k, v


def _coverage(table: np.ndarray, capacity: int, steps: int) -> Counter:
    """What a table exercises: wrapped ring writes, clamped blocks, spans over C, padding rows."""
    block = min(steps, capacity)
    seen = Counter()
    for row in table:
        if row[tbl.STEP_TOKENS] == 0:
            seen["padding"] += 1
            continue
        lengths = [int(row[tbl.write_cols(w)[2]]) for w in range(tbl.NUM_WRITES)]
        starts = [int(row[tbl.write_cols(w)[1]]) for w in range(tbl.NUM_WRITES)]
        seen["wrap"] += lengths[2] > 0
        seen["clamp"] += any(n > 0 and s > capacity - block for s, n in zip(starts, lengths, strict=True))
        seen["sink_write"] += lengths[0] > 0
        seen["empty_real_row"] += sum(lengths) == 0
    return seen


# (sink_capacity, window_capacity, T): blocks clamped near the slot's end (T < C), T == C, T > C (a
# step longer than the slot: only its last `window` tokens survive), and no ring at all.
GEOMETRIES = [(2, 5, 3), (0, 4, 4), (1, 2, 5), (3, 0, 2)]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "cap{}+{}_T{}".format(*g))
def test_write_step_matches_reference_on_random_tables(geometry, reverse):
    sink_capacity, window_capacity, steps = geometry
    capacity = sink_capacity + window_capacity
    rng = np.random.default_rng(2 * GEOMETRIES.index(geometry) + reverse)
    seen = Counter()
    for _ in range(16):
        table = random_table(
            rng, sink_capacity=sink_capacity, window_capacity=window_capacity, steps=steps, reverse=reverse
        )
        seen += _coverage(table, capacity, steps)
        cache_shape = (SLOTS + 1, ROWS, GROUPS, capacity, DIM)
        cache_k = rng.standard_normal(cache_shape).astype(np.float32)
        cache_v = rng.standard_normal(cache_shape).astype(np.float32)
        k, v = step_arrays(rng, table, steps, reverse)
        new_k, new_v, _ = jax.device_get(_write(cache_k, cache_v, k, v, table, reverse=reverse))
        np.testing.assert_array_equal(new_k, write_reference(cache_k, k, table, reverse))
        np.testing.assert_array_equal(new_v, write_reference(cache_v, v, table, reverse))
        assert np.isfinite(new_k).all()  # no NaN (never copied) step token landed
        assert np.isfinite(new_v).all()
        untouched = sorted(set(range(SLOTS + 1)) - set(table[table[:, tbl.STEP_TOKENS] > 0, tbl.SLOT]))
        assert SLOTS in untouched  # padding rows name the padding slot and write nothing to it
        np.testing.assert_array_equal(new_k[untouched], cache_k[untouched])
        np.testing.assert_array_equal(new_v[untouched], cache_v[untouched])
    # The random tables must have exercised what this geometry can produce.
    assert seen["padding"] > 0, seen
    if sink_capacity:
        assert seen["sink_write"] > 0, seen
    assert seen["empty_real_row"] > 0, seen
    if window_capacity >= 2:
        assert seen["wrap"] > 0, seen
    if steps < capacity:
        assert seen["clamp"] > 0, seen


@pytest.mark.parametrize(
    ("reverse", "writes", "slot"),
    [
        # sink 0, window 4, C = 4, n = 3, span 3: positions 3, 4, 5 sit at ring offsets 3, 0, 1, so the
        # write splits at the wrap: (token 0 -> offset 3), then (tokens 1, 2 -> offsets 0, 1).
        (False, [(0, 0, 0), (0, 3, 1), (1, 0, 2)], [11.0, 12.0, -1.0, 10.0]),
        # Reversed, position 3 holds the last token (2), position 4 token 1 and position 5 token 0.
        (True, [(0, 0, 0), (2, 3, 1), (1, 0, 2)], [11.0, 10.0, -1.0, 12.0]),
    ],
)
def test_write_step_splits_at_the_wrap_by_hand(reverse, writes, slot):
    table = layout.plan_table(
        slot=[1], source=[0], source_len=[0], written=[3], span=[3], step_tokens=[3], sink=[0], window=[4],
        window_includes_step=[False], sink_capacity=0, reverse=reverse,
    )  # fmt: skip
    assert [tuple(int(table[0][c]) for c in tbl.write_cols(w)) for w in range(tbl.NUM_WRITES)] == writes
    cache = np.full((3, 1, 1, 4, 1), -1.0, np.float32)  # 2 slots + padding, R = G = D = 1, C = 4
    k = np.array([10.0, 11.0, 12.0], np.float32).reshape(1, 3, 1, 1)
    new_k, new_v, _ = jax.device_get(write_step(cache, -cache, k, -k, jnp.asarray(table), reverse=reverse))
    np.testing.assert_array_equal(new_k[1, 0, 0, :, 0], slot)
    np.testing.assert_array_equal(new_v[1, 0, 0, :, 0], -np.array(slot))
    np.testing.assert_array_equal(new_k[[0, 2]], cache[[0, 2]])


def test_write_step_casts_to_the_cache_dtype():
    table = layout.plan_table(
        slot=[0], source=[0], source_len=[0], written=[0], span=[2], step_tokens=[2], sink=[0], window=[2],
        window_includes_step=[False], sink_capacity=0, reverse=False,
    )  # fmt: skip
    cache = jnp.zeros((2, 1, 1, 2, 1), jnp.bfloat16)
    k = np.array([1.5, -2.25], np.float32).reshape(1, 2, 1, 1)  # exact in bfloat16
    new_k, _, _ = write_step(cache, cache, k, k, jnp.asarray(table), reverse=False)
    assert new_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new_k[0, 0, 0, :, 0], np.float32), [1.5, -2.25])


# --- the compiled step updates the donated cache in place -------------------------------------------------

COPY_CFG = BoundedKVConfig(
    num_layers=2, num_heads=1, head_dim=8, rows_per_request=1, max_source_len=4,
    retention=SinkWindow(2, 30), max_slots=63,
)  # fmt: skip
COPY_BATCH, COPY_STEPS, COPY_HEADS = 2, 2, 2


def run_step(cache, bank, plan, q, k, v, *, config):
    """Every layer's `attend`, as a model's step runs them (XLA attention)."""
    outs = []
    for layer in range(config.num_layers):
        out, cache = attend(
            cache, bank, plan, layer, q[layer], k[layer], v[layer], config=config, implementation="xla"
        )
        outs.append(out)
    return cache, jnp.stack(outs)


def _vmapped_write_step(cache, bank, plan, q, k, v, *, config):
    """The trap of docs/design.md §5: a per-row update under `vmap` writes a whole cache per row."""
    slots = plan.table[:, tbl.SLOT]

    def update(layer_cache, new):  # new [B, T, G, D]
        one = lambda slot, rows: lax.dynamic_update_slice(  # noqa: E731
            layer_cache, rows.transpose(1, 0, 2)[None, None], (slot, 0, 0, 0, 0)
        )
        return jax.vmap(one)(slots, new)[-1]

    cache = BoundedKVCache(
        k=tuple(update(c, k[i]) for i, c in enumerate(cache.k)),
        v=tuple(update(c, v[i]) for i, c in enumerate(cache.v)),
    )
    return cache, q


def _unsequenced_step(cache, bank, plan, q, k, v, *, config):
    """`attend` without routing the attention output through the write loop's carry (as first written)."""
    outs = []
    for layer in range(config.num_layers):
        out = sink_window_attention(
            q[layer], k[layer], v[layer], cache.k[layer], cache.v[layer], bank.k[layer], bank.v[layer],
            plan.table, max_retained=config.max_retained, implementation="xla",
        )  # fmt: skip
        new_k, new_v, _ = write_step(
            cache.k[layer], cache.v[layer], k[layer], v[layer], plan.table, reverse=False
        )
        cache = BoundedKVCache(
            k=(*cache.k[:layer], new_k, *cache.k[layer + 1 :]),
            v=(*cache.v[:layer], new_v, *cache.v[layer + 1 :]),
        )
        outs.append(out)
    return cache, jnp.stack(outs)


def _rescaled_step(cache, bank, plan, q, k, v, *, config):
    """A step that touches every cache entry (a full pass, even if XLA does it in place)."""
    cache, out = run_step(cache, bank, plan, q, k, v, config=config)
    return jax.tree.map(lambda x: x * 2, cache), out


def _abstract_step_args(config: BoundedKVConfig):
    q = jax.ShapeDtypeStruct(
        (config.num_layers, COPY_BATCH, COPY_STEPS, COPY_HEADS, config.head_dim), jnp.float32
    )
    kv = jax.ShapeDtypeStruct(
        (config.num_layers, COPY_BATCH, COPY_STEPS, config.num_heads, config.head_dim), jnp.float32
    )
    plan = BoundedKVPlan(jax.ShapeDtypeStruct((COPY_BATCH, tbl.ROW_INTS), jnp.int32))
    return BoundedKVCache.abstract(config), SourceBank.abstract(config, 2), plan, q, kv, kv


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)(?:\{[^}]*\})?\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CARRIERS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call"}


def full_layer_ops(hlo: str, layer_shape: tuple[int, ...], dtype: str = "f32") -> list[tuple[str, str]]:
    """(opcode, name) of every instruction that materialises a whole cache layer.

    Allowed: instructions that only carry the donated buffer (parameters, tuples, loop plumbing),
    `dynamic-update-slice` and fusions whose root is one (XLA runs those in place). Everything else
    producing `dtype[layer_shape]` (`copy`, `copy-start`, a scatter, an elementwise fusion) costs
    O(cache size).
    """
    shape = f"{dtype}[{','.join(map(str, layer_shape))}]"
    roots: dict[str, str] = {}
    producers: list[tuple[str, str, str]] = []  # (opcode, name, rest of the line)
    computation = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result, opcode, rest = m.groups()
        if line.lstrip().startswith("ROOT") and computation is not None:
            roots[computation] = opcode
        if result == shape:
            producers.append((opcode, name, rest))
    flagged = []
    for opcode, name, rest in producers:
        if opcode in _CARRIERS or opcode == "dynamic-update-slice":
            continue
        if opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            if called and roots.get(called.group(1)) == "dynamic-update-slice":
                continue
        flagged.append((opcode, name))
    return flagged


@pytest.fixture(scope="module")
def compiled_steps():
    args = _abstract_step_args(COPY_CFG)
    compile_ = lambda f: jax.jit(partial(f, config=COPY_CFG), donate_argnums=0).lower(*args).compile()  # noqa: E731
    return {
        f.__name__: compile_(f) for f in (run_step, _vmapped_write_step, _unsequenced_step, _rescaled_step)
    }


def _layer_bytes(config: BoundedKVConfig) -> int:
    return int(np.prod(BoundedKVCache.slot_shape(config))) * config.dtype.itemsize


def test_compiled_step_has_no_full_size_copy_of_a_cache_layer(compiled_steps):
    compiled = compiled_steps["run_step"]
    layer_shape = BoundedKVCache.slot_shape(COPY_CFG)
    hlo = compiled.as_text()
    assert full_layer_ops(hlo, layer_shape) == []
    assert f"f32[{','.join(map(str, layer_shape))}]" in hlo  # the detector looked at the right shape
    stats = compiled.memory_analysis()
    cache_bytes = 2 * COPY_CFG.num_layers * _layer_bytes(COPY_CFG)
    assert stats.alias_size_in_bytes == cache_bytes  # every layer of K and V updated in its donated buffer
    # Temporaries are the step's own gathers (a few KiB here), nowhere near one 64 KiB layer.
    assert stats.temp_size_in_bytes < _layer_bytes(COPY_CFG) // 4, stats


@pytest.mark.parametrize("variant", ["_vmapped_write_step", "_unsequenced_step"])
def test_copy_detector_catches_copying_steps(compiled_steps, variant):
    compiled = compiled_steps[variant]
    flagged = Counter(op for op, _ in full_layer_ops(compiled.as_text(), BoundedKVCache.slot_shape(COPY_CFG)))
    assert flagged["copy"] + flagged["copy-start"] > 0, flagged
    assert compiled.memory_analysis().temp_size_in_bytes >= _layer_bytes(COPY_CFG)


def test_copy_detector_catches_a_full_pass_over_the_cache(compiled_steps):
    # XLA may do `x * 2` in the donated buffer, but it still touches every entry: O(cache), flagged.
    hlo = compiled_steps["_rescaled_step"].as_text()
    assert full_layer_ops(hlo, BoundedKVCache.slot_shape(COPY_CFG)) != []


def test_step_deletes_the_donated_cache(compiled_steps):
    rng = np.random.default_rng(1)
    _, _, _, q, k, v = _abstract_step_args(COPY_CFG)
    cache = BoundedKVCache.create(COPY_CFG)
    bank = SourceBank.create(COPY_CFG, 2)
    table = layout.padding_rows(COPY_BATCH, COPY_CFG.max_slots)
    table[0] = layout.plan_table(
        slot=[5], source=[0], source_len=[0], written=[0], span=[2], step_tokens=[2], sink=[2], window=[30],
        window_includes_step=[False], sink_capacity=COPY_CFG.sink_capacity, reverse=False,
    )[0]  # fmt: skip
    arrays = [rng.standard_normal(x.shape).astype(np.float32) for x in (q, k, v)]
    new_cache, out = compiled_steps["run_step"](cache, bank, BoundedKVPlan(table), *arrays)
    assert all(x.is_deleted() for x in (*cache.k, *cache.v))
    assert not any(x.is_deleted() for x in (*bank.k, *bank.v))  # the bank is read, never donated
    # The two written tokens went to slot 5's sink (offsets 0, 1); nothing else changed.
    for layer in range(COPY_CFG.num_layers):
        got = np.asarray(new_cache.k[layer])
        np.testing.assert_array_equal(got[5, 0, :, :2], arrays[1][layer, 0].transpose(1, 0, 2))
        assert np.count_nonzero(got) == np.count_nonzero(arrays[1][layer, 0])
    assert np.isfinite(np.asarray(out)).all()


# --- shapes of the state ----------------------------------------------------------------------------------


def _config(**overrides) -> BoundedKVConfig:
    fields = {
        "num_layers": 3, "num_heads": 2, "head_dim": 4, "rows_per_request": 2, "max_source_len": 5,
        "min_source_len": 1, "retention": lambda s: SinkWindow(s + 2, 3), "max_slots": 6,
    }  # fmt: skip
    return BoundedKVConfig(**(fields | overrides))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_abstract_and_create(dtype):
    config = _config(dtype=dtype)
    # sink_capacity = max over s in [1, 5] of (s + 2) - s = 2; window 3: 5 slot tokens, allocated as the
    # store tile, C = 8. S + 1 = 7 slots.
    expected = (7, 2, 2, 8, 4)
    abstract = BoundedKVCache.abstract(config)
    assert len(abstract.k) == len(abstract.v) == 3
    for x in (*abstract.k, *abstract.v):
        assert isinstance(x, jax.ShapeDtypeStruct)
        assert (x.shape, x.dtype) == (expected, np.dtype(dtype))
    cache = BoundedKVCache.create(config)
    assert len(jax.tree.leaves(cache)) == 6
    for x in (*cache.k, *cache.v):
        assert isinstance(x, jax.Array)
        assert (x.shape, x.dtype) == (expected, np.dtype(dtype))
        assert not np.asarray(x, np.float32).any()
    assert cache.padding_slot == config.max_slots == 6
    itemsize = np.dtype(dtype).itemsize
    assert cache.nbytes == 2 * 3 * (7 * 2 * 2 * 8 * 4) * itemsize
    assert cache.nbytes == (config.max_slots + 1) * config.slot_bytes  # the padding slot is one more slot


def test_cache_of_zero_token_slots_keeps_one_tile():
    # The sink never passes the source and there is no window: a slot holds nothing, but a kernel still
    # needs addressable entries per slot (one store tile).
    config = _config(retention=lambda s: SinkWindow(s, 0))
    assert config.slot_tokens == 0
    assert BoundedKVCache.abstract(config).k[0].shape == (7, 2, 2, 8, 4)
    assert BoundedKVCache.slot_shape(config) == (7, 2, 2, 8, 4)


def test_source_bank_shapes():
    config = _config(dtype=jnp.bfloat16)
    bank = SourceBank.create(config, 4)
    assert bank.num_sources == 4
    assert len(bank.k) == len(bank.v) == 3
    for x in (*bank.k, *bank.v):
        # [V, R, G, L, D]; L = 5 allocated as one store tile of 8
        assert (x.shape, x.dtype) == ((4, 2, 2, 8, 4), np.dtype(jnp.bfloat16))
    abstract = SourceBank.abstract(config, 1)
    assert abstract.k[0].shape == (1, 2, 2, 8, 4)
    # No source at all still leaves one (never read) store tile to address.
    empty = _config(max_source_len=0, min_source_len=0, retention=SinkWindow(1, 2))
    assert SourceBank.abstract(empty, 2).k[0].shape == (2, 2, 2, 8, 4)


def _dot_count(config: BoundedKVConfig) -> int:
    jaxpr = jax.make_jaxpr(partial(run_step, config=config))(*_abstract_step_args(config))
    return str(jaxpr).count("dot_general[")


def test_attention_reads_no_bank_tile_without_a_source_prefix():
    # A bank of max_source_len = 0 keeps one store tile no plan reads (above); attention gets the empty
    # store instead, so the XLA path scores and weighs two parts a layer (slot, step), not three.
    with_source = _config(num_layers=2, rows_per_request=1, retention=SinkWindow(2, 30))
    without = _config(num_layers=2, rows_per_request=1, retention=SinkWindow(2, 30), max_source_len=0,
                      min_source_len=0)  # fmt: skip
    assert _dot_count(with_source) == 2 * 2 * 3
    assert _dot_count(without) == 2 * 2 * 2
    # Same bits as attending over the unread tile (here NaN: a read of it would show).
    rng = np.random.default_rng(4)
    cache = BoundedKVCache.create(without)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache)
    bank = jax.tree.map(lambda x: jnp.full(x.shape, np.nan, x.dtype), SourceBank.create(without, 2))
    assert bank.k[0].shape[3] == 8
    table = layout.plan_table(
        slot=[3, 1], source=[0, 1], source_len=[0, 0], written=[40, 2], span=[1, 1], step_tokens=[1, 1],
        sink=[2, 2], window=[30, 30], window_includes_step=[False, False], sink_capacity=2, reverse=False,
    )  # fmt: skip
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 1, 2, 4)), jnp.float32) for _ in range(2))
    plan = BoundedKVPlan(table)
    for layer in range(2):
        got, _ = attend(cache, bank, plan, layer, q, k, v, config=without, implementation="xla")
        tile = jnp.zeros_like(bank.k[layer])  # the tile as it used to be read: never valid, so masked
        want = sink_window_attention(
            q, k, v, cache.k[layer], cache.v[layer], tile, tile, table, max_retained=without.max_retained,
            implementation="xla",
        )  # fmt: skip
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # And the float64 reference, reading the NaN bank through the table: nothing of it is retained.
        ref = sink_window_attention_reference(
            q, k, v, cache.k[layer], cache.v[layer], bank.k[layer], bank.v[layer], table
        )  # fmt: skip
        assert np.abs(ref).max() > 0.1  # the rows attend real keys
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-6)


def test_plan_counts_requests():
    assert BoundedKVPlan(layout.padding_rows(3, 0)).num_requests == 3


def test_write_step_takes_the_managers_numpy_table_outside_jit():
    table = layout.plan_table(
        slot=[0], source=[0], source_len=[0], written=[0], span=[2], step_tokens=[2], sink=[0], window=[2],
        window_includes_step=[False], sink_capacity=0, reverse=False,
    )  # fmt: skip
    cache = jnp.zeros((2, 1, 1, 2, 1), jnp.float32)
    k = np.array([1.0, 2.0], np.float32).reshape(1, 2, 1, 1)
    new_k, _, _ = write_step(cache, cache, k, k, table, reverse=False)
    np.testing.assert_array_equal(np.asarray(new_k[0, 0, 0, :, 0]), [1.0, 2.0])
