"""The compilation counter: a new shape compiles once, the same shape never again, an ahead-of-time
program never; the guards raise and warn naming what compiled."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.compile import (
    RecompileError,
    RecompileWarning,
    assert_no_compilations,
    count_compilations,
    warn_on_compilations,
)


def _fresh():
    """A new function object each call, so no test shares a jit cache entry with another."""

    def scaled_sum(x):
        return jnp.sum(x * 3.0, axis=-1)

    return scaled_sum


def test_a_new_shape_compiles_once_and_the_same_shape_never_again():
    jitted = jax.jit(_fresh())
    x = np.ones((2, 5), np.float32)  # numpy: building a device array eagerly would compile too
    with count_compilations() as first:
        jitted(x)
    assert first.count == 1
    assert first.names == ["jit(scaled_sum)"]
    assert first.seconds > 0
    with count_compilations() as again:
        jitted(np.zeros((2, 5), np.float32))
        jitted(x)
    assert again.count == 0
    with count_compilations() as new_shape:
        jitted(np.ones((3, 5), np.float32))
    assert new_shape.count == 1


def test_ahead_of_time_programs_compile_at_compile_and_never_when_called():
    lowered = jax.jit(_fresh()).lower(jax.ShapeDtypeStruct((4, 3), jnp.float32))
    with count_compilations() as at_compile:
        compiled = lowered.compile()
    assert at_compile.count == 1
    with count_compilations() as at_call:
        for i in range(5):
            out = compiled(np.full((4, 3), i, np.float32))
    assert at_call.count == 0
    np.testing.assert_allclose(np.asarray(out), np.full(4, 36.0))  # 3 entries of 4 times 3


def test_counters_nest_and_a_closed_counter_stops_counting():
    jitted = jax.jit(_fresh())
    with count_compilations() as outer:
        with count_compilations() as inner:
            jitted(np.ones(2, np.float32))
        jitted(np.ones(3, np.float32))
    assert (outer.count, inner.count) == (2, 1)
    jitted(np.ones(4, np.float32))
    assert outer.count == 2


def test_current_thread_only_ignores_other_threads():
    jitted = jax.jit(_fresh())
    with count_compilations(current_thread_only=True) as mine, count_compilations() as everyone:
        worker = threading.Thread(target=jitted, args=(np.ones(6, np.float32),))
        worker.start()
        worker.join()
    assert (mine.count, everyone.count) == (0, 1)


def test_assert_no_compilations_raises_naming_the_function():
    jitted = jax.jit(_fresh())
    x = np.ones(7, np.float32)
    jitted(x)
    with assert_no_compilations("the warm path") as counter:
        jitted(x)
    assert counter.count == 0
    expected = r"the warm path compiled 1 compilation\(s\).*jit\(scaled_sum\)"
    with pytest.raises(RecompileError, match=expected), assert_no_compilations("the warm path"):
        jitted(np.ones(8, np.float32))


def test_the_blocks_own_error_wins_over_the_guard():
    jitted = jax.jit(_fresh())

    def compile_then_fail():
        jitted(np.ones(9, np.float32))
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"), assert_no_compilations():
        compile_then_fail()


def test_warn_on_compilations_warns_and_goes_on():
    jitted = jax.jit(_fresh())
    expected = r"serving compiled 1 compilation\(s\)"
    with pytest.warns(RecompileWarning, match=expected), warn_on_compilations() as counter:
        out = jitted(np.ones(10, np.float32))
    assert counter.count == 1
    assert float(out) == 30.0
    with warn_on_compilations():  # the warnings-as-errors setting fails this if it warns
        jitted(np.ones(10, np.float32))
