"""The Pallas TPU (Mosaic) kernel against the float64 oracle.

One suite, three modes (JAX's INTERPRET-subclass pattern): on a TPU backend `TestCompiled` runs the
compiled kernel; elsewhere `TestHloInterpret` runs it in the HLO interpreter (`interpret=True`) and
`TestTpuInterpret` in TPU interpret mode (`pltpu.InterpretParams`), which simulates HBM, VMEM and the DMAs
of the pipeline, raises on any out-of-bounds access and runs the race detector. Lowering to Mosaic (with
Pallas' TPU block-shape checks) is tested on any backend.

Interpreting costs a compile per shape (seconds) and, in TPU interpret mode, a Python callback per ref
access, so cases that share their static settings are concatenated into one call: requests stacked,
slots and sources stacked with their table indices shifted, `T`, `C` and `L` padded with NaN (poison
the kernel must never read). Every case still poisons what it must not read (see `cases.py`) and must
give finite outputs equal to the oracle's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention import tpu_blocks, tpu_plan
from kernels_pallas.sink_window_attention.tpu import BlockSizes, sink_window_attention_tpu
from tests.kernels import cases

ON_TPU = jax.default_backend() == "tpu"
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
BF16_SCALE = 0.3  # bfloat16 runs also exercise an explicit scale (no extra compile)


@functools.partial(
    jax.jit,
    static_argnames=("max_retained", "query_window", "scale", "block_sizes", "interpret"),
    compiler_options=cases.fast_compile_options(),
)
def _attend(*arrays, max_retained, query_window, scale, block_sizes, interpret):
    return sink_window_attention_tpu(
        *arrays, max_retained=max_retained, query_window=query_window, scale=scale,
        block_sizes=block_sizes, interpret=interpret,
    )  # fmt: skip


def _arrays(case: cases.KernelCase) -> tuple[np.ndarray, ...]:
    return case.q, case.k, case.v, case.cache_k, case.cache_v, case.source_k, case.source_v, case.table


def _retained(case: cases.KernelCase) -> list[int]:
    return [int(sum(row[tbl.read_len(i)] for i in range(tbl.NUM_READS))) for row in case.table]


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths, constant_values=np.nan)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Cases with the same static settings concatenated into one call (see the module docstring)."""

    case: cases.KernelCase  # the concatenation
    parts: tuple[tuple[str, int, int, int], ...]  # (name, first row, rows, step tokens) per case


def _concatenate(group: list[cases.KernelCase]) -> Batch:
    steps = max(c.q.shape[1] for c in group)
    slot_len = max(c.cache_k.shape[3] for c in group)
    source_len = max(c.source_k.shape[3] for c in group)
    tables, parts, slots, sources, rows = [], [], 0, 0, 0
    for c in group:
        table = c.table.copy()
        table[:, tbl.SLOT] += slots
        table[:, tbl.SOURCE] += sources
        tables.append(table)
        parts.append((c.name, rows, c.q.shape[0], c.q.shape[1]))
        slots, sources, rows = slots + c.cache_k.shape[0], sources + c.source_k.shape[0], rows + c.q.shape[0]

    def stack(field: str, axis: int, size: int) -> np.ndarray:
        return np.concatenate([_pad(getattr(c, field), axis, size) for c in group])

    combined = dataclasses.replace(
        group[0],
        name="+".join(c.name for c in group),
        q=stack("q", 1, steps),
        k=stack("k", 1, steps),
        v=stack("v", 1, steps),
        cache_k=stack("cache_k", 3, slot_len),
        cache_v=stack("cache_v", 3, slot_len),
        source_k=stack("source_k", 3, source_len),
        source_v=stack("source_v", 3, source_len),
        table=np.concatenate(tables),
        max_retained=max(c.max_retained for c in group),
    )
    return Batch(combined, tuple(parts))


def _batches(group: list[cases.KernelCase]) -> list[Batch]:
    """One batch per set of static settings (R, H, G, D, query_window)."""
    by_key: dict[tuple, list[cases.KernelCase]] = {}
    for c in group:
        key = (c.rows_per_request, c.q.shape[2], c.k.shape[2], c.q.shape[3], c.query_window)
        by_key.setdefault(key, []).append(c)
    return [_concatenate(g) for g in by_key.values()]


