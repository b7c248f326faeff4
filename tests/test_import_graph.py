"""The import graph of `mstar_jax` and `kernels_pallas` has no cycles, and its dependencies point one way.

Read statically with `ast`, without importing anything. The rules:

- Nodes are modules; a package's `__init__.py` is the module named by the package.
- Every `import` and `from ... import` counts, at module level or inside a function (a lazy import
  hides a cycle from Python, not from the design), a package's `__getattr__` re-exports included.
  Imports under `if TYPE_CHECKING:` do not count for cycles: they never run, and naming a type for an
  annotation does not make one module build on the other. They do count for the layering rules,
  where a type-only dependency on a higher layer is still one.
- `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`; so a package
  lazily re-exporting its own submodules (`pkg -> pkg.sub`) closes no cycle unless `pkg.sub` imports
  something through `pkg` itself.
- Importing `a.b.c` runs `a/__init__` and `a/b/__init__` first: those are edges too, except to the
  importer's own ancestor packages, which Python has begun before the importer and never re-enters.
- Computed imports (`importlib.import_module(f"...{name}")`, the kernels' dispatch) are invisible here.

One edge is allowed to close a cycle: the seed's own lazy builder import inside
`BoundedKVSpec.resource_class` (config -> manager -> config), which keeps declaring a resource free of
the manager and its kernels. Layering (STYLE.md): `kernels_pallas` imports nothing from `mstar_jax`;
`mstar_jax.resources` and `mstar_jax.serving` (what models plug into) import nothing from `mstar_jax.models`
or `mstar_jax.engine`.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mstar_jax", "kernels_pallas")

ALLOWED = frozenset(
    {
        (
            "mstar_jax.resources.kv.bounded.config",
            "mstar_jax.resources.kv.bounded.manager",
            "BoundedKVSpec.resource_class",
        ),
    }
)
"""(importer, imported, enclosing function) of each edge that may close a cycle."""

# Package -> packages it must not import from (a module counts as inside a package by its dotted prefix).
FORBIDDEN = {
    "kernels_pallas": ("mstar_jax",),
    "mstar_jax.resources": ("mstar_jax.models", "mstar_jax.engine"),
    "mstar_jax.serving": ("mstar_jax.models", "mstar_jax.engine"),
    # The front door sits on the engine, never the reverse; the engine serves any model and names none.
    "mstar_jax.engine": ("mstar_jax.server", "mstar_jax.models"),
    # CPU kernels, as `kernels_pallas` is for accelerators: below everything that uses them.
    "mstar_jax.native": (
        "mstar_jax.models",
        "mstar_jax.engine",
        "mstar_jax.serving",
        "mstar_jax.resources",
        "mstar_jax.server",
    ),
}


DESIGN = ROOT / "docs" / "design.md"
LAYERS_INTRO = "Each layer below imports only from the layers to its left:"
ROOT_MODULE = "__init__"
"""How the layer list names the root package's own module (`mstar_jax/__init__.py`)."""


def documented_layers(design: Path = DESIGN) -> list[list[str]]:
    """The layer order docs/design.md states: the indented line after `LAYERS_INTRO`, layers split on
    `|`, the names in one layer on `,` (`kernels_pallas` is a package; every other name is one of
    `mstar_jax`, `__init__` its own module)."""
    lines = design.read_text().splitlines()
    at = lines.index(LAYERS_INTRO)
    line = next(text for text in lines[at + 1 :] if text.strip())
    return [[name.strip() for name in layer.split(",")] for layer in line.split("|")]


