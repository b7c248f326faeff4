"""The streaming TTS model's weights on a `(data, model)` mesh, Megatron-style (docs/design.md §10).

Projections into attention heads or hidden units are column-parallel (their outputs split on `model`):
`wq`, `wk`, `wv`, `gate`, `up`, `mlp_in`. Projections back to the model width are row-parallel (their
inputs split): `wo`, `down`, `mlp_out`, so XLA adds one all-reduce over `model` after each attention and
each MLP block; that all-reduce belongs to the model, never to the cache or the kernel. Key and value
projections stay whole where the KV heads are fewer than the model shards (the cache then holds copies
of heads, see `sharding.sharded_attend`). Everything else (embeddings, norms, heads, the flow's
input and output layers, the vocoder) is replicated; every weight is replicated over `data`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.resources.kv.bounded.sharding import MODEL

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "param_shardings"]

COLUMN_PARALLEL = ("wq", "wk", "wv", "gate", "up", "mlp_in")
ROW_PARALLEL = ("wo", "down", "mlp_out")


def param_shardings(params: Any, mesh: Mesh, *, kv_heads: int) -> Any:
    """A pytree of `NamedSharding`s for `params` (a talker's or a flow's `nnx.State`) on `mesh`.

    Args:
      params: the weights (arrays or `ShapeDtypeStruct`s).
      mesh: axes `data` and `model`.
      kv_heads: the KV heads of the attention these weights feed; `wk`/`wv` are split only when the
        model shards divide them.
    """
    model = mesh.shape[MODEL]

    def spec(path, leaf) -> NamedSharding:
        names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        layer = names[names.index("kernel") - 1] if "kernel" in names else None
        if layer in ("wk", "wv") and kv_heads % model:
            return NamedSharding(mesh, P())
        if layer in COLUMN_PARALLEL:
            return NamedSharding(mesh, P(None, MODEL))
        if layer in ROW_PARALLEL:
            return NamedSharding(mesh, P(MODEL, None))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(spec, params)
