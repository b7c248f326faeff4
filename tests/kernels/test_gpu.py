"""The Pallas GPU (Triton) kernel against the float64 oracle.

One suite, two modes: on a GPU backend every test runs the compiled kernel; elsewhere the same tests run
it in the Pallas HLO interpreter (`interpret=True`), with small blocks so that a few keys already span
several blocks. Every case poisons what must not be read with NaN (see `cases.py`) and requires finite
outputs that match the oracle.
"""

import functools
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import sink_window_attention, sink_window_attention_xla
from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.gpu import BlockSizes, sink_window_attention_gpu
from tests.kernels import cases

INTERPRET = jax.default_backend() != "gpu"
# Compiled Triton dots need blocks of >= 16; the interpreter takes any power of two, and 8 keeps it cheap.
BLOCKS = BlockSizes(block_q=8, block_k=8) if INTERPRET else BlockSizes(block_q=16, block_k=16)
BK = BLOCKS.block_k
# The same tiles, a decode-shaped step's retained walk split one key block a program (flash-decoding).
SPLIT = BlockSizes(block_q=16, block_k=BK, split_keys=BK)
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2, np.dtype(np.float16): 5e-3}


_COMPILER_OPTIONS = cases.fast_compile_options()


@functools.partial(
    jax.jit,
    static_argnames=("max_retained", "query_window", "scale", "block_sizes"),
    compiler_options=_COMPILER_OPTIONS,
)
def _attend(*arrays, max_retained, query_window, scale, block_sizes):
    return sink_window_attention_gpu(
        *arrays, max_retained=max_retained, query_window=query_window, scale=scale,
        block_sizes=block_sizes, interpret=INTERPRET,
    )  # fmt: skip


def _arrays(case: cases.KernelCase) -> tuple[np.ndarray, ...]:
    return case.q, case.k, case.v, case.cache_k, case.cache_v, case.source_k, case.source_v, case.table


def _run(case: cases.KernelCase, *, block_sizes: BlockSizes | None = BLOCKS, scale=None) -> np.ndarray:
    out = _attend(
        *_arrays(case), max_retained=case.max_retained, query_window=case.query_window, scale=scale,
        block_sizes=block_sizes,
    )  # fmt: skip
    assert out.shape == case.q.shape
    assert out.dtype == case.q.dtype
    return np.asarray(out, np.float64)


def _check(case: cases.KernelCase, **kwargs) -> np.ndarray:
    out = _run(case, **kwargs)
    assert np.isfinite(out).all(), f"{case.name}: non-finite output (a masked or poisoned entry was used)"
    tol = TOLERANCE[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, case.reference_output(kwargs.get("scale")), rtol=tol, atol=tol)
    return out


@functools.cache
def _standard_cases(dtype: np.dtype) -> dict[str, cases.KernelCase]:
    by_name = {case.name: case for case in cases.standard_cases(dtype)}
    assert len(by_name) == len(cases.standard_cases(dtype)), "standard case names must be distinct"
    return by_name


def _retained(case: cases.KernelCase) -> list[int]:
    return [int(sum(row[tbl.read_len(i)] for i in range(tbl.NUM_READS))) for row in case.table]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", [case.name for case in cases.standard_cases()])
def test_standard_cases(name, dtype):
    _check(_standard_cases(np.dtype(dtype))[name])


