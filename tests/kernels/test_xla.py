"""The pure-XLA path and the public op's dispatch and input checks, against the float64 oracle.

Every standard case poisons what must not be read with NaN (see `cases.py`); outputs must be finite and
match `case.reference_output()` within a per-dtype tolerance.
"""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import attention, sink_window_attention, sink_window_attention_xla
from kernels_pallas.sink_window_attention import table as tbl
from tests.kernels import cases

TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
STATIC = ("max_retained", "query_window", "scale")
# XLA:CPU compile time dominates these tests; LLVM optimisation does not change what is computed.
_COMPILER_OPTIONS = cases.fast_compile_options()
_xla = jax.jit(sink_window_attention_xla, static_argnames=STATIC, compiler_options=_COMPILER_OPTIONS)
_op = jax.jit(
    sink_window_attention, static_argnames=(*STATIC, "implementation"), compiler_options=_COMPILER_OPTIONS
)
CASES = {np.dtype(d): {c.name: c for c in cases.standard_cases(d)} for d in (np.float32, jnp.bfloat16)}


def _arrays(case: cases.KernelCase) -> tuple[np.ndarray, ...]:
    return case.q, case.k, case.v, case.cache_k, case.cache_v, case.source_k, case.source_v, case.table


def _run(case: cases.KernelCase, fn=_xla, **kwargs) -> np.ndarray:
    kwargs = {"max_retained": case.max_retained, "query_window": case.query_window} | kwargs
    out = fn(*_arrays(case), **kwargs)
    assert out.shape == case.q.shape
    assert out.dtype == case.q.dtype
    return np.asarray(out)


def _check(case: cases.KernelCase, out: np.ndarray, scale: float | None = None) -> None:
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), f"{case.name}: non-finite output (a masked or poisoned entry was used)"
    tol = TOLERANCE[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, case.reference_output(scale), rtol=tol, atol=tol, err_msg=case.name)


@pytest.mark.parametrize(
    "case", [c for by_name in CASES.values() for c in by_name.values()], ids=lambda c: f"{c.name}-{c.q.dtype}"
)
def test_matches_reference(case):
    _check(case, _run(case))


def test_explicit_scale():
    case = CASES[np.dtype(np.float32)]["query_window_chunk"]
    _check(case, _run(case, scale=0.3), scale=0.3)


def test_a_larger_max_retained_changes_nothing():
    # K only sizes the buffers; the table decides what is read.
    case = CASES[np.dtype(np.float32)]["mixed"]
    _check(case, _run(case, max_retained=case.max_retained + 7))


@pytest.mark.parametrize("name", ["chunk", "query_window_decode"])
def test_run_twice_gives_identical_bits(name):
    case = CASES[np.dtype(jnp.bfloat16)][name]
    first, second = _run(case), _run(case)
    assert first.tobytes() == second.tobytes()


def test_working_memory_does_not_grow_with_the_cache():
    # O(bytes touched), never O(cache size): ten times the slots and sources, the same temporaries
    # (a copy or a full-cache select would show up here).
    def temp_bytes(slots: int, sources: int) -> int:
        case = cases.make_case("sizes", seed=0, batch=3, slots=slots, sources=sources, steps=1)
        compiled = _xla.trace(*_arrays(case), max_retained=case.max_retained).lower().compile()
        stats = compiled.memory_analysis()
        if stats is None:
            pytest.skip(f"no memory analysis on {jax.default_backend()}")
        return stats.temp_size_in_bytes

    assert temp_bytes(3, 1) == temp_bytes(30, 10)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ["padding_rows", "bucket_padded_tokens"])
def test_poisoned_entries_and_padding_queries_never_leak(name, poison):
    # The case's NaN (every entry no row reads) becomes `poison`, and so do the queries past STEP_TOKENS:
    # those queries must answer exact zeros, the others the oracle's values.
    case = CASES[np.dtype(np.float32)][name]
    tokens = np.repeat(case.table[:, tbl.STEP_TOKENS], case.rows_per_request)
    padding = np.arange(case.q.shape[1])[None, :] >= tokens[:, None]  # [N, T]
    poisoned = {
        f.name: np.where(np.isnan(x), np.float32(poison), x)
        for f in dataclasses.fields(case)
        if isinstance(x := getattr(case, f.name), np.ndarray) and x.dtype == np.float32
    }
    poisoned["q"] = np.where(padding[:, :, None, None], np.float32(poison), case.q)
    out = _run(dataclasses.replace(case, **poisoned))
    assert padding.any()
    np.testing.assert_array_equal(out[padding], 0.0)
    _check(case, np.where(padding[:, :, None, None], case.reference_output(), out))


