"""Parts that compose: a class reads only the attributes it defines or is given (docs/STYLE: "a class
reads only the attributes it defines or is given").

Every class of `mstar_jax` and `kernels_pallas` is walked with `ast`: each `self.x` a method reads must
be defined by the class or a class in its MRO (a method, a class attribute or annotation, a dataclass
field, `self.x = ...` or `object.__setattr__(self, "x", ...)` in any of its methods; for a base outside
the library, whatever its source assigns or `dir()` lists). A mixin that reads state another class
defines fails, naming the file, line, method and attribute.

`ALLOWED` would list a class let off while it is being taken apart (none is); the test fails when one
no longer needs its entry too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import textwrap

import pytest

from tests import extras

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("mstar_jax", "kernels_pallas")

ALLOWED: frozenset[str] = frozenset()
"""Classes that may still read state they are not given (fully qualified names)."""


def _self(fn: ast.FunctionDef) -> str | None:
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else None


def _methods(node: ast.ClassDef) -> list[ast.FunctionDef]:
    return [item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)]


def defined_by(node: ast.ClassDef) -> set[str]:
    """Attribute names a class body defines: its methods, class attributes, annotations, and what its
    methods assign to `self` (directly or through `object.__setattr__`)."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names |= {n.id for target in item.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for fn in _methods(node):
        me = _self(fn)
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store | ast.Del):
                if isinstance(n.value, ast.Name) and n.value.id == me:
                    names.add(n.attr)
            elif (
                isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__setattr__"
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
            ):  # fmt: skip
                names.add(n.args[1].value)
    return names


def reads_of(node: ast.ClassDef) -> list[tuple[str, str, int]]:
    """`(method, attribute, line)` for every `self.attribute` a method of the class reads."""
    found = []
    for fn in _methods(node):
        if any(getattr(d, "id", None) in ("staticmethod", "classmethod") for d in fn.decorator_list):
            continue
        me = _self(fn)
        for n in ast.walk(fn):
            if (
                isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                and isinstance(n.value, ast.Name) and n.value.id == me
            ):  # fmt: skip
                found.append((fn.name, n.attr, n.lineno))
    return found


def _class_node(cls: type) -> ast.ClassDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.ClassDef) else None


def available(cls: type) -> set[str]:
    """What an instance of `cls` may read: every class in its MRO's definitions, and `dir()` of each."""
    names: set[str] = set()
    for base in inspect.getmro(cls):
        names |= set(dir(base))
        node = _class_node(base)
        if node is not None:
            names |= defined_by(node)
    return names


def violations(cls: type) -> list[str]:
    node = _class_node(cls)
    if node is None:
        return []
    allowed = available(cls)
    lines = inspect.getsourcelines(cls)[1] - 1
    path = pathlib.Path(inspect.getsourcefile(cls)).relative_to(ROOT)
    return [
        f"{path}:{lines + line} {cls.__qualname__}.{method} reads self.{attr}, which neither it nor a class "
        "in its MRO defines, and which it is not given"
        for method, attr, line in reads_of(node)
        if attr not in allowed
    ]


EXTRA_MODULES = frozenset(module.split(".")[0] for _, modules in extras.EXTRAS.values() for module in modules)


def library_classes(*, need_extras: bool) -> list[type]:
    """The library's classes: those of every module (`need_extras`), or of every module that imports
    without an extra, where a module needing an absent extra is passed over."""
    classes = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as err:
                if need_extras or (err.name or "").split(".")[0] not in EXTRA_MODULES:
                    raise
                continue  # the test marked with every extra walks it
            classes += [
                obj for obj in vars(module).values() if inspect.isclass(obj) and obj.__module__ == name
            ]
    return classes


@pytest.mark.parametrize(
    "need_extras", [False, pytest.param(True, marks=[getattr(pytest.mark, extra) for extra in extras.EXTRAS])]
)
def test_every_class_reads_only_what_it_defines_or_is_given(need_extras):
    classes = library_classes(need_extras=need_extras)
    found = {f"{cls.__module__}.{cls.__qualname__}": violations(cls) for cls in classes}
    unexpected = [line for name, lines in found.items() if name not in ALLOWED for line in lines]
    assert not unexpected, "\n".join(unexpected)
    paid = sorted(name for name in ALLOWED if not found.get(name))
    assert not paid, f"{paid} no longer read state they are not given: remove them from ALLOWED"


def test_the_walk_catches_a_mixin_and_accepts_a_part(tmp_path):
    mixin = ast.parse(
        textwrap.dedent(
            """
            class Counting:
                def bump(self):
                    self.counters["steps"] += 1   # defined by the class this is mixed into
                    return self.total

                @property
                def total(self):
                    return 0
            """
        )
    ).body[0]
    part = ast.parse(
        textwrap.dedent(
            """
            class Counting:
                def __init__(self, counters):
                    self._counters = counters

                def bump(self):
                    self._counters["steps"] += 1
            """
        )
    ).body[0]
    read = lambda node: {attr for _, attr, _ in reads_of(node)} - defined_by(node)  # noqa: E731
    assert read(mixin) == {"counters"}
    assert read(part) == set()
