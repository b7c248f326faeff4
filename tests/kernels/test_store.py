"""The store op (`store_step`) against a brute-force NumPy write, in every implementation and mode.

The oracle copies one token at a time into a float64 copy of the cache. Tables come from the host
planner (`cases.make_case`, i.e. `layout.plan_table` over random stream states): reversed step order,
padding rows, writes split at the ring's wrap, spans from 0 up to T (also longer than the window), slot
capacities that are not a multiple of 8. A kernel passes when the whole new cache equals the oracle's bit
for bit: every written entry, and every byte outside the write ranges unchanged. Step tokens the table
does not copy are NaN (past STEP_TOKENS) or finite but not written (past the span), so copying one shows.

Cases sharing (R, G, D, T, C, reverse) are concatenated into one call (requests stacked, slots shifted),
so each implementation compiles five programs per dtype, among them every path of the TPU kernel: direct
(float32, D 128), tiled (bfloat16 or D 256; tiles of one token at C 27) and lanes (D 64 with C 300: whole
lane tiles and a partial one; D 80 with C 27, a slot shorter than a lane tile). Modes: the XLA loop;
the TPU kernel in TPU interpret mode with the race detector on (which simulates its DMAs and semaphores
and raises on an out-of-bounds access) and in the HLO interpreter (`interpret=True`); the GPU kernel in
the HLO interpreter. Then dispatch ("auto" follows the lowering platform), input errors, and what the real TPU
compiler (libtpu, no TPU needed) and the Triton/ptxas toolchain make of the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import store, store_step, store_tpu, tpu_blocks, tpu_compiler
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import offline_tpu
from mstar_jax.resources.kv.bounded import attention as bounded_attention
from mstar_jax.resources.kv.bounded import layout
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan, write_step
from tests.kernels import cases


def store_reference(cache: np.ndarray, step: np.ndarray, table: np.ndarray, *, reverse: bool) -> np.ndarray:
    """f64[S, R, G, C, D]: `cache[slot, :, :, slot_start + t] = step[rows of b, step_offset ± t]`.

    Args:
      cache: [S, R, G, C, D] one layer's slots.
      step: [N, T, G, D] the step's keys (or values), N = B * R.
      table: i32[B, ROW_INTS].
      reverse: ranges copy step tokens counting down.
    """
    out = np.array(cache, np.float64)
    step = np.asarray(step, np.float64)
    rows = cache.shape[1]
    for b, row in enumerate(table):
        for w in range(tbl.NUM_WRITES):
            step_offset, slot_start, length = (int(row[col]) for col in tbl.write_cols(w))
            for t in range(length):
                token = step_offset - t if reverse else step_offset + t
                for r in range(rows):
                    out[row[tbl.SLOT], r, :, slot_start + t] = step[b * rows + r, token]
    return out


def _one_row_table(*, written: int, span: int, window: int, reverse: bool) -> np.ndarray:
    """Slot 1, sink 0, no source: the ring of `window` entries, `written` before the step."""
    return layout.plan_table(
        slot=[1], source=[0], source_len=[0], written=[written], span=[span], step_tokens=[span], sink=[0],
        window=[window], window_includes_step=[False], sink_capacity=0, reverse=reverse,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reverse", "slot"),
    [
        # Window 4, n = 3, span 3: stream positions 3, 4, 5 sit at ring offsets 3, 0, 1, so the write is
        # split at the wrap: token 0 -> offset 3, then tokens 1, 2 -> offsets 0, 1; offset 2 keeps -1.
        (False, [11.0, 12.0, -1.0, 10.0]),
        # Reversed, position 3 holds the last token (2), position 4 token 1 and position 5 token 0.
        (True, [11.0, 10.0, -1.0, 12.0]),
    ],
)
def test_reference_by_hand(reverse, slot):
    table = _one_row_table(written=3, span=3, window=4, reverse=reverse)
    cache = np.full((3, 1, 1, 4, 1), -1.0)  # 2 slots + padding, R = G = D = 1, C = 4
    step = np.array([10.0, 11.0, 12.0]).reshape(1, 3, 1, 1)
    out = store_reference(cache, step, table, reverse=reverse)
    np.testing.assert_array_equal(out[1, 0, 0, :, 0], slot)
    np.testing.assert_array_equal(out[[0, 2]], cache[[0, 2]])  # other slots untouched


# --- cases: planner tables in a few shared geometries ------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class StoreCase:
    """One concatenated store call: caches filled with random finite values, the planner's table."""

    name: str
    cache_k: np.ndarray  # [S, R, G, C, D]
    cache_v: np.ndarray
    k: np.ndarray  # [N, T, G, D]; NaN past each row's STEP_TOKENS
    v: np.ndarray
    table: np.ndarray  # i32[B, ROW_INTS]
    reverse: bool


