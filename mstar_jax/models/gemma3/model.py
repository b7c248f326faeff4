"""Gemma 3 in Flax NNX, its attention on two bounded KV caches.

Gemma 3 interleaves five local layers (sliding-window attention over the last 512 positions, RoPE base
10,000) with one global layer (every earlier position, RoPE base 1,000,000). Here each kind of layer
reads and writes its own bounded cache (`mstar_jax.resources.kv.bounded`):

- local layers: `SinkWindow(0, window - 1)` with `query_window = window`: a query at position i sees
  keys j with 0 <= i - j < window, exactly Gemma's sliding window, in decode steps and prefill chunks
  alike (the band reaches into the retained ring and across the chunk, causally);
- global layers: any `SinkWindow(sink, w)` the user picks with `query_window = w + 1`: `w` at least the
  stream's length is the dense model; smaller ones are the bounded variants StreamingLLM studies
  (window only, or sinks + window).

The block: RMSNorm before and after attention and before and after the MLP (sandwich norms), RMSNorm on
each head's queries and keys (QK-norm), RoPE at absolute stream positions, a GeGLU MLP with tanh GELU,
embeddings scaled by sqrt(d_model), the output projection tied to the embedding. Norm weights are used
as stored (`x * w`): the GGUF conversion stores Gemma's `1 + w` already (see `gguf.py`).

The tied embedding is held transposed, `[E, V]`, in the output projection's layout: a decode step's
logits are a matrix-vector product over all 262,144 words, the largest read of the step (671 MB in
float32, more than every layer together). Alone, XLA:CPU streamed `h @ W[E, V]` faster than
`W[V, E] @ h` on a 2-core AMD EPYC (25 against 45 ms in one run, 19.6 against 22.3 ms in another);
within a whole decode step the two layouts were within that host's noise (an A/B: `[V, E]` at 1.019
(0.898–1.179) of `[E, V]`, docs/guides/gemma3.md). The lookup then gathers a column per token, 640
scattered reads (40 KB of cache lines), nothing beside the projection.

Shape legend: B requests, T step tokens, E d_model, H query heads, G K/V heads, D head dim, F MLP width,
V vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mstar_jax.models.gemma3.gguf import Gemma3Config
from mstar_jax.models.norm import RMSNorm
from mstar_jax.models.rope import apply_rope

__all__ = ["AttendFn", "Gemma3", "Gemma3Block", "Linear", "abstract_model", "check_tensors"]

ModuleList = getattr(nnx, "List", list)
"""A list of submodules: `nnx.List` where Flax has it (>= 0.12 requires it), a plain list before."""

AttendFn = Callable[[object, bool, int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]
"""`(state, is_global, index, q [B, T, H, D], k [B, T, G, D], v) -> (out [B, T, H, D], state)`: how a
layer's queries meet their keys; `index` counts layers of its kind (local or global) from 0."""


# A parameter's path (its attribute names) -> (its GGUF tensor names, whether to transpose): GGUF and
# PyTorch hold a linear weight as [out, in], as `Linear` does; several names are concatenated along `out`
# (one matrix-vector product instead of three or two). Block tensors are `blk.{i}.` + a name.
_GGUF_NAMES = {
    ("embed_t",): (("token_embd.weight",), True),
    ("norm", "scale"): (("output_norm.weight",), False),
    **{
        ("blocks", attr, "scale"): ((f"{name}.weight",), False)
        for attr, name in (
            ("attn_norm", "attn_norm"), ("post_attn_norm", "post_attention_norm"), ("q_norm", "attn_q_norm"),
            ("k_norm", "attn_k_norm"), ("mlp_norm", "ffn_norm"), ("post_mlp_norm", "post_ffw_norm"),
        )
    },
    **{
        ("blocks", attr, "weight"): (tuple(f"{name}.weight" for name in names), False)
        for attr, names in (
            ("wqkv", ("attn_q", "attn_k", "attn_v")), ("wo", ("attn_output",)),
            ("gate_up", ("ffn_gate", "ffn_up")), ("down", ("ffn_down",)),
        )
    },
}  # fmt: skip


