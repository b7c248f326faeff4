"""The checks of scalar arguments and settings that every layer makes: ints, numbers, bools, choices.

A leaf module (it imports nothing from `mstar_jax`), so settings, resources, compile and the models can
all use it. Each check names the field and the value it refuses and says what is allowed, in one
phrasing everywhere: `max_slots=0 must be an int >= 1`, `hold_backoff_s=nan must be a finite number
>= 0.0`, `pipelined=1 must be a bool`, `group='other' must be one of ['rows', 'decode', 'prefill']`.
A bool is never an int or a number here (it is one by accident of Python's types).

The checks look at Python values only: a frozen dataclass's `__post_init__` runs again under `jit` on
unflatten, with tracers in its array fields, so it checks its static fields and nothing else.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from typing import Any

import numpy as np

__all__ = ["INT32_MAX", "brief", "check_bool", "check_choice", "check_int", "check_number", "is_int"]


INT32_MAX = 2**31 - 1
"""The largest count or length a setting may give where a program holds it as int32 (positions, token
counts, loop trip counts): past it a program overflows instead of refusing."""


_SHOWN = 60


def brief(value: Any) -> str:
    """`repr(value)`, cut to 60 characters: a refusal names the value without echoing a megabyte.

    Lists, tuples, dicts and sets are written item by item only until the 60 characters are there, so
    a huge value costs what a small one does: a YAML alias bomb (each level nine references to the one
    below) is billions of items to `repr` whole.
    """
    parts: list[str] = []
    try:
        _write(value, parts, [_SHOWN + 1], set())
    except _EnoughError:
        pass
    except ValueError:  # an int past Python's digit limit for str() (or a container holding one)
        if isinstance(value, int):
            return f"<an int of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} too long to show>"
    text = "".join(parts)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


class _EnoughError(Exception):
    """`brief` has more text than it shows: stop writing."""


# The builtin containers `_write` spells out as their `repr` does (exact types: a subclass may have its
# own `__repr__`): (opening, closing, what repr shows for one inside itself).
_CONTAINERS = {
    list: ("[", "]", "[...]"),
    tuple: ("(", ")", "(...)"),
    dict: ("{", "}", "{...}"),
    set: ("{", "}", "set(...)"),
    frozenset: ("frozenset({", "})", "frozenset(...)"),
}


def _write(value: Any, parts: list[str], room: list[int], active: set[int]) -> None:
    """Append `repr(value)` to `parts` piece by piece, raising `_EnoughError` once `room[0]` characters are
    used up; `active` holds the ids of the containers being written (a container inside itself)."""
    kind = type(value)
    if kind not in _CONTAINERS or not value:
        _put(repr(value), parts, room)
        return
    opening, closing, inside_itself = _CONTAINERS[kind]
    if id(value) in active:
        _put(inside_itself, parts, room)
        return
    active.add(id(value))
    _put(opening, parts, room)
    for i, item in enumerate(value.items() if kind is dict else value):
        if i:
            _put(", ", parts, room)
        if kind is dict:
            _write(item[0], parts, room, active)
            _put(": ", parts, room)
            item = item[1]
        _write(item, parts, room, active)
    active.discard(id(value))
    _put(",)" if kind is tuple and len(value) == 1 else closing, parts, room)


def _put(text: str, parts: list[str], room: list[int]) -> None:
    parts.append(text)
    room[0] -= len(text)
    if room[0] < 0:
        raise _EnoughError


def is_int(value: Any, *, numpy: bool = False) -> bool:
    """Whether `value` is an int and not a bool; with `numpy`, a NumPy integer scalar counts too."""
    return isinstance(value, (int, np.integer) if numpy else int) and not isinstance(value, bool)


def _int_range(minimum: int | None, maximum: int | None, below: int | None) -> str:
    if maximum is not None and below is not None:
        raise TypeError("give check_int at most one of maximum= and below=")
    if minimum is not None and (maximum is not None or below is not None):
        return f" in [{minimum}, {maximum}]" if maximum is not None else f" in [{minimum}, {below})"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return f" < {below}" if below is not None else ""


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    below: int | None = None,
    allow_none: bool = False,
    numpy: bool = False,
    type_error: bool = False,
) -> int | None:
    """`value` as an int, refused unless it is an int (not a bool) within the bounds given.

    Args:
      name: the field, as the message names it (`max_slots`, `BucketKey.bs`, `token_counts[1]`).
      minimum, maximum: inclusive bounds; `below`: an exclusive upper bound (one of `maximum`, `below`).
      allow_none: None passes (and is returned); the message then says "None or an int ...".
      numpy: NumPy integer scalars pass too (returned as Python ints).
      type_error: a value that is not an int raises TypeError, the message naming its type
        (`..., got float`); one out of bounds still raises ValueError.

    Raises:
      ValueError: `name=value must be an int >= minimum` (`in [minimum, maximum]`, `in [minimum,
        below)`, `None or an int ...`), for a value of the wrong type or out of bounds.
    """
    if value is None and allow_none:
        return None
    allowed = f"{'None or ' if allow_none else ''}an int{_int_range(minimum, maximum, below)}"
    if not is_int(value, numpy=numpy):
        if type_error:
            raise TypeError(f"{name}={brief(value)} must be {allowed}, got {type(value).__name__}")
        raise ValueError(f"{name}={brief(value)} must be {allowed}")
    if (
        (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (below is not None and value >= below)
    ):
        raise ValueError(f"{name}={brief(value)} must be {allowed}")
    return int(value)


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_FLOAT_MAX = sys.float_info.max


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float,
    maximum: float | None = None,
    exclusive: bool = False,
    finite: bool = True,
    allow_none: bool = False,
    note: str | None = None,
) -> float | None:
    """`value` as a float, refused unless it is an int or a float (not a bool) `>= minimum`
    (`> minimum` when `exclusive`) and `<= maximum` if one is given, and finite (neither NaN nor
    infinite) unless `finite` is False.

    A string that parses as a number (`'1e-3'`: YAML 1.1 reads an exponent without a dot or a sign as
    a string) is refused with a hint on writing it as a number. `note`, when given, follows the bound
    in parentheses (`temperature=-0.5 must be a finite number >= 0 (0: greedy)`); `allow_none` lets
    None pass (and says "None or a number ...").

    Raises:
      ValueError: `name=value must be a number >= minimum` for a value that is not a number;
        `name=value must be a finite number >= minimum` (`a number` when not `finite`) for one out
        of bounds, NaN or infinite.
    """
    if value is None and allow_none:
        return None
    either = "None or " if allow_none else ""
    bound = f"{'>' if exclusive else '>='} {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if exclusive and maximum is not None:
        bound = f"in ({minimum}, {maximum}]"
    bound += f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        hint = ""
        if isinstance(value, str) and _parses_as_float(value):
            shown = brief(value)
            hint = (
                f" (YAML reads {shown} as a string: write it with a dot and a signed exponent, e.g. 1.0e-3)"
            )
        raise ValueError(f"{name}={brief(value)} must be {either}a number {bound}{hint}")
    number = value
    if isinstance(value, int) and abs(value) > _FLOAT_MAX:  # float(value) would overflow
        number = math.inf if value > 0 else -math.inf
    if (
        (finite and not math.isfinite(number))
        or math.isnan(number)
        or number < minimum
        or (exclusive and number == minimum)
        or (maximum is not None and number > maximum)
    ):
        finiteness = "finite " if finite else ""
        raise ValueError(f"{name}={brief(value)} must be {either}a {finiteness}number {bound}")
    return float(number)


def check_bool(name: str, value: Any) -> bool:
    """`value`, refused unless it is a bool (1, 'yes' and None are not).

    Raises:
      ValueError: `name=value must be a bool`.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name}={brief(value)} must be a bool")
    return value


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """`value`, refused unless it is one of `choices`, of the same type as it (so True is not 1, and
    an unhashable value or an array is refused, not compared).

    Raises:
      ValueError: `name=value must be one of [choices]`, the choices listed in their given order.
    """
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise ValueError(f"{name}={brief(value)} must be one of {list(choices)}")
    return value
