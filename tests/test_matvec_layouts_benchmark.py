"""`benchmarks/matvec_layouts.py`: both layouts' chains against the float64 oracle, a quick run's table,
and its flags refused before any work."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import matvec_layouts as ml


@pytest.mark.parametrize("layout", ml.LAYOUTS)
def test_each_layouts_chain_matches_the_float64_oracle(layout):
    # Weights 100 times their initial scale: each product then moves x well past float32 rounding.
    held = [w * 100 for w in ml.weights((48, 80), layers=3, seed=2)]
    x = np.random.default_rng(3).standard_normal((1, 48)).astype(np.float32)
    stack = [jnp.asarray(w if layout == "[O, I]" else w.T) for w in held]
    got = np.asarray(ml.chain(layout, jnp.asarray(x), stack), np.float64)
    want = ml.oracle(x, held)
    # Compare what the products added to x (small beside x itself), so a wrong product cannot hide.
    moved = want - x
    assert np.abs(moved).max() > 1e-3
    np.testing.assert_allclose(got - x, moved, rtol=1e-3, atol=1e-6)


def test_quick_run_prints_every_projection_with_both_rates(capsys):
    ml.main(["--quick", "--repeats", "1", "--layers", "1"])
    out = capsys.readouterr().out
    assert "[--quick: 1 layers, 1 repeats; not a full run's figures]" in out
    rows = [line for line in out.splitlines() if re.match(r"\| [a-z]", line) and "projection" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(ml.PROJECTIONS)
    for row in rows:
        o_i, i_o, ratio = (float(re.match(r"\s*([\d.]+)", cell).group(1)) for cell in row.split(" | ")[2:5])
        assert ratio == pytest.approx(o_i / i_o, rel=0.06)  # rates and ratio rounded apart


@pytest.mark.parametrize(
    "argv", [["--repeats", "0"], ["--repeats", "nan"], ["--layers", "-2"], ["--layers", "1.5"]]
)
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ml.main(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err
