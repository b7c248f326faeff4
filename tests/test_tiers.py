"""The fast tier, `pytest -m "not slow"`, still loads every module of the library.

A test file is slow when its module-level `pytestmark` carries `pytest.mark.slow` (what compiles whole
engines, runs children or meshes). The fast tier's files, their helpers and the conftests are followed
through the static import graph (`tests/test_import_graph.py`'s reading of imports): every module of
`mstar_jax` and `kernels_pallas` must be reached, so a change anywhere meets a fast test.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import PACKAGES, ROOT, edges_of, module_files

KERNEL_DISPATCH = frozenset(
    {
        # Chosen at run time by `dispatch.py` and `store.py` (`importlib.import_module` on the
        # implementation's name): imports the graph cannot see.
        f"kernels_pallas.sink_window_attention.{name}"
        for name in ("gpu", "tpu", "store_gpu", "store_tpu")
    }
)


def marked_slow(path: Path) -> bool:
    """Whether the file's module-level `pytestmark` includes `pytest.mark.slow`."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node.value))
    return False


def fast_tier_reaches() -> set[str]:
    modules = module_files(ROOT, (*PACKAGES, "tests", "benchmarks"))
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = edges_of(name, path.read_text(), modules, is_package=path.name == "__init__.py")
        graph[name] = {edge.imported for edge in edges}
    roots = [
        name
        for name, path in modules.items()
        if path.name == "conftest.py" or (path.name.startswith("test_") and not marked_slow(path))
    ]
    reached, todo = set(roots), list(roots)
    while todo:
        for imported in graph.get(todo.pop(), ()):
            if imported not in reached:
                reached.add(imported)
                todo.append(imported)
    return reached


def test_the_fast_tier_loads_every_module():
    library = set(module_files())
    missed = sorted(library - fast_tier_reaches() - KERNEL_DISPATCH)
    assert missed == [], f"no fast test file reaches {missed}: test them outside the slow files"


def test_a_file_is_slow_by_its_module_marker_only(tmp_path):
    cases = {
        "pytestmark = pytest.mark.slow\n": True,
        "pytestmark = [pytest.mark.serve, pytest.mark.slow]\n": True,
        "pytestmark = pytest.mark.serve\n": False,
        "@pytest.mark.slow\ndef test_one():\n    pass\n": False,  # one slow test leaves the file in the tier
    }
    for i, (text, slow) in enumerate(cases.items()):
        path = tmp_path / f"test_{i}.py"
        path.write_text(text)
        assert marked_slow(path) == slow, text
