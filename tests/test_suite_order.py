"""The suite's own schedule and tiers (`tests/conftest.py`, `tests/extras.py`): the files it sends first
exist, and go first; a test that needs an extra carries its marker and skips, naming it, without it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

from tests import extras
from tests.conftest import HEAVIEST_FIRST, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


class _Item(SimpleNamespace):
    """A collected test as the hook sees it: a node id and its markers."""

    def __init__(self, nodeid: str, *marks: str):
        super().__init__(nodeid=nodeid, marks=set(marks), added=[])

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, mark) -> None:
        self.added.append(mark)


def test_every_file_sent_first_is_a_test_file_of_the_suite():
    for path in HEAVIEST_FIRST:
        assert (ROOT / path).is_file(), path  # a renamed file would silently lose its place
        assert Path(path).name.startswith("test_"), path


def test_the_heaviest_files_go_first_heaviest_first_and_the_rest_keep_their_order():
    heaviest, second = sorted(HEAVIEST_FIRST, key=HEAVIEST_FIRST.get, reverse=True)[:2]
    collected = [f"tests/a/test_x.py::t{i}" for i in range(2)] + [f"{second}::t", f"{heaviest}::t"]
    collected += ["tests/b/test_y.py::t"]
    items = [_Item(nodeid) for nodeid in collected]
    pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == [
        f"{heaviest}::t", f"{second}::t", "tests/a/test_x.py::t0", "tests/a/test_x.py::t1",
        "tests/b/test_y.py::t",
    ]  # fmt: skip


def test_a_test_marked_with_an_absent_extra_skips_naming_it_and_how_to_install_it(monkeypatch):
    absent = ("the moon", ("no_such_module_anywhere",))
    monkeypatch.setattr(extras, "EXTRAS", {**extras.EXTRAS, "moon": absent})
    marked, plain = _Item("tests/test_x.py::a", "moon"), _Item("tests/test_x.py::b")
    extras.skip_marked_without_extras([marked, plain])
    (skip,) = marked.added
    assert skip.kwargs["reason"] == (
        "needs the moon extra (the moon; no_such_module_anywhere missing): pip install -e '.[moon]'"
    )
    assert plain.added == []


def test_each_extra_is_one_of_the_package_and_a_registered_marker():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(extras.EXTRAS) <= set(pyproject["project"]["optional-dependencies"])
    markers = {line.split(":")[0] for line in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert markers == {"slow", *extras.EXTRAS}


_MODULES = "|".join(re.escape(m) for _, names in extras.EXTRAS.values() for m in names)
OWN_SKIP = re.compile(
    rf"importorskip\(\s*[\"']({_MODULES})[\"']"  # skipping on an extra's module
    rf"|find_spec\(\s*[\"']({_MODULES})[\"']"
    rf"|skip(if)?\([^\n]*\.\[({'|'.join(extras.EXTRAS)})"  # a skip whose reason installs an extra
)
"""A test skipping for an extra by its own means, not through its marker."""


def test_a_skip_of_its_own_is_recognised():
    assert OWN_SKIP.search('gguf = pytest.importorskip("gguf", reason="...")')
    assert OWN_SKIP.search('if importlib.util.find_spec("llama_cpp") is None:')
    assert OWN_SKIP.search(
        """pytest.skip("llama-cpp-python is not installed (pip install -e '.[gemma,llama]')")"""
    )
    assert not OWN_SKIP.search("""assert install == "pip install -e '.[dev]'" """)
    assert not OWN_SKIP.search('sphinx = pytest.importorskip("sphinx")')


def test_no_test_skips_for_an_extra_on_its_own():
    # An extra's skip elsewhere would hide its tests from both of .ci/run's environments: the marker is
    # what the extras' environment selects.
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name not in ("extras.py", "test_suite_order.py") and OWN_SKIP.search(path.read_text())
    ]
    assert offenders == []
