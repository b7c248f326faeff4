"""The source bank of a bounded KV cache: registering, replacing and removing sources, and counting the
live requests that read each one (a source they read can be neither replaced nor removed).

`Sources` is the part of `BoundedKVManager` that owns the bank, given the manager's config, its stored
heads and its source lengths and reader counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from mstar_jax.checks import check_int
from mstar_jax.resources.kv.bounded.cache import SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig

__all__ = ["Sources"]


@partial(jax.jit, donate_argnums=0)
def _store_source(bank: SourceBank, index, k, v) -> SourceBank:
    """bank[:, index] = (k, v), per layer; k/v are [layers, R, G, L, D] padded to the bank length L."""
    return SourceBank(
        k=tuple(layer.at[index].set(new) for layer, new in zip(bank.k, k, strict=True)),
        v=tuple(layer.at[index].set(new) for layer, new in zip(bank.v, v, strict=True)),
    )


class Sources:
    """A bounded cache's source bank and what it holds.

    Args:
      config: the cache's config.
      stored_heads: KV heads each source stores (a copy of a head per model shard where there are fewer
        heads than shards).
      bank: the bank (`SourceBank.create`); `register` replaces it with the updated one.
      lengths: the manager's registered sources' lengths (updated in place).
      readers: the manager's live readers per source (read: a source in use is neither replaced nor
        removed).
    """

    def __init__(
        self,
        *,
        config: BoundedKVConfig,
        stored_heads: int,
        bank: SourceBank,
        lengths: dict[int, int],
        readers: Counter[int],
    ):
        self.bank = bank
        self._config, self._stored_heads, self._lengths, self._readers = (
            config,
            stored_heads,
            lengths,
            readers,
        )

    def register(self, index: int, k: Sequence[jax.Array], v: Sequence[jax.Array]) -> None:
        """Register (or replace) source `index`: per layer K and V of shape [R, G, length, D].

        Raises:
          ValueError: for a bad index, shapes or dtype, a NaN or infinite entry in k or v (every request
            reading the source would read it), a length outside [min_source_len, max_source_len], or
            replacing a source a live request reads (its stream would change under it).
        """
        cfg = self._config
        self.check_index(index)
        if self._readers[index]:
            raise ValueError(
                f"source {index} is read by {self._readers[index]} live request(s); "
                "remove them before replacing it"
            )
        k, v = _stack_source("k", k), _stack_source("v", v)
        expected = (cfg.num_layers, cfg.rows_per_request, cfg.num_heads)
        if k.shape != v.shape or k.ndim != 5 or k.shape[:3] != expected or k.shape[4] != cfg.head_dim:
            raise ValueError(
                f"source k/v shapes {k.shape}/{v.shape} must both be [layers={cfg.num_layers}] x "
                f"[rows={cfg.rows_per_request}, kv_heads={cfg.num_heads}, length, head_dim={cfg.head_dim}]"
            )
        length = k.shape[3]
        if not cfg.min_source_len <= length <= cfg.max_source_len:
            raise ValueError(
                f"source length {length} is outside [min_source_len={cfg.min_source_len}, "
                f"max_source_len={cfg.max_source_len}]"
            )
        k, v = (_finite(index, name, x, cfg.dtype) for name, x in (("k", k), ("v", v)))
        pad = [(0, 0)] * 3 + [(0, self.bank.k[0].shape[3] - length), (0, 0)]
        copies = self._stored_heads // cfg.num_heads  # head j of the store is head j // copies
        k, v = (np.repeat(np.pad(x, pad), copies, axis=2) for x in (k, v))
        self.bank = _store_source(self.bank, np.int32(index), k, v)
        self._lengths[index] = length

    def remove(self, index: int) -> None:
        """Forget source `index`. Raises ValueError if it is unknown or a live request reads it."""
        self.check_index(index)
        if index not in self._lengths:
            raise ValueError(f"source {index} is not registered; registered: {sorted(self._lengths)}")
        if self._readers[index]:
            raise ValueError(
                f"source {index} is read by {self._readers[index]} live request(s); cannot remove it"
            )
        del self._lengths[index]

    def check_index(self, index: int) -> None:
        check_int("source index", index, minimum=0, below=self.bank.num_sources)


def _finite(index: int, name: str, x: np.ndarray, dtype) -> np.ndarray:
    """`x` (source `index`'s `name`, "k" or "v") cast to the cache's `dtype`, refused where an entry is
    NaN or infinite, or becomes infinite in `dtype` (too large for it).

    A source is registered rarely and read by every request of its voice: one NaN there would turn
    every such request's attention to NaN, so every entry is checked, on the host copy `_stack_source`
    made.

    Raises:
      ValueError: naming the source, `name`, how many entries are bad and the first one.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
        cast = x.astype(dtype)
    for values, what in ((x, "is not finite"), (cast, f"overflows {np.dtype(dtype).name}")):
        bad = ~np.isfinite(values)
        if not bad.any():
            continue
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        nans = int(np.isnan(values).sum())
        raise ValueError(
            f"source {index} {name} {what}: {nans} NaN and {int(bad.sum()) - nans} infinite of its "
            f"{values.size} entries, the first {name}[{first[0]}]{list(first[1:])} = {x[first]!r} "
            f"([layer][row, kv_head, position, dim]); every request reading source {index} would attend to "
            "it, so register finite keys and values"
        )
    return cast


def _stack_source(name: str, layers) -> np.ndarray:
    """Per-layer source arrays stacked into one [layers, R, G, length, D] array of real numbers.

    Raises:
      ValueError: naming `name` ("k" or "v"), for no layers, layers of different shapes or a dtype that
        is not a float or an int.
    """
    try:
        arrays = [np.asarray(x) for x in layers]
    except (TypeError, ValueError):
        arrays = None
    if not arrays or len({a.shape for a in arrays}) != 1:
        got = type(layers).__name__ if arrays is None else f"layer shapes {[a.shape for a in arrays]}"
        raise ValueError(
            f"source {name} must be a non-empty sequence of per-layer arrays of one shape "
            f"[rows, kv_heads, length, head_dim], got {got}"
        )
    stacked = np.stack(arrays)
    if not (jnp.issubdtype(stacked.dtype, jnp.floating) or jnp.issubdtype(stacked.dtype, jnp.integer)):
        raise ValueError(f"source {name} has dtype {stacked.dtype}; it must hold real numbers (float or int)")
    return stacked