def _concatenate(name: str, group: list[cases.KernelCase], *, capacity: int, dtype, seed: int) -> StoreCase:
    tables, slots = [], 0
    for c in group:
        assert c.cache_k.shape[3] == capacity, (c.name, c.cache_k.shape)
        table = c.table.copy()
        table[:, tbl.SLOT] += slots
        tables.append(table)
        slots += c.cache_k.shape[0]
    rng = np.random.default_rng(seed)
    shape = (slots, *group[0].cache_k.shape[1:])
    return StoreCase(
        name=name,
        cache_k=rng.standard_normal(shape).astype(dtype),
        cache_v=rng.standard_normal(shape).astype(dtype),
        k=np.concatenate([c.k for c in group]).astype(dtype),
        v=np.concatenate([c.v for c in group]).astype(dtype),
        table=np.concatenate(tables),
        reverse=group[0].reverse,
    )


def _forward_group(dtype, head_dim: int) -> list[cases.KernelCase]:
    """R 1, G 2, T 8, C 27: decode and chunk rows, wraps, a window shorter than the step."""
    c = {"dtype": dtype, "steps": 8, "min_slot_tokens": 27, "heads": 2, "kv_heads": 2, "head_dim": head_dim}
    return [
        cases.make_case("decode", seed=1, batch=4, sink=3, window=24, step_tokens=1, **c),
        # sink 2, window 8 (rings of 8 inside the 27-token slot): n up to ~40, spans of 8 wrap.
        cases.make_case(
            "chunk_wraps", seed=2, batch=3, sink=2, window=8, source_len=0, written=[5, 9, 33], **c
        ),
        # A window of 5 under 8-token spans: only each span's last 5 tokens are written.
        cases.make_case("window_shorter_than_step", seed=3, batch=2, sink=0, window=5, **c),
        # The sink's written part: sink 10 over sources of 3, 0, 7.
        cases.make_case(
            "sink_over_source", seed=4, batch=3, sink=10, window=8, source_len=[3, 0, 7], written=[2, 30, 50],
            **c,
        ),
        # Bucket padding: 5, 8 and 1 real tokens; spans 5, 3 and 0 (a read-only row); two padding rows.
        cases.make_case(
            "bucket_padded", seed=5, batch=3, step_tokens=[5, 8, 1], spans=[5, 3, 0], padding_rows=2, **c
        ),
    ]  # fmt: skip


def _forward(dtype) -> StoreCase:
    """D 128: the TPU kernel's direct path (float32) and tiled path in tiles of one token (bfloat16)."""
    return _concatenate("forward", _forward_group(dtype, 128), capacity=27, dtype=dtype, seed=11)


def _forward_d80(dtype) -> StoreCase:
    """The same tables at D 80: the TPU kernel's lanes path over a slot shorter than a lane tile."""
    return _concatenate("forward_d80", _forward_group(dtype, 80), capacity=27, dtype=dtype, seed=14)


def _reversed(dtype) -> StoreCase:
    """Reversed step order, R 2, G 1, D 128, T 5, C 16 (tile-aligned, the TPU kernel's 8-token tiles)."""
    c = {
        "dtype": dtype, "steps": 5, "min_slot_tokens": 16, "rows_per_request": 2, "heads": 2, "kv_heads": 1,
        "head_dim": 128,
    }  # fmt: skip
    group = [
        cases.make_case(
            "reverse_wraps", seed=6, batch=3, sink=2, window=7, source_len=0, written=[4, 11, 60], **c
        ),
        # n = sink - 1, sink, sink + window, sink + window + 1: the sink fills, the ring starts and wraps.
        cases.make_case(
            "reverse_sink_to_ring", seed=7, batch=4, sink=5, window=11, source_len=0, written=[2, 4, 13, 17],
            padding_rows=1, **c,
        ),
    ]  # fmt: skip
    return _concatenate("reversed", group, capacity=16, dtype=dtype, seed=12)