def _boundary_cases(block: int, dtype) -> list[cases.KernelCase]:
    """Retained counts 0, 1, block - 1, block, block + 1 in each store, short windows and many slots."""
    lengths = [0, 1, block - 1, block, block + 1]
    common = {"dtype": dtype, "sources": 1, "window": block + 1, "max_source_len": block + 2}
    return [
        # sink 0, empty source: every retained key is in the slot's ring (read 3), from offset 0.
        cases.make_case("boundary_slot", seed=30, batch=5, sink=0, source_len=0, written=lengths, **common),
        # nothing written: every retained key is the source's window part (read 2).
        cases.make_case("boundary_source", seed=31, batch=5, sink=0, source_len=lengths, written=0, **common),
        # sink 3 over a 2-entry source: reads 0, 1 and 3 all non-empty.
        cases.make_case(
            "boundary_split",
            seed=32,
            batch=3,
            sink=3,
            source_len=2,
            written=[n - 2 for n in lengths[2:]],
            **common,
        ),
        # A window of 3 inside one block, at every phase of its ring.
        cases.make_case(
            "short_window", seed=33, batch=4, sink=2, window=3, written=[0, 3, 7, 41], dtype=dtype
        ),
        # 40 slots, 6 of them live, the rest idle (NaN).
        cases.make_case("many_slots", seed=34, batch=6, slots=40, dtype=dtype),
    ]


def _mixed_case(dtype) -> cases.KernelCase:
    """R = 2, G = 1 (4 query heads per KV head), a query window, a padding row, and T * H/G = 20 query rows
    (a partial last query block for blocks of 8 or 16)."""
    return cases.make_case(
        "r2_gqa4_query_window", seed=50, batch=3, rows_per_request=2, kv_heads=1, steps=5, sink=2,
        window=18, query_window=5, padding_rows=1, written=[0, 9, 60], dtype=dtype,
    )  # fmt: skip


def _check_batch(batch: Batch, out: np.ndarray, *, scale: float | None) -> None:
    expected = batch.case.reference_output(scale)
    tol = TOLERANCE[np.dtype(batch.case.q.dtype)]
    failures = []
    for name, first, rows, steps in batch.parts:
        got, want = out[first : first + rows], expected[first : first + rows]
        if not np.isfinite(got).all():
            failures.append(f"{name}: non-finite output (a masked or poisoned entry was used)")
        elif not np.allclose(got, want, rtol=tol, atol=tol):
            failures.append(f"{name}: max error {np.abs(got - want).max():.3g}")
        elif steps < out.shape[1] and np.any(got[:, steps:]):
            failures.append(f"{name}: nonzero output for padded step tokens")
    assert not failures, "\n".join(failures)


