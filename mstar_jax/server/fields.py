"""A request body read within its limit and its fields checked, each refusal a `BadRequestError` that
names the field, the value and what is allowed (the phrasing of `mstar_jax.checks`), before the engine
sees anything.

Fields the server does not know are ignored, as OpenAI's clients send some a server may not use.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from mstar_jax.checks import brief, check_choice, check_int, check_number
from mstar_jax.server.errors import BadRequestError, PayloadTooLargeError

__all__ = ["Body", "check_text", "parse_json", "read_body"]

_MISSING = object()


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body of a Starlette `request`, refused past `max_bytes` (a `Content-Length` over it is
    refused before anything is read).

    Raises:
      PayloadTooLargeError: a body over `max_bytes`.
    """
    declared = request.headers.get("content-length")
    too_large = f"the request body is over max_body_bytes={max_bytes}"
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(f"{too_large} (Content-Length: {declared})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(too_large)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes | str) -> Body:
    """A JSON object's fields.

    Raises:
      BadRequestError: for a body that is not JSON, or not a JSON object.
    """
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as error:  # bad JSON, bad UTF-8, a 5,000-digit int, deep nesting
        raise BadRequestError(
            f"the body is not valid JSON: {str(error)[:200]}", code="invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise BadRequestError(
            f"the body must be a JSON object of fields, got {type(value).__name__}", code="invalid_json"
        )
    return Body(value)


def _refuse(name: str, error: ValueError) -> BadRequestError:
    return BadRequestError(str(error), param=name, code="invalid_value")


def check_text(name: str, value: str) -> str:
    """`value`, refused if it is not Unicode text: JSON's `"\\ud800"` parses to a lone surrogate,
    which has no UTF-8 bytes and no tokens.

    Raises:
      BadRequestError: naming `name`, the value and the surrogate's offset.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        at = error.start
        raise BadRequestError(
            f"{name}={brief(value)} has a lone surrogate {value[at]!r} at offset {at}; it must be "
            "valid Unicode (UTF-8 encodable)",
            param=name, code="invalid_value",
        ) from None  # fmt: skip
    return value


class Body:
    """A JSON object's fields, read by type; JSON `null` is the same as absent."""

    def __init__(self, fields: dict[str, Any]):
        self.fields = fields

    def _get(self, name: str, default: Any) -> Any:
        value = self.fields.get(name)
        if value is None:
            if default is _MISSING:
                raise BadRequestError(f"{name} is required", param=name, code="missing_field")
            return default
        return value

    def string(self, name: str, *, default: Any = _MISSING, empty: bool = False) -> str:
        value = self._get(name, default)
        if value is default:
            return value
        if not isinstance(value, str):
            raise _refuse(name, ValueError(f"{name}={brief(value)} must be a string"))
        if not value and not empty:
            raise _refuse(name, ValueError(f"{name}='' must be a non-empty string"))
        return check_text(name, value)

    def choice(self, name: str, choices: Collection[str], *, default: Any = _MISSING) -> str:
        value = self._get(name, default)
        try:
            return check_choice(name, value, choices)
        except ValueError as error:
            raise _refuse(name, error) from None

    def integer(self, name: str, *, minimum: int, maximum: int | None = None, default: Any = _MISSING) -> int:
        value = self._get(name, default)
        try:
            return check_int(name, value, minimum=minimum, maximum=maximum)
        except ValueError as error:
            raise _refuse(name, error) from None

    def number(self, name: str, *, minimum: float, maximum: float, default: Any = _MISSING) -> float:
        value = self._get(name, default)
        try:
            return check_number(name, value, minimum=minimum, maximum=maximum)
        except ValueError as error:
            raise _refuse(name, error) from None

    def boolean(self, name: str, *, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise _refuse(name, ValueError(f"{name}={brief(value)} must be a bool"))
        return value

    def strings(self, name: str, *, most: int, longest: int) -> tuple[str, ...]:
        """A string or a list of at most `most` non-empty strings of at most `longest` characters each
        (OpenAI's `stop`: matching one costs its length on every token); none when absent."""
        value = self._get(name, ())
        values = [value] if isinstance(value, str) else value
        if (
            not isinstance(values, list | tuple)
            or len(values) > most
            or not all(isinstance(v, str) and 0 < len(v) <= longest for v in values)
        ):
            raise _refuse(
                name,
                ValueError(
                    f"{name}={brief(value)} must be a non-empty string or a list of at most {most}, each "
                    f"of at most {longest} characters"
                ),
            )
        return tuple(check_text(name, v) for v in values)
