"""Which libtpu jax loads, and whether the kernels pin aliased operands for it (`tpu_compiler`).

Fake installs in a temporary folder stand for the libtpu packages: the version is read from the package
beside the library jax loads, so only its layout on disk matters here. Whether each real compiler accepts
the pin is `tests/kernels/test_tpu_offline.py`'s (against this process's libtpu, and a newer one in a child
process).
"""

import importlib.metadata

import pytest

from kernels_pallas.sink_window_attention import tpu_compiler


def _fake_libtpu(folder, version):
    """`folder` laid out as `pip install --no-deps --target folder libtpu==version` lays it out."""
    (folder / "libtpu").mkdir(parents=True)
    (folder / "libtpu" / "libtpu.so").write_bytes(b"")
    info = folder / f"libtpu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: libtpu\nVersion: {version}\n")
    return folder / "libtpu" / "libtpu.so"


@pytest.mark.parametrize(
    ("version", "pinned"),
    [("0.0.42.1", False), ("0.0.49", False), ("0.0.50", True), ("0.0.52", True), ("0.1.0", True)],
)
def test_the_library_named_by_tpu_library_path_decides(tmp_path, monkeypatch, version, pinned):
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(_fake_libtpu(tmp_path, version)))
    assert tpu_compiler.libtpu_version() == version
    assert tpu_compiler.pins_aliased_operands() == pinned


def test_a_development_build_counts_by_its_release(tmp_path, monkeypatch):
    # A nightly's version carries a suffix after the release it precedes; the release decides.
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(_fake_libtpu(tmp_path, "0.0.53.dev20270101")))
    assert tpu_compiler.pins_aliased_operands()


def test_a_library_outside_a_package_is_not_pinned(tmp_path, monkeypatch):
    # A libtpu.so built or copied by hand has no version to read: the store keeps its unpinned form.
    library = tmp_path / "libtpu.so"
    library.write_bytes(b"")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(library))
    assert tpu_compiler.libtpu_version() is None
    assert not tpu_compiler.pins_aliased_operands()


def test_a_tpu_library_path_that_is_no_file_falls_back_to_the_package(tmp_path, monkeypatch):
    # As jax does: it warns and loads the `libtpu` package's library.
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(tmp_path / "missing.so"))
    try:
        installed = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert tpu_compiler.libtpu_version() == installed


def test_no_libtpu_is_not_pinned(monkeypatch):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(tpu_compiler.importlib.util, "find_spec", lambda name: None)
    assert tpu_compiler.libtpu_version() is None
    assert not tpu_compiler.pins_aliased_operands()
