"""`mstar_jax.native.screened_argmax` against a brute-force oracle: every word's float32 logit as one
fused multiply-add chain in e order (emulated in float64: each product is exact there, each sum rounded
once to float32), then `np.argmax` (the first maximum, or the first NaN).

The cases are built to reach each path: a screen that leaves a few words, exact ties, more words the
screen cannot rule out than it finishes one by one (every word then computed exactly), and values that
are not finite. `screen_of`'s slack is checked against each level's error recomputed in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler to build mstar_jax.native")


def chained(hidden: np.ndarray, table: np.ndarray) -> np.ndarray:
    """f32[M, V]: sum over e in order of hidden[m, e] * table[e, v], each step one rounding (an fma)."""
    total = np.zeros((hidden.shape[0], table.shape[1]), np.float32)
    with np.errstate(all="ignore"):
        for e in range(table.shape[0]):
            product = hidden[:, e, None].astype(np.float64) * table[e].astype(np.float64)
            total = (product + total.astype(np.float64)).astype(np.float32)
    return total


def oracle(hidden: np.ndarray, table: np.ndarray) -> np.ndarray:
    return np.argmax(chained(hidden, table), axis=-1).astype(np.int32)


def screened(hidden, table, **kwargs) -> np.ndarray:
    table = jnp.asarray(table)
    screen = native.screen_of(table)
    return np.asarray(native.screened_argmax(jnp.asarray(hidden), screen, table, **kwargs))


@pytest.mark.parametrize(
    ("rows", "width", "words"), [(1, 64, 4096), (3, 40, 1001), (2, 17, 5), (4, 640, 9000), (1, 1, 3)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_rows_argmax_is_the_float32_chains(rows, width, words, seed):
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((width, words)) * rng.uniform(0.01, 1.0, words)).astype(np.float32)
    hidden = rng.standard_normal((rows, width)).astype(np.float32) * 3
    np.testing.assert_array_equal(screened(hidden, table), oracle(hidden, table))


@pytest.mark.parametrize("spread", [1e-2, 1e-3, 1e-5])
@pytest.mark.parametrize(("width", "words"), [(96, 2000), (20_000, 200)])
def test_words_closer_than_a_level_can_tell_apart_are_told_apart_exactly(spread, width, words):
    # 60 words near one direction, apart by less than level 1's step (and at 1e-5 than level 2's), among
    # random ones: the screen must keep every close one and let the float32 chain decide. At a width of
    # 20,000 the hidden state's own int16 codes are coarse (a step of 1/845 of its largest entry).
    rng = np.random.default_rng(23)
    base = rng.standard_normal(width).astype(np.float32)
    table = rng.standard_normal((width, words)).astype(np.float32) * 0.3
    close = rng.choice(words, 60, replace=False)
    table[:, close] = base[:, None] * (1 + spread * rng.standard_normal((width, 60)).astype(np.float32))
    hidden = np.stack([base, base + 0.1 * rng.standard_normal(width).astype(np.float32)])
    got = screened(hidden, table)
    assert got.tolist() == oracle(hidden, table).tolist()
    assert set(got) <= set(close)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_answer_does_not_depend_on_the_threads(threads):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((32, 20_000)).astype(np.float32)
    hidden = rng.standard_normal((3, 32)).astype(np.float32)
    np.testing.assert_array_equal(screened(hidden, table, threads=threads), oracle(hidden, table))


def test_exact_ties_go_to_the_lowest_word():
    rng = np.random.default_rng(7)
    table = rng.standard_normal((48, 300)).astype(np.float32) * 0.1
    best = rng.standard_normal(48).astype(np.float32)
    for word in (17, 80, 299):  # three copies of the winning word
        table[:, word] = best
    hidden = best[None] * 4
    assert screened(hidden, table).tolist() == [17] == oracle(hidden, table).tolist()


def test_more_near_winners_than_the_screen_finishes_are_all_computed_exactly():
    # 200 words within float32 rounding of each other: the screen cannot rule any out (past its 64),
    # so every word is computed exactly, and the chain's own rounding decides.
    rng = np.random.default_rng(11)
    base = rng.standard_normal(64).astype(np.float32)
    table = np.repeat(base[:, None], 1000, axis=1)
    table += rng.standard_normal(table.shape).astype(np.float32) * 1e-6
    table[:, 200:] = rng.standard_normal((64, 800)).astype(np.float32) * 0.01
    hidden = base[None].copy()
    got = screened(hidden, table)
    assert got.tolist() == oracle(hidden, table).tolist()
    assert got[0] < 200


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_row_that_is_not_finite_takes_argmaxs_answer(bad):
    rng = np.random.default_rng(13)
    table = rng.standard_normal((16, 500)).astype(np.float32)
    hidden = rng.standard_normal((2, 16)).astype(np.float32)
    hidden[1, 3] = bad  # row 0 stays finite
    table[5, 100] = 0.0  # inf * 0 = NaN in that word's chain
    want = oracle(hidden, table)
    assert screened(hidden, table).tolist() == want.tolist()
    assert want[0] == oracle(hidden[:1], table)[0]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_word_with_a_weight_that_is_not_finite_is_computed_exactly(bad):
    rng = np.random.default_rng(19)
    table = rng.standard_normal((8, 40)).astype(np.float32)
    table[3, 6] = bad
    table[:, 9] = 0.0  # a word of zeros: its step is no step
    hidden = rng.standard_normal((2, 8)).astype(np.float32)
    want = oracle(hidden, table)
    assert screened(hidden, table).tolist() == want.tolist()


def test_huge_weights_and_hidden_states_stay_exact():
    top = np.finfo(np.float32).max
    table = np.full((4, 10), 1.0, np.float32)
    table[:, 6], table[:, 2] = top / 8, -top / 8
    hidden = np.array([[0.25, 0.25, 0.25, 0.25], [-1e30, 1e-30, 3.0, 0.0]], np.float32)
    assert screened(hidden, table).tolist() == oracle(hidden, table).tolist()


@pytest.mark.parametrize(
    ("hidden", "table"),
    [
        ([[1e20]], [[4e18, 5e18]]),  # both chains overflow to inf: the first wins
        ([[2e19, 2e19]], [[2e19, 1e14], [-2e19, 0.0]]),  # word 0's chain overflows on the way
    ],
)
def test_a_chain_that_overflows_float32_is_computed_exactly(hidden, table):
    hidden, table = np.asarray(hidden, np.float32), np.asarray(table, np.float32)
    assert screened(hidden, table).tolist() == oracle(hidden, table).tolist() == [0]


@pytest.mark.parametrize("copies", [1, 2])
def test_subnormal_partial_sums_are_kept_not_flushed(copies):
    # Word 1's chain passes 1.5 * 2^-126 and ends at 2^-127, a subnormal above word 0's 0; XLA:CPU runs
    # custom calls with flush-to-zero, under which it would end at 0 and word 0 would win. A copy of
    # word 1 sends the row down another path (more words within the bound), with the same answer.
    table = np.zeros((2, 1 + copies), np.float32)
    table[:, 1:] = np.array([1.5 * 2.0**-26, -(2.0**-26)], np.float32)[:, None]
    hidden = np.full((1, 2), 2.0**-100, np.float32)
    assert oracle(hidden, table).tolist() == [1]
    assert screened(hidden, table).tolist() == [1]


def test_words_too_small_for_a_step_are_screened_without_warnings():
    table = np.random.default_rng(29).standard_normal((16, 50)).astype(np.float32)
    table[:, 7] = np.float32(1e-44)  # magnitude / 127 rounds to 0 in float32
    screen = native.screen_of(jnp.asarray(table))
    assert np.isfinite(np.asarray(screen.slack)).all()
    hidden = np.random.default_rng(30).standard_normal((2, 16)).astype(np.float32)
    assert screened(hidden, table).tolist() == oracle(hidden, table).tolist()


@pytest.mark.parametrize("shape", [(8, 0), (0, 8), (native.MAX_WIDTH + 1, 1), (8,)])
def test_a_table_the_screen_cannot_serve_is_refused_by_name(shape):
    table = jnp.zeros(shape, jnp.float32)
    with pytest.raises(
        ValueError, match=r"table of shape .* must be float32 \[E, V\] with E in \[1, 1048576\]"
    ):
        native.screen_of(table)


def test_it_runs_under_jit_with_leading_axes():
    rng = np.random.default_rng(17)
    table = jnp.asarray(rng.standard_normal((24, 700)).astype(np.float32))
    hidden = rng.standard_normal((2, 3, 24)).astype(np.float32)
    got = jax.jit(native.screened_argmax)(jnp.asarray(hidden), native.screen_of(table), table)
    assert got.shape == (2, 3)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got.reshape(-1), oracle(hidden.reshape(6, 24), np.asarray(table)))


@pytest.mark.parametrize("seed", [0, 1])
def test_each_levels_slack_bounds_its_error_against_a_float64_reconstruction(seed):
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((37, 300)) * rng.uniform(1e-3, 10, 300)).astype(np.float32)
    table[:, 4] = 0.0
    screen = native.screen_of(jnp.asarray(table), chunk=64)  # several chunks
    w = table.T.astype(np.float64)
    scales = np.asarray(screen.scales, np.float64)[:, None]
    q, r = np.asarray(screen.q, np.float64), np.asarray(screen.r, np.float64)
    assert np.abs(q).max() <= 127
    assert np.abs(r).max() <= 127
    np.testing.assert_allclose(
        scales[:, 0], np.where(np.abs(w).max(1) > 0, np.abs(w).max(1) / 127, 1.0), rtol=1e-6
    )
    slack = np.asarray(screen.slack, np.float64)
    for level, approximation in enumerate((scales * q, scales * (q + r / native.RESIDUAL_STEPS))):
        error = np.abs(w - approximation).max(axis=1)
        assert (error <= slack[level]).all()
        assert (slack[level] <= error + 1e-3 * np.abs(w).max(axis=1) + 1e-30).all()  # and not much more
    assert (slack[1] < slack[0] / 100 + 1e-30).all()  # the second byte narrows it


def arrays(width=8, words=30):
    table = jnp.ones((width, words), jnp.float32)
    return jnp.ones((2, width), jnp.float32), native.screen_of(table), table


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (lambda h, s, t: (h[:, :5], s, t)),
            r"table of shape \(8, 30\) must be \[5, V\]: hidden rows hold 5",
        ),
        ((lambda h, s, t: (h.astype(jnp.int32), s, t)), "hidden of shape .* must be floats"),
        ((lambda h, s, t: (h, s, t.astype(jnp.bfloat16))), "table .* dtype bfloat16 must be float32"),
        (
            (lambda h, s, t: (h, s._replace(q=s.q[:10]), t)),
            r"screen\.q of shape \(10, 8\).* must be int8 \[30, 8\]",
        ),
        (
            (lambda h, s, t: (h, s._replace(r=s.r.astype(jnp.int32)), t)),
            r"screen\.r .* dtype int32 must be int8",
        ),
        ((lambda h, s, t: (h, s._replace(scales=s.scales[:3]), t)), r"screen\.scales of shape \(3,\)"),
        (
            (lambda h, s, t: (h, s._replace(slack=s.slack[0]), t)),
            r"screen\.slack .* must be float32 \[2, 30\]",
        ),
    ],
)
def test_arrays_of_the_wrong_shape_or_dtype_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        native.screened_argmax(*args(*arrays()))


@pytest.mark.parametrize(("threads", "error"), [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_a_bad_thread_count_is_refused(threads, error):
    with pytest.raises(error, match="threads="):
        native.screened_argmax(*arrays(), threads=threads)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The build forgotten (and restored after): the next call builds again under this test's settings."""
    native._library.cache_clear()
    monkeypatch.setenv("MSTAR_JAX_NATIVE_DIR", str(tmp_path / "native"))
    yield tmp_path
    native._library.cache_clear()