@pytest.mark.parametrize("implementation", ["xla", "auto"])
@pytest.mark.parametrize("name", ["decode", "two_rows_per_request", "query_window_chunk"])
def test_public_op_on_cpu_is_the_xla_path(name, implementation):
    if jax.default_backend() != "cpu" and implementation == "auto":
        pytest.skip("'auto' picks a Pallas kernel on accelerators")
    case = CASES[np.dtype(np.float32)][name]
    assert _run(case, _op, implementation=implementation).tobytes() == _run(case).tobytes()


def _not_implemented(*args, **kwargs):
    raise NotImplementedError("this case is not supported")


def _lowered_text(case: cases.KernelCase, op, platform: str) -> str:
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _arrays(case)]
    fn = functools.partial(op, max_retained=case.max_retained, query_window=case.query_window)
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
    ("platform", "kernel_marker"),
    [("cpu", None), ("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")],
)
def test_auto_follows_the_lowering_platform(platform, kernel_marker):
    # Traced on this CPU host, lowered for each platform: the TPU and CUDA programs carry their kernel.
    case = CASES[np.dtype(np.float32)]["decode"]
    text = _lowered_text(case, functools.partial(sink_window_attention, implementation="auto"), platform)
    markers = ("tpu_custom_call", "__gpu$xla.gpu.triton")
    assert [m for m in markers if m in text] == ([kernel_marker] if kernel_marker else [])


def test_auto_falls_back_to_xla_when_the_kernel_declines(monkeypatch):
    case = CASES[np.dtype(np.float32)]["decode"]
    monkeypatch.setattr(attention, "_pallas_implementation", lambda name: _not_implemented)
    auto = functools.partial(sink_window_attention, implementation="auto")
    assert "tpu_custom_call" not in _lowered_text(case, auto, "tpu")
    out = _run(case, jax.jit(auto, static_argnames=STATIC, compiler_options=_COMPILER_OPTIONS))
    assert out.tobytes() == _run(case).tobytes()


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_explicit_pallas_dispatch_passes_settings_and_interpret(monkeypatch, implementation):
    calls = []

    def record(name):
        return lambda *arrays, **kwargs: calls.append((name, len(arrays), kwargs)) or arrays[0]

    monkeypatch.setattr(attention, "_pallas_implementation", record)
    case = CASES[np.dtype(np.float32)]["query_window_decode"]
    marker = object()  # stands for a `pltpu.InterpretParams(...)`: passed through untouched
    _run(case, functools.partial(sink_window_attention, implementation=implementation, interpret=marker))
    settings = {"max_retained": case.max_retained, "query_window": case.query_window, "scale": None}
    assert calls == [(implementation, 8, settings | {"interpret": marker})]
    # An explicit request that the kernel declines is not silently rerouted.
    monkeypatch.setattr(attention, "_pallas_implementation", lambda name: _not_implemented)
    with pytest.raises(NotImplementedError):
        _run(case, functools.partial(sink_window_attention, implementation=implementation, interpret=True))


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_public_op_runs_the_pallas_kernels_interpreted(implementation):
    case = CASES[np.dtype(np.float32)]["query_window_decode"]
    op = functools.partial(sink_window_attention, implementation=implementation, interpret=True)
    _check(case, _run(case, jax.jit(op, static_argnames=STATIC)))


