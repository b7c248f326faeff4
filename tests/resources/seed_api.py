"""Helpers for the tests that hold our classes to the seed pages' field lists."""

import dataclasses

MISSING = dataclasses.MISSING


def fields_and_defaults(cls) -> list[tuple[str, object]]:
    """(name, default) of each positional field of a dataclass or NamedTuple; MISSING when required."""
    if hasattr(cls, "_fields"):  # NamedTuple
        return [(name, cls._field_defaults.get(name, MISSING)) for name in cls._fields]
    return [
        (f.name, f.default_factory if f.default_factory is not MISSING else f.default)
        for f in dataclasses.fields(cls)
    ]