def _file_tensors(path: Any, leaf: Any) -> tuple[tuple[str, ...], bool, tuple[int, ...]]:
    """A parameter's GGUF tensors (stacked on their first axis), whether they are its transpose, and
    the shape they make together, in the file's layout."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    names, transpose = _GGUF_NAMES[tuple(k for k in keys if isinstance(k, str))]
    if keys[0] == "blocks":
        names = tuple(f"blk.{keys[1]}.{name}" for name in names)
    return names, transpose, tuple(leaf.shape[::-1] if transpose else leaf.shape)


def check_tensors(config: Gemma3Config, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse a file's tensors (name -> shape, PyTorch layout: `gguf.tensor_shapes`) that are not the
    model's of `config`, before any is read.

    Raises:
      ValueError: naming a tensor the config needs that is missing, or one of another shape.
    """
    _, abstract = abstract_model(config)

    def check(path, leaf):
        names, _, want = _file_tensors(path, leaf)
        missing = [name for name in names if name not in shapes]
        if missing:
            raise ValueError(f"tensor {missing[0]!r} is missing; a model of this config needs it")
        got = [tuple(shapes[name]) for name in names]
        if any(shape[1:] != want[1:] for shape in got) or sum(shape[0] for shape in got) != want[0]:
            if len(names) == 1:
                raise ValueError(f"tensor {names[0]!r} has shape {got[0]}; the config needs {want}")
            raise ValueError(f"tensors {names} have shapes {got}; the config needs {want} between them")

    jax.tree_util.tree_map_with_path(check, abstract)


