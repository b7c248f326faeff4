"""benchmarks/accelerators.py runs, and its quick table reports what the offline compilers say."""

import re

import pytest

from benchmarks import accelerators
from mstar_jax.compile import offline_gpu, offline_tpu

MISSING = offline_tpu.tpu_toolchain_missing() or offline_gpu.gpu_toolchain_missing()


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
