"""llama.cpp (through `llama_cpp`, the llama-cpp-python binding) as an independent Gemma 3 reference.

`llama_cpp` is imported lazily, inside `load`, so this module imports without it. Every function
below evaluates from an empty context (`llama.reset()` first): `Llama.eval` alone appends to what
the context already holds.

Numerics: on the shipped Q4_K_M file llama.cpp's CPU matmuls quantize the activations to 8 bits,
so its logits differ from a float implementation by more than rounding (up to ~1 logit), and even
depend on how many tokens one `eval` call decodes (chunks under 8 tokens take other kernels).
`write_float32_copy` writes the same weights dequantized to float32, for which ggml multiplies in
float32 throughout: the reference then differs from this library's float32 model by summation order
alone, and close calls are no longer lost to the reference's own rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import llama_cpp

__all__ = ["greedy", "load", "log_probs", "logits", "tokenize", "write_float32_copy"]

SEED = 1234
"""Fixed seed handed to `llama_cpp.Llama` (0 would mean random there; nothing here samples anyway)."""


def load(path: str | PathLike[str], n_ctx: int = 2048, n_threads: int = 2) -> llama_cpp.Llama:
    """A CPU `llama_cpp.Llama` for the GGUF at `path` that keeps the logits of every position.

    `logits_all=True` is required: without it `Llama.eval` stores no logits at all. Its score buffer is
    `n_ctx x vocab` float32 (2 GiB of address space for Gemma 3 at n_ctx=2048, touched only as used).
    Keys and values are cached in float32 (llama.cpp's default is float16, a rounding this library's
    float32 model does not make).
    """
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        n_gpu_layers=0,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        seed=SEED,
        verbose=False,
    )


def write_float32_copy(reader: Any, weights: Mapping[str, np.ndarray], path: str | PathLike[str]) -> None:
    """Write a GGUF at `path` with `reader`'s metadata and `weights` (its tensors, dequantized) as F32.

    Args:
      reader: a `gguf.GGUFReader` open on the original file.
      weights: every tensor of that file by name, float32 in NumPy (outermost-first) layout, as
        `mstar_jax.models.gemma3.load_gguf` returns them.
      path: where to write; about 4 bytes per parameter.
    """
    import gguf

    names = {tensor.name for tensor in reader.tensors}
    if set(weights) != names:
        differ = sorted(set(weights) ^ names)
        raise ValueError(f"weights must hold exactly the file's tensors; they differ in {differ}")
    writer = gguf.GGUFWriter(path, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for field in reader.fields.values():
        # The writer emits the header fields and the architecture itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:  # the file's order
        writer.add_tensor(tensor.name, np.ascontiguousarray(weights[tensor.name], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenize(llama: llama_cpp.Llama, text: str, add_bos: bool = True) -> list[int]:
    """llama.cpp's own token ids for `text` (UTF-8), BOS first iff `add_bos`; special tokens stay text."""
    return list(llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))


def _eval(llama: llama_cpp.Llama, tokens: Sequence[int]) -> None:
    """Clear the context and evaluate `tokens` from position 0."""
    if len(tokens) == 0:
        raise ValueError("no tokens to evaluate")
    if len(tokens) > llama.n_ctx():
        raise ValueError(f"{len(tokens)} tokens exceed n_ctx={llama.n_ctx()}")
    llama.reset()
    llama.eval([int(t) for t in tokens])


def logits(llama: llama_cpp.Llama, tokens: Sequence[int]) -> np.ndarray:
    """float32 [len(tokens), vocab]: row i is the next-token logits after tokens[: i + 1]."""
    _eval(llama, tokens)
    return np.array(llama.scores[: len(tokens)], dtype=np.float32, copy=True)


def log_probs(llama: llama_cpp.Llama, tokens: Sequence[int]) -> np.ndarray:
    """float64 [len(tokens) - 1]: entry i - 1 is log p(tokens[i] | tokens[:i]) for i = 1 .. len - 1.

    Log-softmax in float64 over the full vocabulary of the llama.cpp logits.
    """
    rows = logits(llama, tokens)[:-1].astype(np.float64)
    rows -= rows.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(rows).sum(axis=-1))
    targets = np.asarray(tokens[1:], dtype=np.int64)
    return rows[np.arange(len(targets)), targets] - lse


def greedy(llama: llama_cpp.Llama, tokens: Sequence[int], n: int, incremental: bool = True) -> list[int]:
    """The n tokens that follow `tokens` under plain argmax decoding (lowest id on ties).

    Reads the raw logits after each step (no sampler, so no temperature or repetition penalty) and
    does not stop at EOS. `incremental=True` feeds each chosen token back alone through the KV cache,
    as llama.cpp generation does; `incremental=False` re-evaluates the whole sequence each step, so
    every step agrees with `logits`. The two can differ: llama.cpp's CPU matmul kernels for batches
    under 8 tokens round differently from the batched ones (logits move by up to ~1).
    """
    _eval(llama, tokens)
    if len(tokens) + n - 1 > llama.n_ctx():
        raise ValueError(f"{len(tokens)} + {n} tokens exceed n_ctx={llama.n_ctx()}")
    seq = [int(t) for t in tokens]
    out: list[int] = []
    for step in range(n):
        nxt = int(np.argmax(llama.scores[llama.n_tokens - 1]))
        out.append(nxt)
        seq.append(nxt)
        if step + 1 < n:
            if incremental:
                llama.eval([nxt])
            else:
                _eval(llama, seq)
    return out
