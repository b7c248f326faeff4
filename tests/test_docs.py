"""The docs site (docs/: the guides, the design and the API reference) builds with warnings as errors,
holds every guide, documents the public surface, and its tour of the layout (docs/design.md §2) names
every module."""

import html
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="Sphinx is not installed (the dev or docs extra): no docs site")
pytest.importorskip("myst_parser", reason="myst-parser is not installed (the dev or docs extra)")

ROOT = Path(__file__).resolve().parents[1]


COMMAND = ("-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs")
GUIDES = [
    "cache", "kernels", "compilation", "engine", "serving", "server", "devices", "gemma3", "benchmarks",
    "accelerators", "reliability",
]  # fmt: skip


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The HTML build of docs, made as CI makes it: `-W --keep-going`, every warning an error (the
    pages are written all the same, so the content tests below still say what they find)."""
    out = tmp_path_factory.mktemp("docs_html")
    result = subprocess.run(
        [sys.executable, *COMMAND, str(out)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return result, out


@pytest.fixture(scope="module")
def built(build) -> Path:
    return build[1]


def test_the_build_passes_with_warnings_as_errors(build):
    result, _ = build
    lines = result.stderr.splitlines()
    warnings = [line for line in lines if ("WARNING" in line or "ERROR" in line) and "absl::" not in line]
    assert result.returncode == 0, f"python {' '.join(COMMAND)} failed:\n" + "\n".join(warnings)


def _short(text: str) -> str:
    """Dotted names cut to their last part (`jax.Array` -> `Array`), as the built signatures show them."""
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text)


def _documented_signature(page: Path, object_id: str) -> str:
    """The signature line of the object description `object_id` on `page`, as text on one line."""
    match = re.search(rf'<dt[^>]*\bid="{re.escape(object_id)}"[^>]*>(.*?)</dt>', page.read_text(), re.S)
    assert match, f"{object_id} is not documented on {page.name}"
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", match.group(1))).split()).rstrip("¶")
    return _short(text.replace("( ", "(").replace(", )", ")"))  # one parameter a line: "(\n  a,\n)"


def _annotation(annotation) -> str:
    """An annotation as source text (modules with `from __future__ import annotations` keep strings)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _expected_signature(name: str, fn) -> str:
    """`fn`'s signature written as Sphinx renders it: `name(a: T, *, b: U = 1) → R`."""
    signature = inspect.signature(fn)
    parts, star = [], False
    for parameter in signature.parameters.values():
        if parameter.name == "self":
            continue
        if parameter.kind is parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        part = parameter.name
        annotated = parameter.annotation is not parameter.empty
        if annotated:
            part += f": {_annotation(parameter.annotation)}"
        if parameter.default is not parameter.empty:
            part += f" = {parameter.default!r}" if annotated else f"={parameter.default!r}"
        parts.append(part)
    text = f"{name}({', '.join(parts)})"
    if signature.return_annotation is not signature.empty:
        text += f" → {_annotation(signature.return_annotation)}"
    return _short(text)


def test_attend_is_documented_with_its_signature(built):
    from mstar_jax.resources.kv.bounded import attend

    object_id = "mstar_jax.resources.kv.bounded.attend"
    documented = _documented_signature(built / "api" / "bounded_kv.html", object_id)
    assert documented == _expected_signature("attend", attend)


def test_manager_plan_is_documented_with_its_signature(built):
    from mstar_jax.resources.kv.bounded import BoundedKVManager

    object_id = "mstar_jax.resources.kv.bounded.BoundedKVManager.plan"
    documented = _documented_signature(built / "api" / "bounded_kv.html", object_id)
    assert documented == _expected_signature("plan", BoundedKVManager.plan)


@pytest.mark.parametrize(
    ("package", "page"),
    [
        ("mstar_jax.resources.kv.bounded", "bounded_kv.html"),
        ("kernels_pallas.sink_window_attention", "sink_window_attention.html"),
        ("mstar_jax.native", "native.html"),
    ],
)
def test_every_exported_name_is_documented(built, package, page):
    module = importlib.import_module(package)
    text = (built / "api" / page).read_text()
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        # A submodule is documented as a module of its own; anything else under the package's name.
        anchor = f"module-{obj.__name__}" if isinstance(obj, types.ModuleType) else f"{package}.{name}"
        if f'id="{anchor}"' not in text:
            missing.append(name)
    assert not missing, f"{page} does not document {missing} of {package}.__all__"


def test_every_guide_and_the_design_are_pages_of_the_site(built):
    index = (built / "index.html").read_text()
    for page in [*(f"guides/{guide}" for guide in GUIDES), "design", "deployments", "api/index"]:
        assert (built / f"{page}.html").exists(), f"the site has no {page}"
        assert f'href="{page}.html"' in index, f"the index does not link {page}"


def _layout_rows() -> dict[str, str]:
    """docs/design.md §2's table: each row's path (a folder ends in `/`) and its contents cell."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## 2. Layout", 1)[1].split("\n## 3.", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for path in re.findall(r"`([^`]+)`", cells[0]):
                rows[path] = cells[1]
    return rows


def _tracked_files() -> list[str]:
    """The repository's files as `git ls-files` lists them; without git (an unpacked sdist), the tree's."""
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    if listed:
        return listed
    skip = {"__pycache__", "_build", ".venv", ".git", "runs"}
    return [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*")
        if path.is_file() and not skip & set(path.relative_to(ROOT).parts)
    ]


def test_the_layout_tour_names_every_module():
    rows = _layout_rows()
    files = _tracked_files()
    unnamed = []
    for relative in files:
        folder, _, name = relative.rpartition("/")
        if not relative.startswith(("mstar_jax/", "kernels_pallas/")) or not name.endswith(".py"):
            continue
        if name == "__init__.py":
            continue
        if f"`{name}`" not in rows.get(f"{folder}/", ""):
            unnamed.append(relative)
    assert not unnamed, f"docs/design.md §2 does not name {unnamed} in its folder's row"
    top = {relative.split("/")[0] for relative in files if "/" in relative}
    missing = sorted(name for name in top if not any(row.startswith(f"{name}/") for row in rows))
    assert not missing, f"docs/design.md §2 has no row for {missing}/"