def layer_index(module: str, layers: list[list[str]]) -> int | None:
    """The index of the layer holding `module` (its longest documented prefix), None for no layer."""
    best, index = -1, None
    for i, layer in enumerate(layers):
        for name in layer:
            prefix = "mstar_jax" if name == ROOT_MODULE else name if name in PACKAGES else f"mstar_jax.{name}"
            exact = name == ROOT_MODULE
            if (module == prefix if exact else within(module, prefix)) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def layer_violations(edges: Iterable[Edge], layers: list[list[str]]) -> list[str]:
    """Each edge from a layer into a layer to its right (type-only included)."""
    return [
        f"{e.importer} imports {e.imported} ({'type-only, ' if e.type_only else ''}line {e.line})"
        for e in edges
        if layer_index(e.imported, layers) > layer_index(e.importer, layers)
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
    """`importer` imports `imported` at `line`, inside `scope` (the enclosing classes and functions,
    dotted: "BoundedKVSpec.resource_class"; "" at module level); `type_only` under `if TYPE_CHECKING:`."""

    importer: str
    imported: str
    line: int
    scope: str
    type_only: bool


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of `packages` (a package by its `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Every import statement of one module, with its enclosing function and whether it is type-only."""

    def __init__(self):
        self.found: list[tuple[ast.Import | ast.ImportFrom, str, bool]] = []
        self._scope: list[str] = []
        self._type_only = 0

    def _enter(self, node: ast.AST, name: str) -> None:
        self._scope.append(name)
        self.generic_visit(node)
        self._scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._enter(node, node.name)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, node.name)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_only += 1
        for child in node.body:
            self.visit(child)
        self._type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, ".".join(self._scope), self._type_only > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, ".".join(self._scope), self._type_only > 0))


def _known(name: str, modules: Mapping[str, object]) -> str | None:
    """`name`, or its longest prefix that is one of `modules` (`a.b.Klass` -> `a.b`); None outside them."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _with_parents(target: str, importer: str, modules: Mapping[str, object]) -> list[str]:
    """`target` and the packages Python runs before it, less the importer's own ancestors."""
    parts = target.split(".")
    chain = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return [name for name in chain if name in modules and (name == target or not within(importer, name))]


def edges_of(name: str, source: str, modules: Mapping[str, object], *, is_package: bool) -> list[Edge]:
    """The import edges of module `name` (whose text is `source`) into `modules`."""
    visitor = _Imports()
    visitor.visit(ast.parse(source))
    edges = []
    for node, scope, type_only in visitor.found:
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the importer's package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            # `from pkg import sub` names the submodule where there is one, else something of `pkg`.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for target in targets:
            known = _known(target, modules)
            if known is None:
                continue
            for imported in _with_parents(known, name, modules):
                if imported != name:
                    edges.append(Edge(name, imported, node.lineno, scope, type_only))
    return edges


def import_edges(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Edge]:
    files = module_files(root, packages)
    edges = []
    for name, path in files.items():
        edges += edges_of(name, path.read_text(), files, is_package=path.name == "__init__.py")
    return edges


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (node -> successors) with more than one node, or a
    self-loop; each sorted, the list sorted. Tarjan's algorithm, iterative (no recursion limit)."""
    nodes = sorted(set(graph) | {succ for succs in graph.values() for succ in succs})
    successors = {node: sorted(set(graph.get(node, ()))) for node in nodes}
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(successors[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            advanced = False
            for succ in pending:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(successors[succ])))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in successors[node]:
                    components.append(sorted(component))
    return sorted(components)


def a_cycle(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """One cycle through `component`'s first node, as the nodes visited (first repeated at the end)."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, so the cycle shown is a shortest one through `start`
        following = []
        for node in frontier:
            for succ in sorted(set(graph.get(node, ())) & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if succ not in parent:
                    parent[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def layering_violations(edges: Iterable[Edge], forbidden: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Each edge from inside a key of `forbidden` into one of the packages it names, type-only included."""
    return [
        f"{e.importer} imports {e.imported} ({'type-only, ' if e.type_only else ''}line {e.line})"
        for e in edges
        for package, banned in forbidden.items()
        if within(e.importer, package) and any(within(e.imported, b) for b in banned)
    ]


# -- the cycle finder itself, on graphs small enough to check by eye ------------------------------------


def test_the_cycle_finder_finds_a_cycle_and_only_the_cycle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": []}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_the_cycle_finder_passes_a_dag_and_finds_two_cycles_and_a_self_loop():
    assert strongly_connected({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    graph = {"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c", "a"], "s": ["s"]}
    assert strongly_connected(graph) == [["a", "b"], ["c", "d"], ["s"]]


def test_a_lazy_import_inside_a_function_closes_a_cycle(tmp_path):
    # deployment -> memory at module level, memory -> deployment hidden in a function: still a cycle.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "deployment.py").write_text("from pkg.memory import costs\n")
    (tmp_path / "pkg" / "memory.py").write_text("def costs():\n    from pkg import deployment\n")
    (tmp_path / "pkg" / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.memory import costs\n"
    )
    edges = import_edges(tmp_path, ["pkg"])
    graph = _graph(edges)
    assert strongly_connected(graph) == [["pkg.deployment", "pkg.memory"]]
    (hidden,) = [edge for edge in edges if edge.importer == "pkg.memory"]
    assert (hidden.imported, hidden.scope, hidden.line) == ("pkg.deployment", "costs", 2)
    assert [edge.type_only for edge in edges if edge.importer == "pkg.types"] == [True]


def test_a_package_reexporting_its_submodules_lazily_closes_no_cycle_but_importing_through_it_does(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "def __getattr__(name):\n    from pkg import a as module\n    return getattr(module, name)\n"
    )
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\nfrom pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("x = 1\n")
    assert strongly_connected(_graph(import_edges(tmp_path, ["pkg"]))) == []
    (tmp_path / "pkg" / "b.py").write_text("from pkg import A\n")  # a re-export, through the package
    assert strongly_connected(_graph(import_edges(tmp_path, ["pkg"]))) == [["pkg", "pkg.a", "pkg.b"]]


def test_importing_a_submodule_runs_its_packages_but_not_the_importers_own(tmp_path):
    for package in ("p", "q"):
        (tmp_path / package).mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from p.a import A\n")  # an eager re-export
    (tmp_path / "p" / "a.py").write_text("import p.b\nfrom q.m import M\n")  # p: its own, begun already
    (tmp_path / "p" / "b.py").write_text("")
    (tmp_path / "q" / "__init__.py").write_text("")
    (tmp_path / "q" / "m.py").write_text("from p.b import B\n")  # runs p/__init__ -> p.a -> q.m
    graph = _graph(import_edges(tmp_path, ["p", "q"]))
    assert "p" not in graph["p.a"]
    assert strongly_connected(graph) == [["p", "p.a", "q.m"]]


def test_the_layering_check_names_a_type_only_import_upwards_and_passes_the_downward_ones():
    edges = [
        Edge("low.a", "high.b", 3, "", type_only=True),
        Edge("high.b", "low.a", 1, "", type_only=False),
        Edge("lower", "high.b", 1, "", type_only=False),  # "low" is not a prefix of "lower"
    ]
    assert layering_violations(edges, {"low": ("high",)}) == ["low.a imports high.b (type-only, line 3)"]


# -- the library ---------------------------------------------------------------------------------------


def _graph(edges: Iterable[Edge], allowed: frozenset = frozenset()) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set())
        if not edge.type_only and (edge.importer, edge.imported, edge.scope) not in allowed:
            graph[edge.importer].add(edge.imported)
    return graph


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_graph_sees_the_library(edges):
    importers = {edge.importer for edge in edges}
    assert {"mstar_jax.engine.engine", "mstar_jax.resources.kv.bounded.manager"} <= importers
    lazy = {(e.importer, e.imported) for e in edges if e.scope == "__getattr__"}
    assert ("mstar_jax.resources.kv.bounded", "mstar_jax.resources.kv.bounded.manager") in lazy


def test_there_are_no_import_cycles(edges):
    graph = _graph(edges, ALLOWED)
    where = {(e.importer, e.imported): e for e in edges if not e.type_only}
    files = module_files()
    problems = []
    for component in strongly_connected(graph):
        cycle = a_cycle(graph, component)
        steps = []
        for importer, imported in itertools.pairwise(cycle):
            edge = where[importer, imported]
            scope = f" in {edge.scope}()" if edge.scope else ""
            place = f"{files[importer].relative_to(ROOT)}:{edge.line}{scope}"
            steps.append(f"  {importer} -> {imported}  ({place})")
        problems.append(f"cycle among {component}:\n" + "\n".join(steps))
    assert not problems, "import cycles (move what both sides need into a leaf module):\n" + "\n".join(
        problems
    )


def test_the_allowed_edge_is_there_and_does_close_a_cycle(edges):
    # An allow-list entry that no longer matches would silently allow nothing, or hide a stale exception.
    present = {(e.importer, e.imported, e.scope) for e in edges if not e.type_only}
    assert present >= ALLOWED
    components = strongly_connected(_graph(edges))
    for importer, imported, scope in ALLOWED:
        closing = any({importer, imported} <= set(component) for component in components)
        assert closing, f"{importer} -> {imported} in {scope}() closes no cycle: remove it from ALLOWED"


def test_dependencies_point_one_way(edges):
    wrong = layering_violations(edges, FORBIDDEN)
    assert not wrong, "layering broken:\n" + "\n".join(wrong)


def test_every_module_sits_in_a_documented_layer_and_imports_only_to_its_left(edges):
    """The order docs/design.md states is the order enforced: a module in no layer, or an import into a
    layer to the right, fails here."""
    layers = documented_layers()
    unplaced = sorted(m for m in module_files() if layer_index(m, layers) is None)
    assert not unplaced, f"modules in no layer of {DESIGN.name}'s list: {unplaced}"
    wrong = layer_violations(edges, layers)
    assert not wrong, f"imports against {DESIGN.name}'s layer order:\n" + "\n".join(wrong)


def test_the_layer_check_reads_the_documented_order_and_names_an_import_to_the_right(tmp_path):
    design = tmp_path / "design.md"
    design.write_text(f"{LAYERS_INTRO}\n\n    kernels_pallas | serving, __init__ | engine | models\n")
    layers = documented_layers(design)
    assert layers == [["kernels_pallas"], ["serving", "__init__"], ["engine"], ["models"]]
    assert layer_index("mstar_jax.models.gemma3.run", layers) == 3
    assert layer_index("mstar_jax", layers) == 1
    assert layer_index("mstar_jax.cli", layers) is None
    down = Edge("mstar_jax.models.a", "mstar_jax.engine.b", 1, "", False)
    up = Edge("mstar_jax.engine.b", "mstar_jax.models.a", 7, "f", True)
    wrong = ["mstar_jax.engine.b imports mstar_jax.models.a (type-only, line 7)"]
    assert layer_violations([down, up], layers) == wrong


MODEL_WORDS = re.compile(r"\b(tts|gemma\w*|talker|TTS\w*)\b", re.IGNORECASE)


def test_the_engine_names_no_model():
    """`mstar_jax/engine/` serves any model: not even its docs name one of this package's models."""
    named = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "mstar_jax" / "engine").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MODEL_WORDS.search(line)
    ]
    assert not named, "the engine names a model:\n" + "\n".join(named)