def test_no_compiler_is_a_typed_error_naming_it(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    with pytest.raises(native.NativeUnavailableError, match=r"no C\+\+ compiler .*no-such-compiler"):
        native.build()
    assert not native.available()


def test_a_compiler_that_fails_is_a_typed_error_with_its_output(fresh_build, monkeypatch):
    failing = fresh_build / "cc"
    failing.write_text("#!/bin/sh\necho 'out of cheese' >&2\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    with pytest.raises(native.NativeUnavailableError, match=r"(?s)failed.*out of cheese"):
        native.build()


def test_a_file_where_the_build_folder_belongs_is_a_typed_error(fresh_build, monkeypatch):
    (fresh_build / "afile").write_text("")
    monkeypatch.setenv("MSTAR_JAX_NATIVE_DIR", str(fresh_build / "afile"))
    refused = r"MSTAR_JAX_NATIVE_DIR=.*afile.* must be a writable folder"
    with pytest.raises(native.NativeUnavailableError, match=refused):
        native.build()


def test_a_failed_build_is_tried_once_a_process(fresh_build, monkeypatch):
    calls = fresh_build / "calls"
    failing = fresh_build / "cc"
    failing.write_text(f"#!/bin/sh\necho x >> {calls}\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    assert not native.available()
    assert not native.available()
    with pytest.raises(native.NativeUnavailableError):
        native.build()
    assert calls.read_text() == "x\n"


def test_a_build_is_reused_not_repeated(fresh_build):
    first = native.build()
    native._library.cache_clear()
    assert native.build() == first
    assert sorted(p.name for p in (fresh_build / "native").iterdir()) == [first.rsplit("/", 1)[1]]
