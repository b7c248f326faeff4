"""benchmarks/accelerators.py runs, and its quick table reports what the offline compilers say."""

import re

import pytest

from benchmarks import accelerators
from mstar_jax.compile import offline_gpu, offline_tpu

MISSING = offline_tpu.tpu_toolchain_missing() or offline_gpu.gpu_toolchain_missing()
pytestmark = [pytest.mark.slow, pytest.mark.aot]


@pytest.mark.skipif(MISSING is not None, reason=f"no offline compilers: {MISSING}")
def test_quick_summary_reports_every_case_compiled_and_spill_free(capsys):
    accelerators.main(["--quick", "--summary"])
    out = capsys.readouterr().out
    tpu_rows = [line for line in out.splitlines() if line.startswith("| decode")][:3]
    assert len(tpu_rows) == 3
    for row in tpu_rows:
        assert "| all 4 " in row, row  # compiled on v4, v5e, v5p and v6e with no cache-sized copy
    gpu_rows = re.findall(r"^\| (decode\w*) +\| bfloat16 +\| \d+ +\| (\d+/\d+) ", out, flags=re.M)
    assert len(gpu_rows) == 3
    assert {spills for _, spills in gpu_rows} == {"0/0"}


@pytest.mark.skipif(MISSING is not None, reason=f"no offline compilers: {MISSING}")
def test_score_term_rows_report_temporaries_against_the_bias():
    import jax.numpy as jnp

    from mstar_jax.compile import accelerator_cases

    rows = accelerators.tpu_rows(accelerator_cases.CASES[:1], (jnp.bfloat16,), ("rel_bias", "sink_logits"))
    assert [r.generation for r in rows] == list(offline_tpu.GENERATIONS)
    for row in rows:
        assert row.compiled == "yes", row
        # The walk layout: an output and an index about the bias's size each, tile-padded (v5p stages the
        # most, 5.75 times the bias for this case).
        assert 0 <= row.temp_per_bias < 8, row
