"""benchmarks/greedy_screen.py --quick: on the real weights the screened token is the float64 argmax and
XLA's at every position, each level's survivors are printed, and the table has a row per batch with
both ways' times and their ratio (an output check: no timing is asserted)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from benchmarks import greedy_screen as bench
from mstar_jax import native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gemma,
    pytest.mark.skipif(not native.available(), reason="no C++ compiler to build mstar_jax.native"),
]

NUMBER = r"\d[\d,]*(\.\d+)?"
SPREAD = rf"{NUMBER} \({NUMBER}–{NUMBER}\)"  # median (min–max)


@pytest.fixture(scope="module")
def output():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(["--quick"])
    return printed.getvalue()


def test_the_screened_token_is_the_float64_argmax_and_xlas_at_every_position(output):
    assert "--quick" in output.splitlines()[0]
    assert "the screened token is the float64 argmax at 16 of 16 and XLA's at 16" in output


def test_each_levels_survivors_are_few_and_printed(output):
    found = re.search(rf"after level 1: ({SPREAD}); after level 2: ({SPREAD})", output)
    assert found, output
    first, second = (float(found.group(i).split(" ")[0]) for i in (1, 5))
    assert 1 <= second <= first < 262_144 / 100  # the levels narrow it to a few words


def test_the_table_has_a_row_per_batch_with_both_ways_and_their_ratio(output):
    rows = [line for line in output.splitlines() if re.match(r"\| \d+ \| ", line)]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 8"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 4, row
        for cell in cells[1:]:
            assert re.fullmatch(SPREAD, cell), (row, cell)


@pytest.mark.parametrize(
    ("argv", "message"), [(["--positions", "0"], "--positions"), (["--repeats", "x"], "--repeats")]
)
def test_bad_counts_are_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def test_fewer_positions_than_the_largest_batch_are_refused():
    with pytest.raises(SystemExit, match="--positions 4 must be at least 8"):
        bench.main(["--positions", "4"])
