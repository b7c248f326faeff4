"""The suite's own schedule (`tests/conftest.py`): the files it sends first exist, and go first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.conftest import HEAVIEST_FIRST, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_sent_first_is_a_test_file_of_the_suite():
    for path in HEAVIEST_FIRST:
        assert (ROOT / path).is_file(), path  # a renamed file would silently lose its place
        assert Path(path).name.startswith("test_"), path


def test_the_heaviest_files_go_first_heaviest_first_and_the_rest_keep_their_order():
    heaviest, second = sorted(HEAVIEST_FIRST, key=HEAVIEST_FIRST.get, reverse=True)[:2]
    collected = [f"tests/a/test_x.py::t{i}" for i in range(2)] + [f"{second}::t", f"{heaviest}::t"]
    collected += ["tests/b/test_y.py::t"]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in collected]
    pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == [
        f"{heaviest}::t", f"{second}::t", "tests/a/test_x.py::t0", "tests/a/test_x.py::t1",
        "tests/b/test_y.py::t",
    ]  # fmt: skip