def abstract_model(config: Gemma3Config, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters as `ShapeDtypeStruct`s (nothing is allocated); treat both
    as read-only.

    Cached per geometry and dtype: `nnx.eval_shape` of the 270M model takes about a second on a 2-core
    CPU, and one deployment asks for it up to four times (its caches' specs, its memory budget, the
    file's check and the load).
    """
    return _abstract_model(Gemma3, config, jnp.dtype(dtype))


@functools.lru_cache(maxsize=8)
def _abstract_model(cls: type, config: Gemma3Config, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0))))


class Linear(nnx.Module):
    """`x [..., I] -> [..., O]` without bias, the weight held `[O, I]` (as GGUF and PyTorch hold it).

    A decode step's products are matrix-vector ones, bound by reading the weight; each output is then
    the product of x with one contiguous row. On a 2-core AMD EPYC a whole decode step ran 1.03-1.07
    times as fast with every projection so held as with the wide ones held `[I, O]` (see the Gemma 3
    guide); `benchmarks/matvec_layouts.py` times both layouts of each projection alone. It is an
    `einsum`, not `x @ W.T`: for one row XLA:CPU emits the latter as a loop fusion instead of a library
    product, and a decode step so written ran at 0.86 of this one (an A/B in the guide).
    """

    def __init__(self, features_in: int, features_out: int, *, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
        self.weight = nnx.Param(init(rngs.params(), (features_out, features_in), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...])


class Gemma3Block(nnx.Module):
    """One decoder layer: QK-normed GQA attention with RoPE and a GeGLU MLP, sandwich-normed."""

    def __init__(self, config: Gemma3Config, *, is_global: bool, dtype, rngs: nnx.Rngs):
        c = config
        self.is_global = is_global
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rope_base = c.rope_global_base if is_global else c.rope_local_base
        norm = lambda dim: RMSNorm(dim, epsilon=c.rms_eps, param_dtype=dtype, rngs=rngs)  # noqa: E731
        linear = lambda i, o: Linear(i, o, dtype=dtype, rngs=rngs)  # noqa: E731
        self.attn_norm, self.post_attn_norm = norm(c.d_model), norm(c.d_model)
        self.q_norm, self.k_norm = norm(c.head_dim), norm(c.head_dim)
        # Queries, keys and values in one matrix, gate and up in another: a decode step's products are
        # matrix-vector ones, bound by reading the weights, and XLA:CPU streams one wide matrix faster
        # than two or three narrow ones read in turn.
        self.wqkv = linear(c.d_model, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        self.wo = linear(c.num_heads * c.head_dim, c.d_model)
        self.mlp_norm, self.post_mlp_norm = norm(c.d_model), norm(c.d_model)
        self.gate_up = linear(c.d_model, 2 * c.ffn_dim)
        self.down = linear(c.ffn_dim, c.d_model)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, E], positions i32[B, T] -> q [B, T, H, D], k and v [B, T, G, D] (q, k normed, rotated)."""
        b, t, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).reshape(b, t, self.heads + 2 * self.kv_heads, self.head_dim)
        q = self.q_norm(qkv[:, :, : self.heads])
        k = self.k_norm(qkv[:, :, self.heads : self.heads + self.kv_heads])
        v = qkv[:, :, self.heads + self.kv_heads :]
        rope = lambda y: apply_rope(y, positions, theta=self.rope_base)  # noqa: E731
        return rope(q), rope(k), v

    def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        """The attention's residual, then the MLP's: x [B, T, E], attended [B, T, H, D] -> [B, T, E]."""
        b, t, _ = x.shape
        x = x + self.post_attn_norm(self.wo(attended.reshape(b, t, -1).astype(x.dtype)))
        gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        mlp = self.down(jax.nn.gelu(gate, approximate=True) * up)
        return x + self.post_mlp_norm(mlp)


class Gemma3(nnx.Module):
    """Token ids in, hidden states and next-token logits out.

    Args:
      config: the geometry (`Gemma3Config`, e.g. from `load_gguf`).
      dtype: parameter and activation dtype (float32 or bfloat16).
      rngs: initialisation randomness (weights are usually replaced by `from_tensors`).
    """

    def __init__(self, config: Gemma3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_t = nnx.Param(jnp.zeros((config.d_model, config.vocab_size), dtype))
        self.blocks = ModuleList(
            [
                Gemma3Block(config, is_global=config.is_global(i), dtype=dtype, rngs=rngs)
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.d_model, epsilon=config.rms_eps, param_dtype=dtype, rngs=rngs)

    @classmethod
    def from_tensors(
        cls, config: Gemma3Config, tensors: Mapping[str, np.ndarray], *, dtype=jnp.float32
    ) -> Gemma3:
        """The model with the GGUF's weights (`load_gguf`'s tensors: names as in the file, PyTorch layout).

        Raises:
          ValueError: naming a tensor the file lacks, or one whose shape is not the config's
            (`check_tensors`).
        """
        check_tensors(config, {name: np.shape(tensor) for name, tensor in tensors.items()})
        graphdef, abstract = _abstract_model(cls, config, jnp.dtype(dtype))

        def load(path, leaf):
            names, transpose, _ = _file_tensors(path, leaf)
            parts = [np.asarray(tensors[name]) for name in names]
            array = np.concatenate(parts) if len(parts) > 1 else parts[0]
            return jnp.asarray(array.T if transpose else array, dtype)

        return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(load, abstract))

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, state: object, attend: AttendFn
    ) -> tuple[jax.Array, object]:
        """Run every layer over a step's tokens.

        Args:
          tokens: i32[B, T] token ids (padding may be any id: never attended).
          positions: i32[B, T] absolute stream positions (RoPE).
          state: threaded through `attend` (the two caches, or a collection of keys).
          attend: how each layer's queries meet their keys.

        Returns:
          (hidden [B, T, E] after the final norm, state).
        """
        table = self.embed_t[...]
        x = jnp.moveaxis(jnp.take(table, tokens, axis=1), 0, -1)  # [E, B, T] -> [B, T, E]
        x = x * jnp.asarray(math.sqrt(self.config.d_model), table.dtype)
        counts = {False: 0, True: 0}
        for block in self.blocks:
            q, k, v = block.project(x, positions)
            attended, state = attend(state, block.is_global, counts[block.is_global], q, k, v)
            counts[block.is_global] += 1
            x = block.finish(x, attended)
        return self.norm(x), state

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> f32[..., V] (the output projection is the tied embedding, held `[E, V]`)."""
        return jnp.einsum("...e,ev->...v", hidden, self.embed_t[...], preferred_element_type=jnp.float32)
