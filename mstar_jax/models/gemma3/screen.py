"""Greedy tokens through an int8 screen of the output projection (`Gemma3Streams(greedy_screen=True)`).

A decode step's largest read is the output projection: 262,144 words x 640 floats, 671 MB in float32,
more than every layer together. A greedy row needs only the argmax, so `mstar_jax.native.screened_argmax`
reads an int8 copy (168 MB), bounds how far each word's coarse logit can lie from its float32 one, reads
a second byte for the words the bound cannot rule out, and computes in float32 only the few left.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mstar_jax import native

__all__ = ["abstract_arrays", "arrays", "greedy", "require"]


def require(mesh: jax.sharding.Mesh | None, dtype: Any) -> None:
    """Refuse the screen where its kernel cannot run: off CPU, on a model that is not float32, or where
    it does not build.

    Raises:
      ValueError: for devices that are not CPUs, or weights that are not float32.
      NativeUnavailableError: where the kernel does not build (no C++ compiler).
    """
    if jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"greedy_screen=True needs float32 weights; these are {jnp.dtype(dtype)}")
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    platforms = sorted({device.platform for device in devices})
    if platforms != ["cpu"]:
        raise ValueError(f"greedy_screen=True runs on CPU devices only; these are {platforms}")
    native.build()


def arrays(table: jax.Array) -> native.Screen:
    """The screen of an output projection held `[E, V]` (`mstar_jax.native.screen_of`)."""
    return native.screen_of(table)


def abstract_arrays(vocab_size: int, d_model: int) -> native.Screen:
    """`arrays`' shapes and dtypes (nothing allocated), for a memory budget."""
    return native.abstract_screen(vocab_size, d_model)


def greedy(hidden: jax.Array, table: jax.Array, screen: native.Screen) -> jax.Array:
    """i32[B]: the argmax of `hidden [B, E] @ table [E, V]` in float32, through `screen` (`arrays`)."""
    return native.screened_argmax(hidden, screen, table)
