"""`offline_tpu`'s reading of compiled programs, its second-compiler helpers, and the offline TPU checks run
against that second compiler: a libtpu newer than jax's pin, installed on its own (`.ci/run` puts 0.0.52 in
`libtpu-next` in its extras' environment), in a child process, since a process loads one libtpu.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_jax.compile import offline_tpu

REPO = Path(__file__).resolve().parents[2]
NEXT_LIBTPU_DEFAULT = Path(sys.prefix) / "libtpu-next"  # beside the environment's own libtpu

# --- large_copies on hand-written optimized HLO -------------------------------------------------------------

LAYER = "bf16[129,1,1,1008,128]"  # 32.8 MB
HBM, VMEM, CMEM = (
    "{4,3,2,1,0:T(8,128)(2,1)}",
    "{4,3,2,1,0:T(8,128)(2,1)S(1)}",
    "{4,3,2,1,0:T(8,128)(2,1)S(3)}",
)
HLO = f"""
ENTRY %main {{
  %p = {LAYER}{HBM} parameter(0)
  %copy-start = ({LAYER}{HBM}, {LAYER}{VMEM}, u32[]{{:S(2)}}) copy-start(%p)
  %slice-start = (({LAYER}{HBM}), bf16[33,1,1,1008,128]{VMEM}, s32[]{{:S(2)}}) slice-start(%p)
  %slice-start.1 = (({LAYER}{HBM}), bf16[1,1,1,1008,128]{VMEM}, s32[]{{:S(2)}}) slice-start(%p)
  %staged = {LAYER}{CMEM} custom-call(%p), custom_call_target="ConcatBitcast"
  %kernel = {LAYER}{HBM} custom-call(%p), custom_call_target="tpu_custom_call"
  %copy.1 = f32[8,128]{{1,0:T(8,128)}} copy(%small)
  ROOT %transpose.2 = bf16[129,1,1,128,1008]{{4,3,2,1,0}} transpose(%p), dimensions={{0,1,2,4,3}}
}}
"""


class _Compiled:
    def as_text(self):
        return HLO


def test_large_copies_finds_moves_into_any_memory_space_and_relayouts():
    found = offline_tpu.large_copies(_Compiled(), 129 * 1008 * 128 * 2 // 8)
    # The copy-start (by its op), the slice of a quarter layer and the layer staged in S(3) (by where they
    # land), the transpose; not the one-slot slice of the layer, the kernel in HBM or the small copy.
    assert [f.split(":")[0] for f in found] == [
        "copy-start copy-start",
        "slice-start slice-start",
        "custom-call staged",
        "transpose transpose.2",
    ]


# --- the second compiler's folder ---------------------------------------------------------------------------


def _fake_libtpu(folder: Path) -> Path:
    (folder / "libtpu").mkdir(parents=True)
    (folder / "libtpu" / "libtpu.so").write_bytes(b"")
    (folder / "libtpu-0.0.52.dist-info").mkdir()
    return folder


def test_libtpu_environ_puts_the_folder_first_and_names_its_library(tmp_path):
    folder = _fake_libtpu(tmp_path / "next")
    env = offline_tpu.libtpu_environ(folder, {"PYTHONPATH": "/src", "TPU_LIBRARY_PATH": "/old/libtpu.so"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(folder.resolve()), "/src"])
    assert env["TPU_LIBRARY_PATH"] == str(folder.resolve() / "libtpu" / "libtpu.so")
    assert offline_tpu.libtpu_environ(str(folder), {})["PYTHONPATH"] == str(folder.resolve())


def _bad_folders(tmp_path: Path) -> dict[str, object]:
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    return {"missing": tmp_path / "missing", "file": tmp_path / "file", "empty": tmp_path / "empty"}


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("number", TypeError, "folder=52 must be a path"),
        ("missing", ValueError, "does not exist; install one with: pip install --no-deps --target"),
        ("file", ValueError, "is a file; expected the folder libtpu was installed into"),
        ("empty", ValueError, "holds no libtpu package"),
    ],
)
def test_libtpu_environ_refuses_what_is_no_libtpu_folder(tmp_path, kind, error, match):
    folder = 52 if kind == "number" else _bad_folders(tmp_path)[kind]
    with pytest.raises(error, match=match):
        offline_tpu.libtpu_environ(folder)


def test_libtpu_environ_refuses_an_environ_that_is_no_mapping(tmp_path):
    with pytest.raises(TypeError, match=r"environ=.* must be a mapping"):
        offline_tpu.libtpu_environ(_fake_libtpu(tmp_path / "next"), ["PYTHONPATH=/src"])


def test_next_libtpu_folder_reads_the_variable_then_the_default(tmp_path, monkeypatch):
    folder = _fake_libtpu(tmp_path / "next")
    monkeypatch.delenv(offline_tpu.NEXT_LIBTPU_VAR, raising=False)
    assert offline_tpu.next_libtpu_folder() is None
    assert offline_tpu.next_libtpu_folder(tmp_path / "absent") is None  # no default install: no compiler
    assert offline_tpu.next_libtpu_folder(folder) == folder.resolve()
    monkeypatch.setenv(offline_tpu.NEXT_LIBTPU_VAR, "")  # empty counts as unset
    assert offline_tpu.next_libtpu_folder() is None
    monkeypatch.setenv(offline_tpu.NEXT_LIBTPU_VAR, str(folder))
    assert offline_tpu.next_libtpu_folder(tmp_path / "absent") == folder.resolve()


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_next_libtpu_folder_refuses_a_variable_naming_no_libtpu_folder(tmp_path, monkeypatch, kind):
    # Set by hand, the variable must name a compiler: a wrong one is an error, not a reason to skip.
    monkeypatch.setenv(offline_tpu.NEXT_LIBTPU_VAR, str(_bad_folders(tmp_path)[kind]))
    with pytest.raises(ValueError, match=f"{offline_tpu.NEXT_LIBTPU_VAR}="):
        offline_tpu.next_libtpu_folder()


def test_next_libtpu_folder_refuses_a_default_that_is_no_path(monkeypatch):
    monkeypatch.delenv(offline_tpu.NEXT_LIBTPU_VAR, raising=False)
    with pytest.raises(TypeError, match="default=52 must be a path"):
        offline_tpu.next_libtpu_folder(52)
    with pytest.raises(ValueError, match=r"default=.* is a file"):
        offline_tpu.next_libtpu_folder(__file__)


# --- the offline TPU checks against the second compiler ----------------------------------------------------

# What the newer compiler changes: the store pinned to HBM (accepted where 0.0.42 rejects it), every store
# path compiled pinned and aliased, and small layers left in HBM on every generation.
NEXT_LIBTPU_TESTS = (
    "tests/kernels/test_tpu_offline.py::test_the_store_pin_compiles_exactly_where_the_libtpu_version_says",
    "tests/kernels/test_tpu_offline.py::test_small_layer_step_keeps_the_cache_in_hbm",
    "tests/kernels/test_tpu_offline.py::test_pinned_small_layer_steps_keep_the_cache_in_hbm",
    "tests/kernels/test_store.py::test_tpu_kernel_compiles_and_stores_in_place",
    "tests/kernels/test_store.py::test_tpu_pin_follows_the_setting_and_the_libtpu",
)


@pytest.mark.slow
@pytest.mark.aot
def test_offline_tpu_checks_pass_against_the_next_libtpu():
    if offline_tpu.tpu_toolchain_missing():
        pytest.skip(f"no offline TPU compiler: {offline_tpu.tpu_toolchain_missing()}")
    folder = offline_tpu.next_libtpu_folder(NEXT_LIBTPU_DEFAULT)
    if folder is None:
        pytest.skip(
            f"no second libtpu at {NEXT_LIBTPU_DEFAULT} and ${offline_tpu.NEXT_LIBTPU_VAR} unset (.ci/run "
            f"installs one: pip install --no-deps --target {NEXT_LIBTPU_DEFAULT} libtpu==0.0.52)"
        )
    env = {k: v for k, v in offline_tpu.libtpu_environ(folder).items() if not k.startswith("PYTEST_")}
    command = [sys.executable, "-m", "pytest", "-n0", "-q", "-p", "no:cacheprovider", *NEXT_LIBTPU_TESTS]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # Everything passed: none skipped or expected to fail, as they would against a libtpu without the pin.
    summary = [line for line in result.stdout.splitlines() if re.search(r"\d+ passed", line)]
    assert summary, output[-6000:]
    assert re.fullmatch(r"=*\s*\d+ passed in [\d.]+s.*", summary[-1]), output[-6000:]
