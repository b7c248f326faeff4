"""The optional score terms (`rel_bias`, `sink_logits`) in every implementation, against the float64 oracle.

First the oracle itself is pinned by closed forms that do not go through its code path: a bias that singles
out one column selects exactly the key at that compacted distance, and a lone key next to a sink weighs
`sigmoid(score - sink)`. Then the XLA path, the TPU kernel (HLO interpreter, and TPU interpret mode with its
race detector and bounds checks) and the GPU kernel (HLO interpreter) run the standard cases that carry
sinks, windows, sources, query windows and reverse order with both terms, alone and together, in blocks
small enough that every store takes several.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.sink_window_attention import reference, sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.gpu import BlockSizes as GpuBlocks
from kernels_pallas.sink_window_attention.gpu import sink_window_attention_gpu
from kernels_pallas.sink_window_attention.tpu import BlockSizes as TpuBlocks
from kernels_pallas.sink_window_attention.tpu import sink_window_attention_tpu
from tests.kernels import cases

pytestmark = pytest.mark.slow

TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
CASES = {case.name: case for case in cases.score_term_cases()}
BF16_CASES = {case.name: case for case in cases.score_term_cases(jnp.bfloat16)}
# One-term runs on the cases where the term meets the most: wraps, sinks in and past the source, a band.
ONE_TERM = ["many_wraps", "sink_over_source", "query_window_chunk", "reverse"]
BIG = 1e4  # a bias that outweighs every score (scores are O(10) here)


def _retained(row: np.ndarray) -> int:
    return int(tbl.retained_count(row))


def _column_spike(case: cases.KernelCase, key_of_query) -> np.ndarray:
    """rel_bias that is +BIG at one column per (row, query token) and 0 elsewhere.

    `key_of_query(retained, i)` names the compacted key (in `retained ++ step keys`) the column must point
    at, so the column is computed here from the documented formula `(retained + i) - j + T - 1`.
    """
    rows, steps, heads, _ = case.q.shape
    width = case.max_retained + 2 * steps - 1
    bias = np.zeros((rows, heads, steps, width), np.float32)
    for n in range(rows):
        retained = _retained(case.table[n // case.rows_per_request])
        for i in range(steps):
            j = key_of_query(retained, i)
            if j is not None:
                bias[n, :, i, retained + i - j + steps - 1] = BIG
    return bias


def test_oracle_bias_column_t_minus_1_is_the_query_s_own_key():
    # Distance 0 is column T - 1 whatever the row retains: each query then attends only its own key.
    case = CASES["mixed"]
    out = case.reference_output(rel_bias=_column_spike(case, lambda retained, i: retained + i))
    own = case.table[np.arange(case.q.shape[0]) // case.rows_per_request, tbl.STEP_TOKENS]
    groups = case.q.shape[2] // case.k.shape[2]
    want = np.repeat(case.v.astype(np.float64), groups, axis=2)  # [N, T, H, D]: head h reads KV head h // I
    live = np.arange(case.q.shape[1])[None, :] < own[:, None]
    np.testing.assert_allclose(out[live], want[live], rtol=1e-6, atol=1e-6)


def test_oracle_bias_counts_compacted_distances():
    # The column of distance i + 1 from query i is the newest retained key (j = retained - 1), for every
    # query of a row: in the compacted list the gap between sink and window does not count.
    case = CASES["many_wraps"]
    bias = _column_spike(case, lambda retained, i: retained - 1 if retained else None)
    out = case.reference_output(rel_bias=bias)
    groups = case.q.shape[2] // case.k.shape[2]
    for n in range(case.q.shape[0]):
        row = case.table[n // case.rows_per_request]
        values, positions = reference.retained_keys_reference(
            row, case.cache_v, case.source_v, n % case.rows_per_request
        )
        assert positions[-1] == row[tbl.STREAM_LEN] - 1  # the newest entry before the step
        newest = np.repeat(values[:, -1], groups, axis=0)  # [H, D]
        for i in range(int(row[tbl.STEP_TOKENS])):
            np.testing.assert_allclose(out[n, i], newest, rtol=1e-6, atol=1e-6)


def test_oracle_bias_distances_skip_the_gap_between_sink_and_window():
    # Key 0 (the first sink entry) sits `retained + i` places before query i in the compacted list, but
    # `n + i` positions before it in the stream; a spike at the compacted column selects it, so the gap
    # between sink and window does not count.
    case = CASES["many_wraps"]
    out = case.reference_output(rel_bias=_column_spike(case, lambda retained, i: 0 if retained else None))
    groups = case.q.shape[2] // case.k.shape[2]
    checked = 0
    for n in range(case.q.shape[0]):
        row = case.table[n // case.rows_per_request]
        if not 0 < row[tbl.SINK_KEPT] < row[tbl.WINDOW_START]:
            continue
        values, _ = reference.retained_keys_reference(
            row, case.cache_v, case.source_v, n % case.rows_per_request
        )
        for i in range(int(row[tbl.STEP_TOKENS])):
            np.testing.assert_allclose(
                out[n, i], np.repeat(values[:, 0], groups, axis=0), rtol=1e-6, atol=1e-6
            )
            checked += 1
    assert checked


def test_oracle_lone_key_beside_a_sink_weighs_sigmoid():
    # A fresh stream's first token sees only itself: out = v * e^s / (e^s + e^sink), s = q . k / sqrt(D).
    case = cases.make_case("lone", seed=7, batch=2, steps=1, source_len=0, written=0, max_source_len=4)
    sinks = np.array([-2.0, 0.0, 1.5, 8.0], np.float32)
    out = case.reference_output(sink_logits=sinks)
    groups = case.q.shape[2] // case.k.shape[2]
    for n in range(case.q.shape[0]):
        for h in range(case.q.shape[2]):
            k, v = case.k[n, 0, h // groups].astype(np.float64), case.v[n, 0, h // groups].astype(np.float64)
            s = case.q[n, 0, h].astype(np.float64) @ k / np.sqrt(case.q.shape[3])
            np.testing.assert_allclose(out[n, 0, h], v / (1 + np.exp(sinks[h] - s)), rtol=1e-9)


def test_oracle_without_terms_is_unchanged_by_neutral_ones():
    # A bias constant along the key axis shifts every score of a query alike; a sink at -inf weighs 0.
    case = CASES["query_window_chunk"]
    rows, steps, heads, _ = case.q.shape
    constant = np.broadcast_to(
        np.arange(rows * heads * steps, dtype=np.float32).reshape(rows, heads, steps, 1),
        (rows, heads, steps, case.max_retained + 2 * steps - 1),
    )
    plain = case.reference_output()
    np.testing.assert_allclose(case.reference_output(rel_bias=constant), plain, rtol=1e-9, atol=1e-12)
    sinks = np.full(heads, -np.inf, np.float32)
    np.testing.assert_allclose(case.reference_output(sink_logits=sinks), plain, rtol=1e-12, atol=0)


def _terms(name: str, which: str, case: cases.KernelCase) -> dict[str, np.ndarray]:
    return cases.score_terms(
        case, seed=sum(map(ord, name)), rel_bias=which != "sink_logits", sink_logits=which != "rel_bias"
    )


_PARAMS = [(name, "both") for name in CASES] + [
    (name, which) for name in ONE_TERM for which in ("rel_bias", "sink_logits")
]
_IDS = [f"{name}-{which}" for name, which in _PARAMS]


def _check(case: cases.KernelCase, run, which: str, name: str) -> None:
    terms = _terms(name, which, case)
    out = np.asarray(jax.block_until_ready(run(case, terms)), np.float64)
    assert out.shape == case.q.shape
    assert np.isfinite(out).all(), f"{name}: non-finite output (a masked or poisoned entry was used)"
    tol = TOLERANCE[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, case.reference_output(**terms), rtol=tol, atol=tol, err_msg=name)


def _runner(fn, **options):
    """Runs `fn` (the public op or a kernel) jitted on a case with the given terms and static options."""

    def run(case: cases.KernelCase, terms):
        def call(*arrays):
            given = dict(zip(terms, arrays[8:], strict=True))
            static = {"max_retained": case.max_retained, "query_window": case.query_window}
            return fn(*arrays[:8], **given, **static, **options)

        try:
            return jax.jit(call)(*case.arrays(), *terms.values())
        except Exception:
            if isinstance(options.get("interpret"), pltpu.InterpretParams):
                pltpu.reset_tpu_interpret_mode_state()  # else the next interpreted kernel inherits the mess
            raise

    return run


def _op(implementation: str):
    return _runner(sink_window_attention, implementation=implementation)


def _kernel(module: str, blocks, interpret):
    fn = {"tpu": sink_window_attention_tpu, "gpu": sink_window_attention_gpu}[module]
    return _runner(fn, block_sizes=blocks, interpret=interpret)


@pytest.mark.parametrize(("name", "which"), _PARAMS, ids=_IDS)
def test_xla(name, which):
    _check(CASES[name], _op("xla"), which, name)


@pytest.mark.parametrize("name", ["chunk", "many_wraps", "query_window_decode", "reverse"])
def test_xla_bfloat16(name):
    _check(BF16_CASES[name], _op("xla"), "both", name)


@pytest.mark.parametrize(("name", "which"), _PARAMS, ids=_IDS)
def test_tpu_kernel_interpreted(name, which):
    # Blocks of 8: several per store, a partial last query block for the chunk cases.
    _check(CASES[name], _kernel("tpu", TpuBlocks(block_kv=8, block_q=8), True), which, name)


@pytest.mark.parametrize("name", ["many_wraps", "sink_over_source", "mixed", "two_rows_per_request"])
def test_tpu_kernel_in_tpu_interpret_mode(name):
    # Simulated DMAs and VMEM: the bias blocks' index maps stay in bounds and race-free.
    interpret = pltpu.InterpretParams(detect_races=True)
    _check(CASES[name], _kernel("tpu", TpuBlocks(block_kv=8, block_q=8), interpret), "both", name)
    assert cases.races_found() is not True


def test_tpu_kernel_default_blocks_bfloat16():
    _check(BF16_CASES["mixed"], _kernel("tpu", None, True), "both", "mixed")


@pytest.mark.parametrize(("name", "which"), _PARAMS, ids=_IDS)
def test_gpu_kernel_interpreted(name, which):
    _check(CASES[name], _kernel("gpu", GpuBlocks(block_q=8, block_k=8), True), which, name)


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_kernel_split_walk_interpreted(name):
    # Decode-shaped steps split one 8-key block a program: the sink logits seed one split's state only,
    # each program gathers the bias of its own keys, and the merge weighs them back together.
    blocks = GpuBlocks(block_q=64, block_k=8, split_keys=8)
    _check(CASES[name], _kernel("gpu", blocks, True), "both", name)


def test_public_op_auto_passes_the_terms_through():
    _check(CASES["mixed"], _op("auto"), "both", "mixed")


def test_transposed_slots_take_the_bias_in_their_walk():
    # Slots of 300 tokens with 32-wide heads are read tokens-in-lanes, in blocks of 128 lanes: the bias
    # walk pads each step to whole lane tiles only where it must.
    case = CASES["many_wraps"]
    pad = lambda x: np.pad(x, [(0, 0)] * 3 + [(0, 300 - x.shape[3]), (0, 0)], constant_values=np.nan)  # noqa: E731
    case = dataclasses.replace(case, cache_k=pad(case.cache_k), cache_v=pad(case.cache_v))
    _check(case, _kernel("tpu", TpuBlocks(block_kv=8, block_q=8), True), "both", "transposed")


@pytest.mark.parametrize(
    ("field", "make", "match"),
    [
        (
            "rel_bias",
            lambda c: np.zeros((*c.q.shape[:1], c.q.shape[2], c.q.shape[1], 3), np.float32),
            "RB >=",
        ),
        ("rel_bias", lambda c: np.zeros((1, 1, 1, 99), np.float32), "rel_bias has shape"),
        ("rel_bias", lambda c: np.zeros((*c.q.shape[:1], c.q.shape[2], c.q.shape[1], 99), np.int32), "dtype"),
        ("sink_logits", lambda c: np.zeros(c.q.shape[2] + 1, np.float32), r"\[H\] = \[4\]"),
        ("sink_logits", lambda c: np.zeros(c.q.shape[2], np.int32), "floating"),
    ],
)
@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu", "pallas_gpu"])
def test_bad_terms_are_refused_by_name(field, make, match, implementation):
    case = CASES["decode"]
    with pytest.raises(ValueError, match=match) as error:
        sink_window_attention(
            *case.arrays(), max_retained=case.max_retained, implementation=implementation, interpret=True,
            **{field: make(case)},
        )  # fmt: skip
    assert field in str(error.value)


@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_host_arrays_outside_jit(implementation):
    # NumPy terms, called eagerly: the op converts them itself.
    case = CASES["mixed"]
    terms = _terms("mixed", "both", case)
    out = sink_window_attention(
        *case.arrays(), max_retained=case.max_retained, implementation=implementation, **terms
    )
    tol = TOLERANCE[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(
        np.asarray(out, np.float64), case.reference_output(**terms), rtol=tol, atol=tol
    )
