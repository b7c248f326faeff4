"""Every deployment the project ships passes `mstar-jax check`, and is built where this install allows.

The files are `configs/*.yaml` and the package's embedded copies (`mstar_jax/configs`, what an installed
package reads). A file no test reads can break unseen: the Gemma deployment carried a duplicate key, and
every command refused it, for as long as nothing checked it.
"""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_jax.cli import main
from mstar_jax.deployment import DEFAULT_CONFIG
from tests import extras

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
EMBEDDED = sorted(Path(str(importlib.resources.files("mstar_jax") / "configs")).glob("*.yaml"))

SIMULATED_DEVICES = {"mesh_cpu8.yaml": 8}
"""The devices a file's mesh needs, simulated on this CPU host."""

DEVICE_MEMORY = {"tpu_streaming_tts.yaml": "95GiB"}
"""The memory of the device a file is sized for, where it is not this host's (a TPU v5p chip)."""

BUILT_BY = {
    "streaming_tts.yaml": ("tests/engine/test_soak.py", "DEFAULT_CONFIG"),
    "mesh_cpu8.yaml": ("tests/engine/test_multiprocess_engine.py", '"configs" / "mesh_cpu8.yaml"'),
    "gemma3_270m.yaml": ("tests/test_configs.py", "test_the_gemma_deployment_builds_and_serves"),
}
"""Where each deployment is built and served (a test that names it), beside the one a CPU cannot hold."""

UNBUILDABLE = {"tpu_streaming_tts.yaml": "sized for a TPU chip's 95 GiB: 1.8 B parameters and 64 slots"}


def check(path: Path) -> list[str]:
    memory = DEVICE_MEMORY.get(path.name)
    return ["check", str(path), *(["--device-memory", memory] if memory else [])]


def test_the_shipped_files_are_the_embedded_ones():
    assert [p.name for p in SHIPPED] == [p.name for p in EMBEDDED]
    assert [p.read_bytes() for p in SHIPPED] == [p.read_bytes() for p in EMBEDDED]
    assert DEFAULT_CONFIG.name in {p.name for p in EMBEDDED}


@pytest.mark.parametrize("path", SHIPPED + EMBEDDED, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_shipped_deployment_passes_check(path, capsys):
    devices = SIMULATED_DEVICES.get(path.name)
    if devices is None:
        assert main(check(path)) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
    else:  # a process's device count is fixed when JAX starts: a child with the devices simulated
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        code = f"from mstar_jax.cli import main; raise SystemExit(main({check(path)!r}))"
        child = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert child.returncode == 0, child.stderr
        out = child.stdout
    assert out.startswith(f"deployment  {path}\n")
    assert "headroom (fits)" in out


def test_every_shipped_deployment_is_built_by_a_test_or_says_why_not():
    assert set(BUILT_BY) | set(UNBUILDABLE) == {p.name for p in SHIPPED}
    assert not set(BUILT_BY) & set(UNBUILDABLE)
    for name, (test_file, mention) in BUILT_BY.items():
        assert mention in (ROOT / test_file).read_text(), f"{test_file} no longer builds {name}"


@pytest.fixture
def without_the_gemma_extra(monkeypatch):
    """The gemma extra's modules made unimportable, as on an install without it."""
    for module in extras.EXTRAS["gemma"][1]:
        monkeypatch.setitem(sys.modules, module, None)


def test_a_gemma_deployment_checks_without_the_gemma_extra(without_the_gemma_extra, capsys):
    path = ROOT / "configs" / "gemma3_270m.yaml"
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "model       gemma3 (Gemma3DeploymentConfig)" in out
    assert "model weights (268,098,176 parameters)" in out  # Gemma 3 270M's declared geometry


def test_a_bad_gemma_setting_is_refused_by_name_without_the_gemma_extra(
    without_the_gemma_extra, tmp_path, capsys
):
    text = (
        (ROOT / "configs" / "gemma3_270m.yaml").read_text().replace("  seed: 0\n", "  seed: 0\n  voices: 2\n")
    )
    path = tmp_path / "gemma.yaml"
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].endswith(
        "workload: voices=2 is not read by model 'gemma3'; its workload reads "
        "['streams', 'arrival_rate_hz', 'min_text_tokens', 'max_text_tokens', "
        "'min_new_tokens', 'max_new_tokens', 'seed']"
    ), err[0]


@pytest.mark.gemma
@pytest.mark.slow
def test_the_gemma_deployment_builds_and_serves(tmp_path, capsys):
    path = ROOT / "configs" / "gemma3_270m.yaml"
    assert main(["run", "--config", str(path), "--output", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "4/4 done, 0 failed" in out, out
    assert (tmp_path / "report.json").is_file()
