"""Gemma 3's matrix-vector products from either weight layout: which one XLA:CPU streams faster.

A decode step multiplies one row `x [1, I]` by each projection's weight, held `[O, I]` (every output the
product of x with one contiguous row; `mstar_jax.models.gemma3.model.Linear`'s layout) or `[I, O]`.
For each projection of the 270M geometry, L copies (default 18, one a layer, so that the weights
outgrow the last-level cache as a step's do) are multiplied in a chain, each product feeding the next
as the layers' do. Both layouts of every projection are timed once per repeat, in a fresh random order
(`benchmarks.timing`); before timing, each layout's chain is checked against a float64 NumPy oracle.
Prints the weights' GB/s per layout and `[O, I] ÷ [I, O]` of the rates, per repeat: median (min–max).

Run: python -m benchmarks.matvec_layouts [--quick] [--layers L] [--repeats R]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, positive_int, quick_label, ratios

PROJECTIONS = {
    "queries, keys, values": (640, 1536),
    "attention output": (1024, 640),
    "gate and up": (640, 4096),
    "down": (2048, 640),
}
"""Gemma 3 270M's projections, name -> (I, O)."""

LAYOUTS = ("[O, I]", "[I, O]")
_SPEC = {"[O, I]": "bi,oi->bo", "[I, O]": "bi,io->bo"}
_FEEDBACK = 1e-3  # how much of each product's mean the next product's input takes


def weights(shape: tuple[int, int], layers: int, seed: int = 0) -> list[np.ndarray]:
    """`layers` float32 weights `[O, I]` for a projection `(I, O)`, scaled as initialised."""
    features_in, features_out = shape
    rng = np.random.default_rng(seed)
    scale = 1 / math.sqrt(features_in)
    shape_oi = (features_out, features_in)
    return [(rng.standard_normal(shape_oi) * scale).astype(np.float32) for _ in range(layers)]


def chain(layout: str, x: jax.Array, stack: list[jax.Array]) -> jax.Array:
    """x [1, I] through every weight of `stack` (held as `layout` says), each product feeding the next."""
    for w in stack:
        out = jnp.einsum(_SPEC[layout], x, w)
        x = x + _FEEDBACK * jnp.mean(out, axis=-1, keepdims=True)
    return x


def oracle(x: np.ndarray, stack: list[np.ndarray]) -> np.ndarray:
    """`chain` in float64, from the `[O, I]` weights."""
    x = x.astype(np.float64)
    for w in stack:
        out = x @ w.astype(np.float64).T
        x = x + _FEEDBACK * out.mean(axis=-1, keepdims=True)
    return x


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 repeats (labelled)")
    parser.add_argument(
        "--layers", type=positive_int, default=None, help="copies of each weight (default 18)"
    )
    parser.add_argument("--repeats", type=positive_int, default=None, help="runs each way (default 15)")
    args = parser.parse_args(argv)
    layers = args.layers or (2 if args.quick else 18)
    repeats = args.repeats or (3 if args.quick else 15)
    print(f"benchmarks/matvec_layouts.py{quick_label(args.quick, f'{layers} layers, {repeats} repeats')}")
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); float32; {layers} layers")
    print(f"timing: {ORDER_NOTE}; {repeats} repeats; median (min–max)\n")
    print("| projection | I x O | [O, I] GB/s | [I, O] GB/s | [O, I] ÷ [I, O] |")
    print("| --- | --- | --- | --- | --- |")
    run = jax.jit(chain, static_argnums=0)
    for name, shape in PROJECTIONS.items():
        held = weights(shape, layers)
        x = np.random.default_rng(1).standard_normal((1, shape[0])).astype(np.float32)
        stacks = {"[O, I]": [jnp.asarray(w) for w in held], "[I, O]": [jnp.asarray(w.T) for w in held]}
        want = oracle(x, held)
        for layout, stack in stacks.items():
            got = np.asarray(run(layout, x, stack), np.float64)
            if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"{name} {layout}: the chain is off the float64 oracle by "
                                   f"{np.abs(got - want).max():.3g}")  # fmt: skip
        cases = {
            layout: (lambda layout=layout, stack=stack, x=x: run(layout, x, stack).block_until_ready())
            for layout, stack in stacks.items()
        }
        times = interleaved_times(cases, repeats)
        nbytes = 4 * shape[0] * shape[1] * layers
        rates = {layout: [nbytes / t / 1e9 for t in times[layout]] for layout in LAYOUTS}
        cells = [describe(rates[layout], ".1f", repeats=False) for layout in LAYOUTS]
        ratio = describe(ratios(times["[O, I]"], times["[I, O]"], inverse=True), ".2f", repeats=False)
        print(f"| {name} | {shape[0]:,} x {shape[1]:,} | {cells[0]} | {cells[1]} | {ratio} |")


if __name__ == "__main__":
    main()
