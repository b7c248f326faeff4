"""`gguf.GGUFReader` with its metadata arrays read in one pass (`FastGGUFReader`).

The stock reader parses each element of a metadata array by a recursive call that slices the file's
`np.memmap` four times, and every memmap slice runs NumPy's Python-level `__array_finalize__`. Gemma 3's
vocabulary is three arrays of 262,144 elements; parsing them took 23 s of a 24 s open on a 2-core CPU,
in every process that opens the file (a server start, each test worker).

`FastGGUFReader` builds the same fields: the same parts (dtype, shape and bytes), indices and types.
It slices a plain ndarray view of the same mapping, reads a string array with one `struct` loop, and
reads a scalar array as one view sliced per element. Any other field goes to the stock code: an array
of arrays, or an array that runs past the end of the file, which then fails as it always has.
`tests/models/gemma3/test_gguf.py` compares the two readers field by field.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

__all__ = ["FastGGUFReader"]

_ARRAY_HEADER = 12
"""An array value starts with its element type (u32) and length (u64)."""


class FastGGUFReader(GGUFReader):
    """A `gguf.GGUFReader` whose metadata arrays parse in one pass each (module doc)."""

    def _flat(self) -> np.ndarray:
        # Set on first use: the stock constructor reads the header before a subclass could set it.
        flat = self.__dict__.get("_flat_bytes")
        if flat is None:
            flat = self._flat_bytes = self.data.view(np.ndarray)
        return flat

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
        count, dtype = int(count), np.dtype(dtype)
        array = self._flat()[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return array.view(array.dtype.newbyteorder(override_order or self.byte_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if item_type.size == 0 or length.size == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        item, count, offset = int(item_type[0]), int(length[0]), orig_offs + _ARRAY_HEADER
        parsed = None
        if item == GGUFValueType.STRING:
            parsed = self._strings(offset, count)
        elif item in self.gguf_scalar_to_np:
            parsed = self._scalars(offset, count, GGUFValueType(item))
        if parsed is None:
            return super()._get_field_parts(orig_offs, raw_type)
        size, parts, first, stride = parsed
        # As the stock reader: the element type is listed only when there is an element.
        types = [GGUFValueType.ARRAY, GGUFValueType(item)] if count else [GGUFValueType.ARRAY]
        indices = list(range(2 + first, 2 + first + stride * count, stride))
        return _ARRAY_HEADER + size, [item_type, length, *parts], indices, types

    def _strings(self, offset: int, count: int) -> tuple[int, list, int, int] | None:
        """(bytes read, the parts: each string's u64 length and its bytes, the first data part, the
        stride), or None where a string runs past the end of the file."""
        flat, start = self._flat(), offset
        big_endian = (self.byte_order == "S") == (sys.byteorder == "little")  # "S": the host's opposite
        unpack = struct.Struct(">Q" if big_endian else "<Q").unpack_from
        u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
        u8 = np.dtype(np.uint8).newbyteorder(self.byte_order)
        parts: list[np.ndarray] = []
        append, end = parts.append, flat.size
        for _ in range(count):
            if offset + 8 > end:
                return None
            (length,) = unpack(flat, offset)
            if offset + 8 + length > end:
                return None
            append(flat[offset : offset + 8].view(u64))
            append(flat[offset + 8 : offset + 8 + length].view(u8))
            offset += 8 + length
        return offset - start, parts, 1, 2

    def _scalars(self, offset: int, count: int, item: GGUFValueType) -> tuple[int, list, int, int] | None:
        """As `_strings`, for numbers: one part per element, a one-element view of one array."""
        values = self._get(offset, self.gguf_scalar_to_np[item], count)
        if values.size < count:
            return None
        return values.nbytes, [values[i : i + 1] for i in range(count)], 0, 1
