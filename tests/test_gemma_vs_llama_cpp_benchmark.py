"""benchmarks/gemma_vs_llama_cpp.py --quick: its table has a row per length and phase with both engines'
rates and their ratio, and the two engines generate the same greedy tokens (an output check: no timing
is asserted)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from benchmarks import gemma_vs_llama_cpp as bench

pytestmark = [pytest.mark.slow, pytest.mark.gemma, pytest.mark.llama]

NUMBER = r"\d[\d,]*\.\d+"
SPREAD = rf"{NUMBER} \({NUMBER}–{NUMBER}\)"  # median (min–max)


@pytest.fixture(scope="module")
def output():
    """What one `--quick` run prints (run once for the module: it loads both engines)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(["--quick"])
    return printed.getvalue()


def test_the_table_has_every_length_and_phase(output):
    assert "--quick" in output.splitlines()[0]  # labelled as a quick run
    assert re.search(r"llama\.cpp n_threads=\d+", output)
    rows = [line for line in output.splitlines() if re.match(r"\| [\d,]+ \| (prefill|decode) \|", line)]
    assert [tuple(row.split(" | ")[:3]) for row in rows] == [
        (f"| {n}", phase, k) for n in (32, 64) for phase in ("prefill", "decode") for k in ("1", "8")
    ]  # one engine a K
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 6, row
        for cell in cells[3:]:  # ours, llama.cpp, ours ÷ llama.cpp
            assert re.fullmatch(SPREAD, cell), (row, cell)


def test_the_products_alone_have_a_row_per_length_against_llama_cpp_decode(output):
    assert "our products alone: the chain equals its float64 oracle" in output
    header = "| tokens | our products alone, steps/s | llama.cpp decode tokens/s | products ÷ llama.cpp |"
    lines = output.splitlines()
    rows = lines[lines.index(header) + 2 :][:2]
    assert [row.split(" | ")[0] for row in rows] == ["| 32", "| 64"]
    decode = {
        row.split(" | ")[0]: row.split(" | ")[4]
        for row in lines
        if re.match(r"\| [\d,]+ \| decode \| 1 \|", row)
    }
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 4, row
        for cell in cells[1:]:
            assert re.fullmatch(SPREAD, cell), (row, cell)
        # the llama.cpp column is the same samples as the main table's llama.cpp decode rate
        assert cells[2] == decode["| " + cells[0]], (row, decode)
        # --quick times one repeat: the ratio is products ÷ llama.cpp of those two rates (not inverted)
        products, theirs, ratio = (float(cell.split(" ")[0]) for cell in cells[1:])
        rounding = 0.005 + products / theirs * 0.1 / min(products, theirs)  # rates printed to 0.1
        assert ratio == pytest.approx(products / theirs, abs=rounding), row


def test_both_engines_generate_the_same_greedy_tokens(output):
    lines = [line for line in output.splitlines() if re.match(r"\s+[\d,]+, K = [18]: ours \[", line)]
    assert len(lines) == 4, output  # each length, at K = 1 and 8
    for line in lines:
        ours, theirs = re.findall(r"\[([\d, ]+)\]", line)
        assert len(ours.split(",")) == 4  # every token of --quick's 4
        assert ours == theirs, line
        assert line.endswith(": equal"), line


@pytest.mark.parametrize("value", ["0", "257", "x", "nan", "2.5"])
def test_a_bad_decode_steps_is_refused_before_anything_loads(value, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(["--quick", "--decode-steps", "1", value])
    message = str(refused.value.code) + capsys.readouterr().err
    assert "--decode-steps" in message
    assert value in message


@pytest.mark.parametrize("value", ["maybe", "1", ""])
def test_a_bad_greedy_screen_is_refused_before_anything_loads(value, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(["--quick", "--greedy-screen", value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--greedy-screen" in err
    assert "invalid choice" in err