def _wide_heads(dtype) -> StoreCase:
    """D 256 (the TPU kernel's tiled path in float32 too; two token blocks of the GPU kernel), T 12."""
    c = {"dtype": dtype, "steps": 12, "min_slot_tokens": 24, "head_dim": 256, "heads": 1, "kv_heads": 1}
    group = [
        cases.make_case(
            "wide_wraps", seed=8, batch=3, sink=4, window=20, source_len=0, written=[0, 19, 70], **c
        ),
        cases.make_case("wide_padding", seed=9, batch=1, sink=4, window=20, padding_rows=1, **c),
    ]  # fmt: skip
    return _concatenate("wide_heads", group, capacity=24, dtype=dtype, seed=13)


def _lanes_group(dtype) -> list[cases.KernelCase]:
    """Reversed, R 2, G 1, D 64, T 12, sink 4 and a ring of 296: C 300, two lane tiles and 44 tokens."""
    c = {
        "dtype": dtype, "steps": 12, "rows_per_request": 2, "heads": 2, "kv_heads": 1, "head_dim": 64,
        "sink": 4, "window": 296, "source_len": 0, "reverse": True,
    }  # fmt: skip
    # Stream position p >= 4 sits at slot offset 4 + (p - 4) % 296. Written n: 0 and 2, the sink's end and
    # the ring's start share lane tile 0; 120 (10 of 12 tokens) and 716 (past two wraps, 7 real tokens)
    # cross offset 128; 250 crosses 256 into the partial tile; 294 writes 294..299 and wraps to 4..9.
    return [
        cases.make_case(
            "lanes_tiles", seed=15, batch=6, written=[0, 2, 120, 250, 294, 716], step_tokens=[12] * 5 + [7],
            spans=[12, 12, 10, 12, 12, 7], **c,
        ),
        # A read-only row (span 0), a chunk ending at offset 255 (short of the partial tile), two padding
        # rows.
        cases.make_case(
            "lanes_padding", seed=16, batch=2, written=[130, 244], spans=[0, 12], padding_rows=2, **c
        ),
    ]  # fmt: skip


def _lanes(dtype) -> StoreCase:
    """D 64, C 300: the TPU kernel's lanes path across whole lane tiles and the partial last one."""
    return _concatenate("lanes", _lanes_group(dtype), capacity=300, dtype=dtype, seed=17)


