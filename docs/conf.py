"""Sphinx configuration of the mstar-jax documentation: the guides and docs/design.md (Markdown, read by
myst-parser) and the API reference built from the docstrings (docs/api, reST).

Build it as CI does (tests/test_docs.py), warnings as errors:
python -m sphinx -W --keep-going -b html docs docs/_build

The hooks at the end use three Sphinx internals (napoleon's docstring handler, the event listener table,
the class autodoc is documenting); the `docs` extra pins the Sphinx major they were written against.
"""

import dataclasses
import functools
import inspect
import os
import sys

import sphinx.ext.napoleon as napoleon

# Every documented module imports jax; building the docs must not probe for an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import mstar_jax

project = "mstar-jax"
author = "mstar-jax contributors"
release = version = mstar_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

exclude_patterns = ["_build"]

# The guides are Markdown that reads the same on GitHub: links between pages are relative `.md` paths,
# and `page.md#a-heading` reaches a heading by its GitHub slug (`#7-bucketed-compilation`), which myst
# generates for headings down to `###`. A link that resolves to nothing is a warning, so an error here.
myst_heading_anchors = 3

# Google-style docstrings only (STYLE.md); types come from the annotations, shown in the signatures,
# and `Attributes:` entries take theirs from the class's annotations.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_attr_annotations = True

# A module's members are the names in its __all__ (re-exports included), in source order; undocumented
# ones are listed too, so the page shows the whole public surface.
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
# The server's web stack (the `serve` extra) is mocked: the docs extra alone builds the site.
autodoc_mock_imports = ["fastapi", "starlette", "uvicorn", "prometheus_client"]
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
# Defaults as written in the source (`num_sources=DEFAULT_NUM_SOURCES`), not as their values.
autodoc_preserve_defaults = True

# Long signatures (attend, sink_window_attention) read better one parameter a line.
python_maximum_signature_line_length = 100

# Docstrings name code in single backticks (`attend`, `max_slots`): as `py:obj` references they link where
# they name a documented object and render as code where they do not.
default_role = "py:obj"

html_theme = "alabaster"
html_title = f"mstar-jax {release}"
html_theme_options = {"description": "The resource layer of a streaming inference engine, in JAX."}


_ATTRIBUTE_ENTRIES: dict[type, frozenset[str]] = {}


def _attribute_entries(app, cls):
    """The names a class docstring's `Attributes:` section describes (napoleon's `.. attribute::` entries)."""
    if cls not in _ATTRIBUTE_ENTRIES:
        docstring = inspect.getdoc(cls) or ""
        parsed = napoleon.GoogleDocstring(docstring, app.config, app, "class", cls.__qualname__, cls)
        names = set()
        for line in parsed.lines():
            if line.startswith(".. attribute:: "):
                names.update(line.removeprefix(".. attribute:: ").split(", "))  # "a, b: ..." names both
        _ATTRIBUTE_ENTRIES[cls] = frozenset(names)
    return _ATTRIBUTE_ENTRIES[cls]


def _skip_described_members(app, what, name, obj, skip, options):
    """Leave out of a class's members what the class itself describes: a dataclass field (a parameter of the
    class signature) and an undocumented member its `Attributes:` section names. As members too they
    would be described twice, and an `Attributes:` entry beside a member of the same name is a duplicate
    object description. A member with a docstring of its own is kept: the duplicate then is in the source.
    """
    if what not in ("class", "exception"):
        return None
    # The event does not say whose member this is; autodoc keeps the class it is documenting here.
    document = app.env.current_document
    cls = sys.modules.get(document.autodoc_module or "")
    for part in (document.autodoc_class or "").split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        return None
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if name in fields:
        return True
    routine = inspect.isroutine(obj) or isinstance(obj, (property, functools.cached_property))
    if name in _attribute_entries(app, cls) and not (routine and obj.__doc__):
        return True
    return None


def _process_docstring(app, what, name, obj, options, lines):
    """Napoleon, reading a property's, attribute's or constant's docstring as it reads a method's.

    Napoleon takes the first line of those as Google style's inline `type: description`, so a summary
    such as "Entries a slot's ring holds: the largest window ..." would render as a type. Types here come
    from annotations (`napoleon_attr_annotations`), never from the docstring, so the colon is prose.
    """
    kind = "method" if what in ("property", "attribute", "data") else what
    napoleon._process_docstring(app, kind, name, obj, options, lines)


def _readable_defaults(app, what, name, obj, options, signature, return_annotation):
    """Write a dataclass's defaults that have no Python repr as Python: a `default_factory` as its call
    (`dict()`, `CompileSettings()`), a class or function as its dotted name (`jax.numpy.float32`).

    `inspect` shows them as `<factory>` or `<class '...'>`, which the signature parser cannot read: it
    gives up on the whole signature and splits it at every comma, those inside types too.
    """
    if what not in ("class", "exception") or not signature or "=" not in signature:
        return None
    if not dataclasses.is_dataclass(obj):
        return None
    factories = {field.name: field.default_factory for field in dataclasses.fields(obj)}
    for parameter in inspect.signature(obj).parameters.values():
        shown = repr(parameter.default)
        if not shown.startswith("<") or f"= {shown}" not in signature:
            continue
        value = factories[parameter.name] if shown == "<factory>" else parameter.default
        dotted = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        if not dotted.replace(".", "").isidentifier():
            python = "..."
        elif shown == "<factory>":
            python = f"{value.__qualname__}()"  # its class is the annotation, shown just before
        else:
            python = dotted
        signature = signature.replace(f"= {shown}", f"= {python}", 1)
    return signature, return_annotation


def setup(app):
    # In place of napoleon's own handler, which `_process_docstring` calls.
    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is napoleon._process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", _process_docstring)
    app.connect("autodoc-skip-member", _skip_described_members)
    app.connect("autodoc-process-signature", _readable_defaults)