class _KernelSuite:
    """Tests shared by every mode; subclasses set how the kernel runs."""

    INTERPRET: bool | pltpu.InterpretParams = False
    # f32 runs small blocks (several per store, several query blocks); bf16 runs the default chooser.
    BLOCKS = BlockSizes(block_kv=16, block_q=16)  # 16 rows: the bf16 sublane tile on real TPUs
    DTYPES = (np.float32, jnp.bfloat16)
    RERUN = True

    def cases_for(self, dtype) -> list[cases.KernelCase]:
        return (
            cases.standard_cases(dtype) + _boundary_cases(self.BLOCKS.block_kv, dtype) + [_mixed_case(dtype)]
        )

    def run(self, case: cases.KernelCase, *, block_sizes=None, scale=None) -> np.ndarray:
        try:
            out = _attend(
                *_arrays(case), max_retained=case.max_retained, query_window=case.query_window,
                scale=scale, block_sizes=block_sizes, interpret=self.INTERPRET,
            )  # fmt: skip
            out = jax.block_until_ready(out)
        except Exception:
            if isinstance(self.INTERPRET, pltpu.InterpretParams):
                pltpu.reset_tpu_interpret_mode_state()  # else the next interpreted kernel inherits the mess
            raise
        if isinstance(self.INTERPRET, pltpu.InterpretParams) and self.INTERPRET.detect_races:
            assert cases.races_found() is not True, f"{case.name}: TPU interpret mode detected a data race"
        assert out.shape == case.q.shape
        assert out.dtype == case.q.dtype
        return np.asarray(out, np.float64)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_cases(self, dtype):
        if dtype not in self.DTYPES:
            pytest.skip(f"{np.dtype(dtype)} runs in the other modes")
        f32 = np.dtype(dtype) == np.float32
        block_sizes, scale = (self.BLOCKS, None) if f32 else (None, BF16_SCALE)
        for batch in _batches(self.cases_for(dtype)):
            out = self.run(batch.case, block_sizes=block_sizes, scale=scale)
            _check_batch(batch, out, scale=scale)
            if self.RERUN:  # the same bits again (a compile-cache hit, so nearly free)
                rerun = self.run(batch.case, block_sizes=block_sizes, scale=scale)
                np.testing.assert_array_equal(out, rerun)

    @pytest.mark.parametrize("stores", ["slots", "both"])
    def test_stores_read_transposed(self, stores):
        # Stores TPU lays out tokens-minor are read as [.., D, C] (`tpu_blocks.tokens_in_lanes`): slots of
        # 300 tokens (NaN past what the cases hold: blocks of 128 lanes, the last one partial) with 32-wide
        # heads, so the tokens pad least; "slots" keeps the short source bank heads-minor (the stores
        # differ), "both" pads it too.
        def widened(case: cases.KernelCase) -> cases.KernelCase:
            stores_of = ["cache_k", "cache_v"] + (["source_k", "source_v"] if stores == "both" else [])
            return dataclasses.replace(case, **{f: _pad(getattr(case, f), 3, 300) for f in stores_of})

        picked = [c for c in cases.standard_cases(np.float32) if c.q.shape[3] == 32][:4]
        assert picked
        for batch in _batches([widened(c) for c in picked]):
            case = batch.case
            assert tpu_blocks.tokens_in_lanes(case.cache_k.shape)
            assert tpu_blocks.tokens_in_lanes(case.source_k.shape) == (stores == "both")
            _check_batch(batch, self.run(case, block_sizes=self.BLOCKS), scale=None)


@pytest.mark.skipif(not ON_TPU, reason="compiled Mosaic needs a TPU")
class TestCompiled(_KernelSuite):
    INTERPRET = False