def _grid(case: cases.KernelCase, block_sizes: BlockSizes) -> tuple[int, ...]:
    """The grid of the kernel's pallas_call for `case`."""
    jaxpr = jax.make_jaxpr(
        functools.partial(
            sink_window_attention_gpu, max_retained=case.max_retained, query_window=case.query_window,
            block_sizes=block_sizes, interpret=INTERPRET,
        )
    )(*_arrays(case))  # fmt: skip
    (call,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    return tuple(call.params["grid_mapping"].grid)


@pytest.mark.slow
@pytest.mark.parametrize("name", [case.name for case in cases.standard_cases()])
def test_standard_cases_with_the_walk_split(name):
    case = _standard_cases(np.dtype(np.float32))[name]
    rows, steps, heads, _ = case.q.shape
    kv_heads = case.k.shape[2]
    query_blocks = -(-steps * (heads // kv_heads) // SPLIT.block_q)
    # Decode-shaped (one query block) over more than one split's keys: a program per split.
    splits = -(-case.max_retained // BK) if query_blocks == 1 and case.max_retained > BK else 0
    assert _grid(case, SPLIT) == (rows, kv_heads, splits or query_blocks)
    out = _check(case, block_sizes=SPLIT)
    if splits:  # another order of the same sums: equal to the one program's walk within rounding
        np.testing.assert_allclose(out, _run(case), rtol=1e-5, atol=1e-6)


def test_split_walk_of_a_long_decode_against_the_oracle():
    # 600 retained keys (sink 4 + window 596) over a source and a wrapped ring, split 8 keys a program:
    # 75 splits, most of which see only the window's keys; one row's retention is empty but for its step.
    case = cases.make_case(
        "long_decode", seed=120, batch=3, steps=1, heads=8, kv_heads=2, sink=4, window=596, slots=4,
        max_source_len=40, written=[0, 700, 1500], source_len=[30, 0, 12],
    )  # fmt: skip
    assert _grid(case, SPLIT) == (3, 2, -(-case.max_retained // BK))
    _check(case, block_sizes=SPLIT)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
def test_split_walk_with_two_rows_per_request_a_padding_row_and_both_score_terms(dtype):
    # Requests of 2, 1 and 0 step tokens on two rows each, then a padding row: each attention row must
    # take its own request's step tokens in the merge; a band of 3 and both score terms.
    case = cases.make_case(
        "split_rows", seed=122, batch=3, rows_per_request=2, steps=2, padding_rows=1, step_tokens=[2, 1, 0],
        window=30, query_window=3, written=[5, 40, 90], dtype=dtype,
    )  # fmt: skip
    terms = cases.score_terms(case, seed=122, rel_bias=True, sink_logits=True)
    assert _grid(case, SPLIT)[2] == -(-case.max_retained // BK) > 1
    out = sink_window_attention_gpu(
        *_arrays(case), max_retained=case.max_retained, query_window=case.query_window, block_sizes=SPLIT,
        interpret=INTERPRET, **terms,
    )  # fmt: skip
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(out, case.reference_output(**terms), rtol=tol, atol=tol)


def test_default_tiles_split_a_long_decode():
    # BlockSizes.default: 306 retained keys on 2 KV heads, float32: 4 programs a row's KV head would walk
    # 77 keys, under the least a split walks (128 keys, in key blocks of 32): 3 splits.
    case = cases.make_case("default_split", seed=123, batch=2, steps=1, window=300, written=[400, 1000])
    assert _arrays(case)[1].shape[2] == 2  # k: [B, T, G, D]
    blocks = BlockSizes.default(
        query_rows=2, head_dim=32, max_retained=case.max_retained, kv_heads=2, itemsize=4
    )
    assert (blocks.block_k, blocks.num_warps, blocks.split_keys) == (32, 8, 128)
    assert _grid(case, None) == (2, 2, 3)
    _check(case, block_sizes=None)


def test_the_split_rounds_a_row_alike_in_any_batch():
    # Each split's state and the fixed-order merge are per row: a row alone and among others agree bit
    # for bit.
    case = cases.make_case("batch", seed=121, batch=4, steps=1, window=40, written=[3, 50, 90, 200])
    arrays = _arrays(case)
    attend = functools.partial(
        sink_window_attention_gpu, max_retained=case.max_retained, block_sizes=SPLIT, interpret=INTERPRET
    )
    together = np.asarray(attend(*arrays))
    for row in range(4):
        one = [x[row : row + 1] for x in arrays[:3]] + list(arrays[3:7]) + [arrays[7][row : row + 1]]
        np.testing.assert_array_equal(np.asarray(attend(*one))[0], together[row])


# Retained counts 0, 1, BK - 1, BK, BK + 1, one request each, with step tokens in the reverse order, so
# the step keys' blocks and the query blocks (T * H/G = 2 * (BK + 1) rows) end partially covered too.
BOUNDARY_LENGTHS = [0, 1, BK - 1, BK, BK + 1]


@pytest.mark.parametrize(
    ("where", "lengths", "kwargs"),
    [
        # sink 0, empty source: every retained key is in the slot's ring (read 3).
        ("slot", BOUNDARY_LENGTHS, {"sink": 0, "source_len": 0, "written": BOUNDARY_LENGTHS}),
        # nothing written: every retained key is the source's window part (read 2).
        ("source", BOUNDARY_LENGTHS, {"sink": 0, "source_len": BOUNDARY_LENGTHS, "written": 0}),
        # sink 3 over a 2-entry source: reads 0, 1 and 3 all non-empty.
        (
            "split",
            BOUNDARY_LENGTHS[2:],
            {"sink": 3, "source_len": 2, "written": [n - 2 for n in BOUNDARY_LENGTHS[2:]]},
        ),
    ],
    ids=["slot", "source", "split"],
)
def test_block_boundary_lengths(where, lengths, kwargs):
    case = cases.make_case(
        f"boundary_{where}", seed=30, batch=len(lengths), slots=len(lengths) + 1, sources=1,
        window=BK + 1, max_source_len=BK + 2, steps=BK + 1, step_tokens=lengths[::-1], **kwargs,
    )  # fmt: skip
    assert _retained(case) == lengths
    _check(case)


@pytest.mark.parametrize("query_window", [1, 3])
def test_query_window_shorter_than_a_block(query_window):
    # Retention window 3 and a band of 1 or 3 keys, both well inside one 8-key block; chunks of 8 queries.
    case = cases.make_case(
        "short_windows", seed=40, batch=3, steps=BK, sink=2, window=3, query_window=query_window,
        written=[0, 2, 30],
    )  # fmt: skip
    _check(case)


def test_query_window_masks_whole_blocks():
    # No sink and a band of 2 over a window of 2 * BK + 1 retained keys: for every query the first
    # blocks hold no visible key at all, so the running max stays -inf across them.
    case = cases.make_case(
        "masked_blocks", seed=45, batch=3, sink=0, window=2 * BK + 1, query_window=2, source_len=[0, 0, 5],
        written=[BK, 3 * BK, 5 * BK],
    )  # fmt: skip
    assert min(_retained(case)) >= BK
    _check(case)


def test_idle_slots_padding_rows_and_two_rows_per_request():
    # One request among 6 slots (5 idle, NaN), two padding rows naming the padding slot, R = 2.
    case = cases.make_case(
        "idle", seed=50, batch=1, slots=6, padding_rows=2, rows_per_request=2, written=[70]
    )
    out = _check(case)
    np.testing.assert_array_equal(out[2:], 0.0)  # padding rows: zeros


def test_head_dim_not_a_power_of_two():
    _check(cases.make_case("head_dim24", seed=60, batch=2, head_dim=24, steps=3))


def test_without_a_source_bank():
    # L = 0: nothing to read from the bank, which the kernel replaces by a never-read placeholder.
    case = cases.make_case("no_source", seed=70, batch=2, max_source_len=0, written=[3, 40])
    assert case.source_k.shape[3] == 0
    _check(case)


def test_default_block_sizes_and_explicit_scale():
    case = cases.make_case("defaults", seed=80, batch=2, head_dim=64, steps=5, query_window=6)
    _check(case, block_sizes=None, scale=0.3)


def test_identical_bits_on_rerun():
    case = cases.standard_cases()[1]
    np.testing.assert_array_equal(_run(case), _run(case))


def test_empty_step_gives_empty_output():
    case = cases.make_case("empty", seed=90, batch=1)
    arrays = list(_arrays(case))
    arrays[0], arrays[1], arrays[2] = (x[:, :0] for x in arrays[:3])
    out = sink_window_attention_gpu(*arrays, max_retained=case.max_retained, interpret=True)
    assert out.shape == (1, 0, 4, 32)


def test_default_block_sizes_are_triton_legal():
    shapes = [(1, 64, 0, 1), (2, 128, 20, 2), (64, 256, 4096, 8), (1024, 80, 300, 1), (4, 256, 8192, 1)]
    for query_rows, head_dim, max_retained, kv_heads in shapes:
        for itemsize in (2, 4):
            blocks = BlockSizes.default(
                query_rows=query_rows, head_dim=head_dim, max_retained=max_retained, kv_heads=kv_heads,
                itemsize=itemsize,
            )  # fmt: skip
            assert 16 <= blocks.block_q <= 64
            assert 16 <= blocks.block_k <= 64


@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_block_sizes_split_a_decode_walk_only(itemsize):
    default = functools.partial(BlockSizes.default, head_dim=256, itemsize=itemsize)
    # Gemma 3 270M's decode (4 query heads on 1 KV head), a global layer of up to 1,024 retained keys:
    # 8 programs a row, 128 keys each.
    gemma = default(query_rows=4, max_retained=1024, kv_heads=1)
    assert gemma.split_keys == 128
    # float32 decode tiles: 8 warps, 32 keys a block (D 256); 16-bit ones keep theirs.
    assert (gemma.block_k, gemma.num_warps) == (32, 8)
    assert default(query_rows=4, max_retained=129, kv_heads=1).split_keys == 128  # the least a split walks
    assert default(query_rows=4, max_retained=128, kv_heads=1).split_keys is None  # one split's worth
    assert default(query_rows=4, max_retained=8192, kv_heads=1).split_keys == 1024  # 8 splits
    assert default(query_rows=4, max_retained=8192, kv_heads=2).split_keys == 2048  # 4 splits of 2 heads
    # A row of 8 KV heads is 8 programs already: unsplit (the H200's 128-row decode streamed 0.70 of
    # copy unsplit, 0.56 split).
    assert default(query_rows=4, max_retained=8192, kv_heads=8).split_keys is None
    prefill = default(query_rows=128 * 4, max_retained=1024, kv_heads=1)
    assert prefill.split_keys is None
    assert prefill.num_warps == (16 if itemsize == 4 else 8)


def test_a_wider_float32_decode_tile_keeps_16_warps_and_splits_at_half_the_key_block():
    # 32 query rows per KV head at D 64 (a 4-token step of 8 grouped heads): one query block of 32.
    default = functools.partial(BlockSizes.default, query_rows=32, head_dim=64, max_retained=1024, itemsize=4)
    split, unsplit = default(kv_heads=1), default(kv_heads=8)
    assert (split.block_q, split.block_k, split.num_warps, split.split_keys) == (32, 32, 16, 128)
    assert (unsplit.block_q, unsplit.block_k, unsplit.num_warps, unsplit.split_keys) == (32, 64, 16, None)


@pytest.mark.parametrize("split_keys", [0, -16, 24, 16.0, True, "32"])
def test_split_keys_must_be_a_multiple_of_the_key_block(split_keys):
    with pytest.raises(ValueError, match=rf"split_keys={split_keys!r} must be None or a positive multiple"):
        BlockSizes(block_q=16, block_k=16, split_keys=split_keys)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "query_window"), [(np.float32, 32, None), (jnp.bfloat16, 24, 4)]
)
def test_lowers_to_triton(dtype, head_dim, query_window):
    """The compiled path lowers to a Triton custom call (checked here even without a GPU)."""
    case = cases.make_case(
        "lower", seed=100, batch=2, head_dim=head_dim, dtype=dtype, query_window=query_window
    )
    fn = functools.partial(
        sink_window_attention_gpu, max_retained=case.max_retained, query_window=query_window
    )
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _arrays(case)]
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    assert "sink_window_attention_gpu" in text


def test_rejects_what_it_cannot_do():
    case = cases.standard_cases()[0]
    arrays = _arrays(case)
    settings = {"max_retained": case.max_retained, "interpret": True}
    with pytest.raises(NotImplementedError, match="float64"):
        sink_window_attention_gpu(*(x.astype(np.float64) for x in arrays[:7]), arrays[7], **settings)
    with pytest.raises(NotImplementedError, match="TPU interpret"):
        sink_window_attention_gpu(*arrays, max_retained=case.max_retained, interpret=object())
    if INTERPRET:  # compiled Triton lowers for CUDA only; here Pallas refuses it when lowering for CPU
        with pytest.raises(ValueError, match="interpret mode"):
            sink_window_attention_gpu(*arrays, max_retained=case.max_retained)
    with pytest.raises(ValueError, match="query_window"):
        sink_window_attention_gpu(*arrays, **settings, query_window=0)
    with pytest.raises(ValueError, match="max_retained"):
        sink_window_attention_gpu(*arrays, max_retained=-1, interpret=True)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sink_window_attention_gpu(arrays[0][:, :, :3], *arrays[1:], **settings)
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=12, block_k=16)


@pytest.mark.parametrize(
    ("index", "mutate", "match"),
    [
        (0, lambda x: x[:, :, :3], "multiple of KV heads"),
        (1, lambda x: x.astype(jnp.bfloat16), "k has dtype"),
        (4, lambda x: x[:, :, :, :2], "cache_v has shape"),
        (7, lambda x: x.astype(np.float32), "table has dtype"),
        (7, lambda x: x[:-1], "attention rows"),
    ],
    ids=["heads", "mixed_dtypes", "cache_v", "table_dtype", "table_rows"],
)
def test_input_errors_are_the_public_ops(index, mutate, match):
    # One source of truth (validate.validate_inputs): same exception type and message as the public op.
    case = cases.standard_cases()[0]
    arrays = list(_arrays(case))
    arrays[index] = mutate(arrays[index])
    with pytest.raises(ValueError, match=match) as public:
        sink_window_attention(*arrays, max_retained=case.max_retained)
    with pytest.raises(ValueError, match=match) as gpu:
        sink_window_attention_gpu(*arrays, max_retained=case.max_retained, interpret=True)
    assert str(gpu.value) == str(public.value)


@pytest.mark.slow
def test_auto_falls_back_to_xla_without_the_triton_backend(monkeypatch):
    # A JAX that dropped the Pallas Triton backend: importing it raises ImportError (None in sys.modules).
    case = cases.standard_cases()[0]
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    # The public ops keep each kernel behind a jit: an earlier test's cached trace would hide the import.
    jax.clear_caches()
    with pytest.raises(NotImplementedError, match="Triton"):
        sink_window_attention_gpu(*_arrays(case), max_retained=case.max_retained)
    # Lowered for CUDA, "auto" then carries the XLA path; run here, it computes the XLA path's result.
    auto = functools.partial(sink_window_attention, max_retained=case.max_retained, implementation="auto")
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _arrays(case)]
    assert "triton" not in jax.jit(auto).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    out = auto(*_arrays(case))
    expected = sink_window_attention_xla(*_arrays(case), max_retained=case.max_retained)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_ignores_the_triton_deprecation_warning_and_only_it():
    # jax >= 0.11 warns when it lowers the Triton pallas_call, after the call returns under a caller's jit;
    # pyproject turns warnings into errors. Emulate that warning after a traced call.
    case = cases.make_case("warn", seed=110, batch=1)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _arrays(case)]
    fn = functools.partial(sink_window_attention_gpu, max_retained=case.max_retained, interpret=True)
    jax.jit(fn).trace(*specs)
    warnings.warn(
        "The Pallas Triton backend is deprecated and will be removed in a future JAX version.",
        DeprecationWarning,
        stacklevel=1,
    )
    with pytest.raises(DeprecationWarning, match="something else"):
        warnings.warn("something else is deprecated", DeprecationWarning, stacklevel=1)
