"""Abstract arguments for ahead-of-time capture: a model's arrays as `jax.ShapeDtypeStruct`s."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["abstract", "shaped"]


def abstract(tree: Any, *, sharded: bool = False) -> Any:
    """`tree`'s arrays as `ShapeDtypeStruct`s (weights, caches, banks), each keeping its array's sharding
    when `sharded` (a mesh's arrays); nothing is allocated or copied."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if sharded else None), tree
    )


def shaped(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """One abstract input of a bucket (a step's rows, tokens, seeds), placed by `sharding` if given."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
