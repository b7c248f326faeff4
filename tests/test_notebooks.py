"""Every notebook in `notebooks/` runs top to bottom on CPU, and is stored clean.

The kernel is the Python running pytest (so it sees the package installed in that environment), found
through a kernelspec written to a temporary `JUPYTER_PATH`: a `python3` kernelspec elsewhere on the
machine (a user's, another environment's) must not pick the interpreter.
"""

import json
import os
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests import extras

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
KERNEL_NAME = "python3"
TIMEOUT_S = 600  # per cell: the tour's take seconds on a 2-core CPU, Gemma 3's a few minutes


def test_notebooks_exist():
    assert PATHS, f"no notebooks in {NOTEBOOKS}"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch) -> dict[str, str]:
    """Points Jupyter at a `python3` kernelspec running `sys.executable`; returns the kernel's environment."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "Agg",
        "IPYTHONDIR": str(tmp_path / "ipython"),  # no history or profile written to the user's home
    }


def extras_needed(path: pathlib.Path) -> list[str]:
    """The extras whose modules a notebook names in its metadata (`mstar_requires`)."""
    required = set(nbformat.read(path, as_version=4).metadata.get("mstar_requires", []))
    needed = [extra for extra, (_, modules) in extras.EXTRAS.items() if required & set(modules)]
    unknown = required - {module for extra in needed for module in extras.EXTRAS[extra][1]}
    assert not unknown, f"{path.name} requires {sorted(unknown)}, which no extra of tests/extras.py installs"
    return needed


@pytest.mark.parametrize(
    "path",
    [  # one needing an extra runs the real model (minutes): the slow tier's
        pytest.param(
            p,
            marks=[getattr(pytest.mark, e) for e in extras_needed(p)]
            + [pytest.mark.slow] * bool(extras_needed(p)),
        )
        for p in PATHS
    ],
    ids=[p.name for p in PATHS],
)
def test_notebook_runs(path: pathlib.Path, kernel_env: dict[str, str]):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT_S,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOKS)}},  # the kernel's working directory
    )
    # Raises CellExecutionError, naming the cell and its traceback, at the first cell that fails.
    client.execute(env=kernel_env)
    errors = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, errors


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_is_stored_clean(path: pathlib.Path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"cell {i} of {path.name} is stored with outputs; clear them"
            assert cell.execution_count is None, f"cell {i} of {path.name} has an execution count"