GEOMETRIES = (_forward, _forward_d80, _reversed, _wide_heads, _lanes)
DTYPES = [pytest.param(np.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def test_cases_cover_what_the_planner_makes():
    seen = dict.fromkeys(["wrap", "sink_write", "padding", "read_only", "span_T"], 0)
    for make in GEOMETRIES:
        case = make(np.float32)
        for row in case.table:
            lengths = [int(row[tbl.write_cols(w)[2]]) for w in range(tbl.NUM_WRITES)]
            seen["padding"] += row[tbl.STEP_TOKENS] == 0
            seen["read_only"] += row[tbl.STEP_TOKENS] > 0 and sum(lengths) == 0
            seen["wrap"] += lengths[2] > 0
            seen["sink_write"] += lengths[0] > 0
            seen["span_T"] += sum(lengths) == case.k.shape[1]
    assert all(seen.values()), seen
    assert _forward(np.float32).cache_k.shape[3] == 27  # a slot capacity that is not a multiple of 8
    # Spans of 8 over a window of 5: each row writes only the 5 entries the ring keeps.
    (short,) = (c for c in _forward_group(np.float32, 128) if c.name == "window_shorter_than_step")
    assert [int(sum(row[tbl.write_cols(w)[2]] for w in range(3))) for row in short.table] == [5, 5]
    # The lanes geometry: ranges across the lane tiles' boundaries 128 and 256 (into the partial tile
    # [256, 300)), one up to the slot's end, and the sink's end sharing tile 0 with the ring's start.
    lanes = _lanes(np.float32)
    assert lanes.cache_k.shape[3] == 300
    ranges = [
        [(int(row[tbl.write_cols(w)[1]]), int(row[tbl.write_cols(w)[2]])) for w in range(3)]
        for row in lanes.table
    ]
    spans = [(start, n) for row in ranges for start, n in row if n]
    assert {b for start, n in spans for b in (128, 256) if start < b < start + n} == {128, 256}
    assert any(start + n == 300 for start, n in spans)
    assert any(sink[1] and ring[1] and sink[0] + sink[1] == ring[0] for sink, ring, _ in ranges)


# --- every implementation against the oracle ---------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("reverse", "implementation", "interpret"),
    compiler_options=cases.fast_compile_options(),
)
def _store(cache_k, cache_v, k, v, table, *, reverse, implementation, interpret):
    return store_step(
        cache_k, cache_v, k, v, table, reverse=reverse, implementation=implementation, interpret=interpret
    )


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _check(case: StoreCase, new_k, new_v) -> None:
    for name, old, new, step in (("k", case.cache_k, new_k, case.k), ("v", case.cache_v, new_v, case.v)):
        assert new.shape == old.shape, (name, new.shape)
        assert new.dtype == old.dtype, (name, new.dtype)
        want = store_reference(old, step, case.table, reverse=case.reverse).astype(old.dtype)
        wrong = np.argwhere((_bits(new) != _bits(want)).any(axis=(1, 2, 4)))  # (slot, offset) pairs
        written = np.argwhere((_bits(want) != _bits(old)).any(axis=(1, 2, 4)))
        written = {tuple(p) for p in written.tolist()}
        outside = [tuple(p) for p in wrong.tolist() if tuple(p) not in written]
        assert not outside, f"{case.name} {name}: entries outside the write ranges changed at {outside[:8]}"
        assert not len(wrong), f"{case.name} {name}: written entries differ at {wrong[:8].tolist()}"


# The race detector compares DMAs only with two simulated cores: with one it missed two DMAs in flight to
# the same bytes (see test_race_detector_sees_two_requests_writing_one_slot).
RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
MODES = {
    "xla": ("xla", False),
    "tpu_interpret": ("pallas_tpu", RACES),
    "tpu_hlo_interpret": ("pallas_tpu", True),
    "gpu_hlo_interpret": ("pallas_gpu", True),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_the_oracle(mode, dtype):
    implementation, interpret = MODES[mode]
    for make in GEOMETRIES:
        case = make(dtype)
        try:
            new_k, new_v = _store(
                case.cache_k, case.cache_v, case.k, case.v, case.table,
                reverse=case.reverse, implementation=implementation, interpret=interpret,
            )  # fmt: skip
            new_k, new_v = jax.device_get((new_k, new_v))
            races = cases.races_found() if isinstance(interpret, pltpu.InterpretParams) else None
        finally:
            if isinstance(interpret, pltpu.InterpretParams):
                pltpu.reset_tpu_interpret_mode_state()  # also forgets the races found
        assert races is not True, f"{case.name}: TPU interpret mode detected a data race"
        _check(case, new_k, new_v)


def test_race_detector_sees_two_requests_writing_one_slot():
    # Two requests naming slot 1 both write offsets 0..2 (no planner would): the detector must flag it,
    # or its silence in test_matches_the_oracle proves nothing.
    # The simulated cores run as threads, and the detector sees the race in most interleavings, not all
    # (it missed once in four runs of the file): it must see it in one of a few runs.
    row = _one_row_table(written=0, span=3, window=4, reverse=False)
    table = np.concatenate([row, row])
    cache = np.zeros((3, 1, 1, 8, 128), np.float32)
    step = np.ones((2, 3, 1, 128), np.float32)
    seen = []
    for _ in range(4):
        jax.block_until_ready(
            store_step(
                cache, cache, step, step, table, reverse=False, implementation="pallas_tpu", interpret=RACES
            )
        )
        seen.append(cases.races_found())
        pltpu.reset_tpu_interpret_mode_state()
        if seen[-1] is None:
            pytest.skip("this JAX hides TPU interpret mode's race detector")
        if seen[-1]:
            break
    assert any(seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("make", [_lanes, _wide_heads], ids=["lanes", "tiled"])
def test_single_buffered_windows_match_the_oracle(monkeypatch, make):
    # Windows past the VMEM budget are not double-buffered: each request waits for the previous one's
    # write-back before reading into the same buffers. Called directly: "auto"'s jit would reuse a trace.
    monkeypatch.setattr(store_tpu, "VMEM_BUDGET", 0)
    case = make(np.float32)
    try:
        new_k, new_v = jax.device_get(
            store_tpu.store_step_tpu(
                case.cache_k, case.cache_v, case.k, case.v, case.table, reverse=case.reverse, interpret=RACES
            )
        )
        races = cases.races_found()
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    assert races is not True, f"{case.name}: TPU interpret mode detected a data race"
    _check(case, new_k, new_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_xla_store_of_one_token_matches_the_oracle(batch, reverse, dtype):
    # T = 1 (decode), which the geometries above never take: random stream states (writes into the sink,
    # the ring and past its wraps), R 2, a read-only row where B > 1, two padding rows; and a table of
    # padding rows only changes nothing.
    c = {"rows_per_request": 2, "heads": 2, "kv_heads": 2, "head_dim": 64, "sink": 3, "window": 7}
    spans = [1] * (batch - 1) + [0 if batch > 1 else 1]
    one = cases.make_case(
        "one_token", seed=20 + batch, batch=batch, steps=1, slots=batch + 2, source_len=0, spans=spans,
        padding_rows=2, reverse=reverse, dtype=dtype, **c,
    )  # fmt: skip
    case = _concatenate("one_token", [one], capacity=one.cache_k.shape[3], dtype=dtype, seed=21)
    assert case.k.shape[1] == 1
    assert sum(row[tbl.write_cols(w)[2]] for row in case.table for w in range(3)) > 0  # something written
    store_xla = functools.partial(_store, reverse=reverse, implementation="xla", interpret=False)
    _check(case, *jax.device_get(store_xla(case.cache_k, case.cache_v, case.k, case.v, case.table)))

    padding = layout.padding_rows(case.table.shape[0], case.cache_k.shape[0] - 1)
    same_k, same_v = jax.device_get(store_xla(case.cache_k, case.cache_v, case.k, case.v, padding))
    np.testing.assert_array_equal(_bits(same_k), _bits(case.cache_k))
    np.testing.assert_array_equal(_bits(same_v), _bits(case.cache_v))


@pytest.mark.parametrize("steps", [1, 4])
def test_xla_store_after_reads_stays_in_place(steps):
    # The XLA store runs after the reads behind `after` without copying the layer. (Straight-line updates
    # after an `optimization_barrier` would not: XLA:CPU removes barriers before it places copies.)
    specs = _specs(slots=65, capacity=64, steps=steps, batch=8)

    def step(cache_k, cache_v, k, v, table):
        after = cache_k[table[:, tbl.SLOT], :, :, 0].sum() + cache_v[table[:, tbl.SLOT]].sum()
        return store.store_step_after(
            cache_k, cache_v, k, v, table, after, reverse=False, implementation="xla"
        )

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*specs).compile()
    layer = int(np.prod(specs[0].shape)) * 4
    assert offline_tpu.large_copies(compiled, layer // 4) == []
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * layer


def test_casts_the_step_to_the_cache_dtype():
    table = _one_row_table(written=0, span=2, window=2, reverse=False)
    cache = np.zeros((2, 1, 1, 8, 128), jnp.bfloat16)
    step = np.broadcast_to(np.array([1.5, -2.25], np.float32)[None, :, None, None], (1, 2, 1, 128))
    for implementation, interpret in MODES.values():
        new_k, _ = store_step(
            cache, cache, step, step, table, reverse=False, implementation=implementation, interpret=interpret
        )
        assert new_k.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(new_k[1, 0, 0, :2, 0], np.float32), [1.5, -2.25])
    pltpu.reset_tpu_interpret_mode_state()


# --- dispatch ---------------------------------------------------------------------------------------------


def _specs(*, slots=17, rows=1, groups=2, capacity=16, dim=128, steps=4, batch=2, dtype=jnp.float32):
    cache = jax.ShapeDtypeStruct((slots, rows, groups, capacity, dim), dtype)
    step = jax.ShapeDtypeStruct((batch * rows, steps, groups, dim), dtype)
    return cache, cache, step, step, jax.ShapeDtypeStruct((batch, tbl.ROW_INTS), jnp.int32)


def _lowered_text(platform: str, *, implementation="auto", interpret=False, **shape) -> str:
    fn = functools.partial(store_step, reverse=True, implementation=implementation, interpret=interpret)
    lowered = jax.jit(fn, donate_argnums=(0, 1)).trace(*_specs(**shape)).lower(lowering_platforms=(platform,))
    return lowered.as_text()


@pytest.mark.parametrize(
    ("platform", "kernel"), [("tpu", "store_step_tpu"), ("cuda", "store_step_gpu"), ("cpu", None)]
)
def test_auto_lowers_the_kernel_of_the_lowering_platform(platform, kernel):
    text = _lowered_text(platform)
    kernels = [k for k in ("store_step_tpu", "store_step_gpu") if k in text]
    assert kernels == ([kernel] if kernel else []), kernels
    assert ("stablehlo.while" in text) == (kernel is None)  # the XLA loop only where no kernel runs


@pytest.mark.parametrize("dim", [64, 80, 192])
def test_auto_takes_the_kernel_for_head_dims_off_the_lane_tile(dim):
    # TPU lays such a cache out as [.., D, C] when C pads to lane tiles less than D: the lanes path.
    text = _lowered_text("tpu", dim=dim, capacity=300)
    assert "store_step_tpu" in text
    assert "stablehlo.while" not in text


def test_auto_takes_the_xla_loop_where_the_kernel_declines():
    # TPU lays these out other than the kernel views them: C % 8 != 0 with D = 128 (not row-major), and
    # D % 128 != 0 with C padding more than D to whole lane tiles (16 of 128 lanes against 64; 136 of 256
    # against 96 of 128: D stays in lanes); the kernel declines them.
    for shape in ({"capacity": 27}, {"dim": 64}, {"dim": 96, "capacity": 136}):
        text = _lowered_text("tpu", **shape)
        assert "store_step_tpu" not in text, shape
        assert "stablehlo.while" in text, shape
        with pytest.raises(NotImplementedError, match="pad C"):  # an explicit request is not rerouted
            _lowered_text("tpu", implementation="pallas_tpu", **shape)


def test_explicit_kernels_decline_what_they_cannot_do():
    with pytest.raises(NotImplementedError, match="TPU interpret mode"):
        _lowered_text("cuda", implementation="pallas_gpu", interpret=pltpu.InterpretParams())
    with pytest.raises(NotImplementedError, match="float16"):
        _lowered_text("tpu", implementation="pallas_tpu", dtype=jnp.float16)


def test_auto_on_cpu_stores_in_place():
    specs = _specs(slots=65, capacity=64, steps=4, batch=8)
    compiled = (
        jax.jit(functools.partial(store_step, reverse=False), donate_argnums=(0, 1)).lower(*specs).compile()
    )
    layer = int(np.prod(specs[0].shape)) * 4
    assert offline_tpu.large_copies(compiled, layer // 4) == []
    assert compiled.memory_analysis().alias_size_in_bytes == 2 * layer


def test_write_step_and_attend_pass_the_implementation_through(monkeypatch):
    calls = []

    def fake_kernel(name):
        def kernel(ck, cv, k, v, table, *, reverse, interpret):
            calls.append((name, reverse, interpret))
            return ck, cv

        return kernel

    monkeypatch.setattr(store, "_pallas_implementation", fake_kernel)
    marker = object()  # stands for a `pltpu.InterpretParams(...)`: passed through untouched
    cache_k, cache_v, k, v, table = (np.zeros(s.shape, s.dtype) for s in _specs())
    after = np.ones(3)
    for name in ("pallas_tpu", "pallas_gpu"):
        *_, out = write_step(
            cache_k, cache_v, k, v, table, reverse=True, after=after, implementation=name, interpret=marker
        )
        assert out is after
    assert calls == [("pallas_tpu", True, marker), ("pallas_gpu", True, marker)]

    forwarded = {}

    def record_write(*args, **kwargs):
        forwarded.update(kwargs)
        return args[0], args[1], kwargs["after"]

    monkeypatch.setattr(bounded_attention, "sink_window_attention", lambda *a, **kw: a[0])
    monkeypatch.setattr(bounded_attention, "write_step", record_write)
    config = dataclasses.make_dataclass(
        "Config", ["max_retained", "query_window", "reverse_step_order", "num_layers", "max_source_len"]
    )
    cache = dataclasses.make_dataclass("Cache", ["k", "v"])((cache_k,), (cache_v,))
    bounded_attention.attend(
        cache, cache, BoundedKVPlan(table), 0, k, k, v, config=config(8, None, True, 1, 4),
        implementation="pallas_gpu", interpret=marker,
    )  # fmt: skip
    assert (forwarded["implementation"], forwarded["interpret"]) == ("pallas_gpu", marker)


# --- input errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "mutate", "error", "match"),
    [
        (0, lambda x: x[0], ValueError, r"cache_k has shape \(1, 2, 16, 128\) \(rank 4\); expected rank 5"),
        (1, lambda x: x[:, :, :, :8], ValueError, "cache_v is float32.*expected cache_k's"),
        (1, lambda x: x.astype(jnp.bfloat16), ValueError, "cache_v is bfloat16"),
        (2, lambda x: x[:, :, :1], ValueError, r"k has shape \(2, 4, 1, 128\); expected .* G = 2"),
        (2, lambda x: x.astype(jnp.int32), ValueError, "k has dtype int32; expected a floating dtype"),
        (3, lambda x: x[:, :2], ValueError, "v has shape .* expected k's shape"),
        (4, lambda x: x.astype(jnp.int64), ValueError, "table has dtype int64; expected int32"),
        (4, lambda x: x[:, :5], ValueError, r"expected \[B, ROW_INTS\] with ROW_INTS = 26"),
        (4, lambda x: x[:1], ValueError, r"k should have 1 rows \(B \* R, request-major\); k has 2"),
    ],
    ids=["cache_rank", "cache_v_shape", "cache_v_dtype", "k_heads", "k_dtype", "v_shape", "table_dtype",
         "table_columns", "table_rows"],
)  # fmt: skip
def test_input_errors_name_the_argument(index, mutate, error, match):
    arrays = [np.zeros(s.shape, s.dtype) for s in _specs()]
    arrays[index] = mutate(arrays[index])
    with pytest.raises(error, match=match):
        store_step(*arrays, reverse=False)


def test_settings_errors():
    arrays = [np.zeros(s.shape, s.dtype) for s in _specs()]
    with pytest.raises(TypeError, match="reverse=1 must be a bool"):
        store_step(*arrays, reverse=1)
    with pytest.raises(ValueError, match="implementation='mosaic'"):
        store_step(*arrays, reverse=False, implementation="mosaic")


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"pin_to_hbm": 1}, TypeError, "pin_to_hbm=1 must be None .* or a bool"),
        ({"pin_to_hbm": "yes"}, TypeError, "pin_to_hbm='yes' must be None"),
        ({"pin_to_hbm": True, "interpret": True}, ValueError, "interpret mode refuses the pin"),
        ({"pin_to_hbm": True, "interpret": pltpu.InterpretParams()}, ValueError, "refuses the pin"),
    ],
    ids=["int", "str", "interpret", "interpret_params"],
)
def test_tpu_pin_setting_errors(settings, error, match):
    arrays = [np.zeros(s.shape, s.dtype) for s in _specs()]
    with pytest.raises(error, match=match):
        store_tpu.store_step_tpu(*arrays, reverse=False, **settings)


