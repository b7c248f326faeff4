"""The docs site (docs/: the guides, the design and the API reference) builds with warnings as errors,
holds every guide and documents the public surface."""

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
    "cache", "kernels", "compilation", "engine", "serving", "devices", "gemma3", "benchmarks",
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