def test_package_import_leaves_the_pallas_kernels_unloaded():
    code = (
        "import sys, kernels_pallas.sink_window_attention as s; "
        "assert not {'tpu', 'gpu'} & {m.rsplit('.', 1)[-1] for m in sys.modules if m.startswith(s.__name__)}"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu"})


def _replace(index: int, make):
    """Mutates argument `index` of the eight arrays."""
    return lambda arrays: (*arrays[:index], make(arrays[index]), *arrays[index + 1 :])


Q, K, V, CACHE_K, CACHE_V, SOURCE_K, SOURCE_V, TABLE = range(8)
BAD_ARRAYS = {
    "q_rank": (_replace(Q, lambda x: x[:, 0]), "q has shape"),
    "heads_not_multiple_of_kv_heads": (_replace(Q, lambda x: x[:, :, :3]), "multiple of KV heads"),
    "k_head_dim": (_replace(K, lambda x: x[..., :8]), "k has shape"),
    "v_not_k": (_replace(V, lambda x: x[:, :, :1]), "v has shape"),
    "cache_kv_heads": (_replace(CACHE_K, lambda x: x[:, :, :1]), "cache_k has shape"),
    "cache_v_not_cache_k": (_replace(CACHE_V, lambda x: x[:, :, :, :2]), "cache_v has shape"),
    "source_rows": (_replace(SOURCE_K, lambda x: np.concatenate([x, x], axis=1)), "source_k has shape"),
    "source_v_not_source_k": (_replace(SOURCE_V, lambda x: x[:1]), "source_v has shape"),
    "table_columns": (_replace(TABLE, lambda x: x[:, :-1]), "table has shape"),
    "table_rows": (_replace(TABLE, lambda x: x[:-1]), "table has 3 rows"),
    "table_dtype": (_replace(TABLE, lambda x: x.astype(np.float32)), "table has dtype"),
    "q_dtype_not_floating": (_replace(Q, lambda x: x.astype(np.int32)), "q has dtype"),
    "mixed_dtypes": (_replace(CACHE_V, lambda x: x.astype(jnp.bfloat16)), "cache_v has dtype"),
}
BAD_SETTINGS = {
    "max_retained_negative": ({"max_retained": -1}, ValueError, "max_retained"),
    "max_retained_float": ({"max_retained": 22.0}, TypeError, "max_retained"),
    "query_window_zero": ({"query_window": 0}, ValueError, "query_window"),
    "query_window_bool": ({"query_window": True}, TypeError, "query_window"),
    "scale_nan": ({"scale": float("nan")}, ValueError, "scale"),
    "scale_array": ({"scale": jnp.float32(0.5)}, TypeError, "scale"),
    "implementation": ({"implementation": "cuda"}, ValueError, "implementation"),
}


@pytest.mark.parametrize(("mutate", "match"), BAD_ARRAYS.values(), ids=BAD_ARRAYS.keys())
def test_bad_arrays_raise_naming_the_argument(mutate, match):
    case = CASES[np.dtype(np.float32)]["decode"]
    with pytest.raises(ValueError, match=match):
        sink_window_attention(*mutate(_arrays(case)), max_retained=case.max_retained)


@pytest.mark.parametrize(("settings", "error", "match"), BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_bad_settings_raise_naming_the_setting(settings, error, match):
    case = CASES[np.dtype(np.float32)]["decode"]
    with pytest.raises(error, match=match):
        sink_window_attention(*_arrays(case), **({"max_retained": case.max_retained} | settings))


def test_a_host_table_retaining_more_than_max_retained_is_refused_by_row():
    """The implementations read at most `max_retained` keys a row: a plan retaining more would lose keys
    silently, so a host (NumPy) table is checked against it."""
    from kernels_pallas.sink_window_attention.table import retained_count

    case = CASES[np.dtype(np.float32)]["decode"]
    arrays = _arrays(case)
    retained = retained_count(np.asarray(arrays[TABLE]))
    most, row = int(retained.max()), int(np.argmax(retained))
    assert most > 0
    with pytest.raises(ValueError, match=rf"table row {row} retains {most} keys but max_retained={most - 1}"):
        sink_window_attention(*arrays, max_retained=most - 1)
    np.testing.assert_allclose(  # the bound itself is allowed, and computes what the case's bound does
        np.asarray(sink_window_attention(*arrays, max_retained=most)), _run(case), rtol=1e-6, atol=1e-7
    )