@pytest.mark.parametrize(
    ("settings", "pinned"),
    [
        ({}, tpu_compiler.pins_aliased_operands()),
        ({"pin_to_hbm": True}, True),
        ({"pin_to_hbm": False}, False),
        ({"interpret": True}, False),  # whatever the libtpu: interpret mode refuses the pin
    ],
    ids=["default", "true", "false", "interpret"],
)
@pytest.mark.parametrize("dim", [128, 64], ids=["rows", "lanes"])
def test_tpu_pin_follows_the_setting_and_the_libtpu(settings, pinned, dim):
    fn = functools.partial(store_tpu.store_step_tpu, reverse=False, **settings)
    jaxpr = str(jax.make_jaxpr(fn)(*_specs(dim=dim, capacity=256)))
    assert jaxpr.count("with_memory_space_constraint") == (2 if pinned else 0)


# --- the real TPU compiler (libtpu, compile-only devices) ---------------------------------------------------

TPU_MISSING = offline_tpu.tpu_toolchain_missing()


def needs_libtpu(test):
    """The aot extra's marker, and a skip where its TPU compiler cannot run here."""
    return pytest.mark.aot(pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")(test))


def _compile_tpu(generation="v5e", **shape) -> jax.stages.Compiled:
    fn = functools.partial(store_step, reverse=True)  # "auto": the lowering platform's kernel
    return offline_tpu.compile_for_tpu(fn, *_specs(**shape), generation=generation, donate_argnums=(0, 1))


def _bytes_accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


# Each path of the TPU kernel: (dtype, D, C). The lanes path gets a C that is a multiple of neither 8 nor
# 128 (two lane tiles and a partial one), which TPU lays out with the tokens in lanes for D = 64.
TPU_PATHS = {
    "f32_direct": (jnp.float32, 128, 48),
    "bf16_tiled": (jnp.bfloat16, 128, 48),
    "f32_lanes": (jnp.float32, 64, 300),
    "bf16_lanes": (jnp.bfloat16, 64, 300),
}


@needs_libtpu
@pytest.mark.parametrize(
    ("generation", "path"),
    [("v5e", path) for path in TPU_PATHS]
    + [("v6e", "f32_direct"), ("v6e", "bf16_tiled"), ("v5p", "f32_lanes"), ("v5p", "bf16_lanes")],
)
def test_tpu_kernel_compiles_and_stores_in_place(generation, path):
    dtype, dim, capacity = TPU_PATHS[path]
    shape = {"slots": 65, "rows": 2, "groups": 2, "capacity": capacity, "dim": dim, "steps": 8, "batch": 8}
    compiled = _compile_tpu(generation, dtype=dtype, **shape)
    assert "store_step_tpu" in compiled.as_text()
    layer = int(np.prod(_specs(**shape)[0].shape)) * jnp.dtype(dtype).itemsize
    assert offline_tpu.large_copies(compiled, layer // 8) == []
    # Aliased whole (counted as laid out: the lanes path's C padded to whole lane tiles).
    assert compiled.memory_analysis().alias_size_in_bytes >= 2 * layer
    assert compiled.memory_analysis().temp_size_in_bytes < layer // 4


@needs_libtpu
@pytest.mark.parametrize("path", list(TPU_PATHS))
def test_tpu_bytes_accessed_follow_the_tokens_written_not_the_slots(path):
    dtype, dim, capacity = TPU_PATHS[path]

    def accessed(**shape):
        return _bytes_accessed(_compile_tpu(capacity=capacity, dim=dim, steps=8, dtype=dtype, **shape))

    # 17 slots or 257: the same bytes (XLA may prefetch the small step into VMEM for 17: a little more). Not
    # 256: slots padding less than C = 300 to lane tiles would take the lanes (see the layout test below).
    small, large = accessed(slots=17, batch=8), accessed(slots=257, batch=8)
    assert large <= 1.1 * small, (small, large)
    # 8 requests or 64: eight times the tokens written, about eight times the bytes.
    eight, many = accessed(slots=65, batch=8), accessed(slots=65, batch=64)
    assert 6 <= many / eight <= 10, (eight, many)
    # And within a multiple of the bytes written set by the unit: a token (direct), tiles of 8 tokens
    # (tiled), lane tiles of 128 tokens (lanes: at most the slot's 300 tokens read and written back per
    # request's 8).
    written = 2 * 64 * 2 * 8 * dim * jnp.dtype(dtype).itemsize
    assert many / written <= {"direct": 8, "tiled": 24, "lanes": 100}[path.split("_")[1]], many / written


@needs_libtpu
@pytest.mark.parametrize(
    ("shape", "tokens_in_lanes"),
    [
        ((65, 2, 2, 300, 64), True),
        ((65, 1, 8, 3004, 64), True),
        ((9, 1, 1, 120, 80), True),  # C < 128 padding less than D
        ((17, 1, 2, 16, 64), False),  # C pads 8x, D 2x
        ((65, 1, 8, 136, 96), False),  # C pads 1.9x, D 1.3x
        ((1025, 1, 2, 300, 64), False),  # S pads less than C: the slots take the lanes
        ((17, 1, 2, 256, 128), False),
    ],
)
def test_tokens_in_lanes_predicts_the_tpu_layout(shape, tokens_in_lanes):
    # The kernel's view of the cache (and whether it declines) rests on this prediction of XLA's choice.
    assert tpu_blocks.tokens_in_lanes(shape) == tokens_in_lanes
    compiled = offline_tpu.compile_for_tpu(
        lambda x: x * 2, jax.ShapeDtypeStruct(shape, jnp.bfloat16), generation="v5e"
    )
    layout = compiled.input_formats[0][0].layout.major_to_minor
    assert (layout == (0, 1, 2, 4, 3)) == tokens_in_lanes, layout


# --- the Triton kernel built for sm_90a (no GPU needed) -----------------------------------------------------


@pytest.mark.aot
def test_gpu_kernel_builds_without_spills():
    from mstar_jax.compile.offline_gpu import gpu_toolchain_missing, triton_kernel_stats

    if reason := gpu_toolchain_missing():
        pytest.skip(reason)
    for shape in ({"steps": 64, "dtype": jnp.float32}, {"steps": 1, "dim": 64, "dtype": jnp.bfloat16}):
        fn = functools.partial(store_step, reverse=True)
        lowered = jax.jit(fn).trace(*_specs(**shape)).lower(lowering_platforms=("cuda",))
        (stats,) = triton_kernel_stats(lowered, compute_capability="9.0")
        assert stats.name == "store_step_gpu"
        assert stats.spill_store_bytes == stats.spill_load_bytes == 0, stats