@pytest.mark.skipif(ON_TPU, reason="the compiled suite runs on TPU")
class TestHloInterpret(_KernelSuite):
    INTERPRET = True
    BLOCKS = BlockSizes(block_kv=8, block_q=8)  # the interpreter takes any multiple of 8: more blocks

    def test_empty_stores(self):
        # No source bank (L = 0) and no slot tokens (C = 0): both stores are stand-ins, nothing is
        # retained, and each query attends only the step's own keys.
        case = cases.make_case("empty_stores", seed=60, batch=2, sink=0, window=0, max_source_len=0)
        case = dataclasses.replace(case, cache_k=case.cache_k[:, :, :, :0], cache_v=case.cache_v[:, :, :, :0])
        assert _retained(case) == [0, 0]
        out = self.run(case, block_sizes=self.BLOCKS)
        np.testing.assert_allclose(out, case.reference_output(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ON_TPU, reason="the compiled suite runs on TPU")
class TestTpuInterpret(_KernelSuite):
    INTERPRET = pltpu.InterpretParams(detect_races=True)
    DTYPES = (np.float32,)  # bf16 numerics are the HLO interpreter's; this mode checks DMAs and races
    RERUN = False

    def cases_for(self, dtype) -> list[cases.KernelCase]:
        # A callback per ref access, so a subset: every read range, ring wraps, padding rows and idle
        # slots, retained counts 0, 1, block - 1, block, block + 1, and R = 2, G = 1 with a query window.
        names = {"many_wraps", "sink_over_source", "padding_rows"}
        subset = [c for c in cases.standard_cases(dtype) if c.name in names]
        return subset + _boundary_cases(self.BLOCKS.block_kv, dtype)[:1] + [_mixed_case(dtype)]


def test_store_plan_walks_touched_blocks_then_holds():
    # Blocks of 4 over a 20-entry store, 4 steps. Request 0 reads [2, 7) and [13, 14): blocks 0, 1, 3.
    # Request 1 reads nothing: it holds request 0's last block (3) and last entry. Request 2 reads [16, 20).
    table = np.zeros((3, tbl.ROW_INTS), np.int32)
    table[0, [tbl.read_start(3), tbl.read_len(3), tbl.read_start(4), tbl.read_len(4)]] = [2, 5, 13, 1]
    table[2, [tbl.read_start(1), tbl.read_len(1)]] = [16, 4]
    store_ids = jnp.asarray([1, 0, 2], jnp.int32)
    plan = jax.jit(tpu_plan.store_plan, static_argnums=(1, 2, 3, 4, 6))
    blocks, entries, counts = plan(jnp.asarray(table), (1, 3, 4), 4, 5, 4, store_ids, 2)
    np.testing.assert_array_equal(counts, [3, 0, 1])
    # Past its count a request repeats its last block: the pipeline sees no new index, so issues no DMA.
    np.testing.assert_array_equal(np.reshape(blocks, (3, 4)), [[0, 1, 3, 3], [3, 3, 3, 3], [4, 4, 4, 4]])
    # One entry per row into [S * R] (all G KV heads move together): slot * R + row; request 1's rows
    # hold request 0's last row, 1 * 2 + 1 = 3.
    np.testing.assert_array_equal(entries, [2, 3, 3, 3, 4, 5])


def test_default_block_sizes_follow_tpu_tiles():
    for max_retained, query_rows in [(0, 1), (20, 2), (300, 64), (4096, 2048)]:
        blocks = BlockSizes.default(max_retained=max_retained, query_rows=query_rows)
        assert blocks.block_kv % 128 == 0
        assert 128 <= blocks.block_kv <= tpu_blocks.MAX_BLOCK_KV
        assert blocks.block_q is None or blocks.block_q % 16 == 0


def test_vmem_counts_tiles_as_mosaic_pads_them():
    # A [1024, 64] bf16 block fills 128 lanes per row, as [1024, 128] does; one row takes a 16-row tile.
    assert tpu_blocks.tile_bytes(1024, 64, 2) == tpu_blocks.tile_bytes(1024, 128, 2) == 1024 * 128 * 2
    assert tpu_blocks.tile_bytes(1, 128, 2) == 16 * 128 * 2
    assert tpu_blocks.tile_bytes(1, 128, 4) == 8 * 128 * 4
    # Stores read transposed ([G, D, block]) put keys in lanes, so a 64-wide head dim wastes nothing.
    assert tpu_blocks.tile_bytes(64, 1024, 2) == 64 * 1024 * 2
    # TPU puts in lanes the dim that pads least to 128 (verified against libtpu in test_store.py).
    shapes = [(65, 1, 8, 3008, 64), (65, 1, 8, 3008, 128), (17, 1, 2, 16, 64), (1025, 1, 2, 300, 64)]
    assert [tpu_blocks.tokens_in_lanes(shape) for shape in shapes] == [True, False, False, False]


def _vmem(block: int, *, source: int | None = None, slot: int | None = None, transposed, **shape) -> int:
    return tpu_blocks.vmem_bytes(
        transposed=transposed,
        kv_heads=shape["kv_heads"], block_q=shape["query_rows"], steps=shape["steps"],
        head_dim=shape["head_dim"], itemsize=shape["itemsize"],
        block_source=block if source is None else min(block, source),
        block_slot=block if slot is None else min(block, slot),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("head_dim", "stores", "block_kv"),
    [
        (128, {"source_len": 256, "slot_len": 3008}, 1024),
        (128, {}, 512),
        (64, {"source_len": 256, "slot_len": 3008, "transposed": (True, True)}, 2048),
    ],
    ids=["d128", "d128_full_blocks", "d64_transposed"],
)
def test_default_block_sizes_grow_for_decode_within_vmem(head_dim, stores, block_kv):
    # Decode, G = 8, H = 16, bf16, K = 3254 (C = 3008 slot tokens, L = 256 source). The chosen block is
    # the largest power of two whose tiled VMEM fits the budget: its double fails it (up to the cap).
    shape = {"query_rows": 2, "kv_heads": 8, "head_dim": head_dim, "itemsize": 2, "steps": 1}
    blocks = BlockSizes.default(max_retained=3254, **stores, **shape)
    assert blocks.block_kv == block_kv
    lengths = {"source": stores.get("source_len"), "slot": stores.get("slot_len")}
    lengths["transposed"] = stores.get("transposed", (False, False))
    assert _vmem(block_kv, **lengths, **shape) <= tpu_blocks.VMEM_BUDGET
    assert (
        block_kv == tpu_blocks.MAX_BLOCK_KV
        or _vmem(2 * block_kv, **lengths, **shape) > tpu_blocks.VMEM_BUDGET
    )


def test_default_block_sizes_shrink_for_wide_rows():
    # G = 64, D = 256, f32: the block shrinks below 128 rather than overflow VMEM; read transposed (D = 64)
    # keys are lanes, so the block stops at 128.
    wide = {"query_rows": 2, "kv_heads": 64, "itemsize": 4, "steps": 1}
    assert BlockSizes.default(max_retained=3254, head_dim=256, **wide).block_kv == 16
    transposed = {"head_dim": 64, "transposed": (True, True)}
    assert BlockSizes.default(max_retained=3254, **transposed, **wide).block_kv == 128


def test_rejects_what_it_cannot_do():
    case = cases.standard_cases()[0]
    arrays = _arrays(case)
    settings = {"max_retained": case.max_retained, "interpret": True}
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        sink_window_attention_tpu(*(x.astype(np.float16) for x in arrays[:7]), arrays[7], **settings)
    with pytest.raises(ValueError, match="must share one dtype"):
        sink_window_attention_tpu(arrays[0].astype(jnp.bfloat16), *arrays[1:], **settings)
    with pytest.raises(ValueError, match="query_window"):
        sink_window_attention_tpu(*arrays, **settings, query_window=0)
    with pytest.raises(ValueError, match="max_retained"):
        sink_window_attention_tpu(*arrays, max_retained=-1, interpret=True)
    with pytest.raises(ValueError, match=r"retains \d+ keys but max_retained=1"):
        sink_window_attention_tpu(*arrays, max_retained=1, interpret=True)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sink_window_attention_tpu(arrays[0][:, :, :3], *arrays[1:], **settings)
    with pytest.raises(ValueError, match="block_kv"):
        BlockSizes(block_kv=12)
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_kv=8, block_q=4)


@pytest.mark.parametrize(
    ("dtype", "block_sizes", "kwargs"),
    [
        (np.float32, BlockSizes(block_kv=16, block_q=16), {"steps": 8}),
        # Decode, a one-entry source bank: single key rows, which Mosaic's bf16 dot cannot take.
        (jnp.bfloat16, None, {"steps": 1, "query_window": 3, "max_source_len": 1}),
        (jnp.bfloat16, BlockSizes(block_kv=16), {"rows_per_request": 2, "kv_heads": 1, "head_dim": 128}),
    ],
    ids=["f32_small_blocks", "bf16_decode_query_window", "bf16_r2_mqa"],
)
def test_lowers_to_mosaic(dtype, block_sizes, kwargs):
    """The compiled path passes Pallas' TPU block-shape checks and lowers to Mosaic, even without a TPU."""
    case = cases.make_case("lower", seed=100, batch=2, dtype=dtype, **kwargs)
    fn = functools.partial(
        sink_window_attention_tpu, max_retained=case.max_retained, query_window=case.query_window,
        block_sizes=block_sizes,
    )  # fmt: skip
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _arrays(case)]
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    assert "sink_window_attention_tpu" in text
