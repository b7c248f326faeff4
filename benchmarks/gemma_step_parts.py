"""Where a Gemma 3 decode step's time goes: the step, then the same step with parts taken away.

A random-weight Gemma 3 of the 270M geometry (`--tiny`: a few thousand parameters, for a dry run), its
global layers on `SinkWindow(4, 1020)`, prefills a P-token prompt on `Gemma3Streams`. Four cases are then
timed interleaved in one process (`benchmarks.timing`), each sample the mean of `--number` calls:

  step          one greedy decode step through `Gemma3Streams.run`: admission, plan and commit on the
                host, then the captured program (attention on the bounded caches, the ring write)
  no attention  the model's layers with the attention an identity (no cache read or write), the output
                projection and the argmax, jitted
  products      only the weight products: each layer's four matrix-vector products feeding the next (with
                an unscaled RMS norm before each, as the model has), then the output projection and argmax
  output        the output projection and the argmax alone

Per case: ms a step and its share of the step (case ÷ step within each repeat), median (min–max). So
`step - no attention` is the attention, the cache write and the host's work; `no attention - products`
the norms, RoPE, GELU and residuals; `products - output` the layers' products. Before timing, the products
chain is checked against a float64 NumPy oracle of the same chain (and its argmax against the oracle's).
Every argmax is the model's own (`mstar_jax.serving.sampling.argmax`, two passes over the logits), as the
step's; runs before 2026-12-05's last took `jnp.argmax`, about 1 ms slower over 262,144 words.

Run: python -m benchmarks.gemma_step_parts [--quick] [--tiny] [--prompt P] [--repeats R] [--number N]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.gemma_decode import RETENTION, TINY
from benchmarks.timing import ORDER_NOTE, describe, interleaved_times, positive_int, quick_label, ratios
from mstar_jax.models.gemma3.gguf import GEMMA3_270M, Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.serving.sampling import argmax

CASES = ("step", "no attention", "products", "output")

Weights = list[tuple[jax.Array, jax.Array, jax.Array, jax.Array]]
"""Per layer, the `[O, I]` weights of queries-keys-values, attention output, gate-up and down."""


def layer_weights(model: Gemma3) -> Weights:
    """Each block's four projection weights, as the model holds them."""
    names = ("wqkv", "wo", "gate_up", "down")
    return [tuple(getattr(block, name).weight[...] for name in names) for block in model.blocks]


def products(config: Gemma3Config, weights: Weights, embed_t: jax.Array, x: jax.Array, *, xp=jnp):
    """x [1, E] through every layer's products alone, then the output projection: (argmax, logits [1, V]).

    The attention is an identity: the queries' part of the first product feeds the attention output's
    product. `xp` is `jnp` (jitted) or `np` (the oracle, on float64 copies).
    """
    queries = config.num_heads * config.head_dim

    def norm(v):  # as the model's RMSNorm, unscaled: it keeps 18 random layers from overflowing
        return v / xp.sqrt(xp.mean(v * v, axis=-1, keepdims=True) + 1e-6)

    for wqkv, wo, gate_up, down in weights:
        qkv = norm(x) @ wqkv.T
        x = x + qkv[:, :queries] @ wo.T
        gate, up = xp.split(norm(x) @ gate_up.T, 2, axis=-1)
        gelu = 0.5 * gate * (1 + xp.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        x = x + (gelu * up) @ down.T
    logits = norm(x) @ embed_t
    # The jitted chain takes its argmax as the model's step does (two passes, `sampling.argmax`).
    return (argmax(logits) if xp is jnp else np.argmax(logits, axis=-1)), logits


def check_products(config: Gemma3Config, weights: Weights, embed_t: jax.Array, x: jax.Array) -> None:
    """The jitted products chain against float64 NumPy, before any timing.

    Raises:
      AssertionError: when the logits differ beyond float32 rounding or the argmax is not the oracle's
        largest logit (within that rounding).
    """
    token, logits = jax.jit(lambda w, e, h: products(config, w, e, h))(weights, embed_t, x)
    as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    _, want = products(
        config, [tuple(map(as64, w)) for w in weights], as64(embed_t), as64(x), xp=np
    )  # fmt: skip
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=0, atol=1e-4 * scale)
    picked = want[0, int(token[0])]
    largest = want.max()
    assert picked >= largest - 1e-4 * scale, f"argmax {int(token[0])} has {picked}, the largest {largest}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (labelled)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model instead of the 270M geometry"
    )
    for flag, what in (
        ("--prompt", "prompt tokens (default 512, quick 32)"),
        ("--repeats", "samples a case (default 10, quick 2)"),
        ("--number", "calls a sample (default 8, quick 2)"),
    ):
        parser.add_argument(flag, type=positive_int, default=None, help=what)
    args = parser.parse_args(argv)
    prompt = args.prompt or (32 if args.quick else 512)
    repeats, number = args.repeats or (2 if args.quick else 10), args.number or (2 if args.quick else 8)
    config = TINY if args.tiny else GEMMA3_270M
    label = quick_label(args.quick, f"{prompt}-token prompt, {repeats} repeats of {number} calls")
    print(f"benchmarks/gemma_step_parts.py{label}")
    geometry = "tiny" if args.tiny else "270M"
    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    print(f"backend: {backend}; the {geometry} geometry, random")
    print(f"timing: {ORDER_NOTE}; {repeats} repeats of {number} calls; median (min–max)")

    model = Gemma3(config, rngs=nnx.Rngs(0))
    # The tied embedding starts at zeros; random words make the argmax a real search.
    model.embed_t[...] = jax.random.normal(jax.random.key(1), model.embed_t[...].shape) * 0.05
    streams = Gemma3Streams(
        config, model, global_retention=RETENTION, max_slots=1, chunk=min(128, prompt), batch_sizes=(1,)
    )
    streams.capture()
    rid = streams.open()
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, prompt)
    for start in range(0, prompt, streams.chunk):
        token = streams._run_one(rid, tokens[start : start + streams.chunk])

    weights, embed_t = layer_weights(model), model.embed_t[...]
    x = jax.random.normal(jax.random.key(2), (1, config.d_model)) * 0.1
    check_products(config, weights, embed_t, x)
    print("products chain: equal to the float64 oracle")

    graphdef, params = nnx.split(model)
    identity = lambda state, is_global, index, q, k, v: (q, state)  # noqa: E731

    @jax.jit
    def no_attention(params, token):
        net = nnx.merge(graphdef, params)
        hidden, _ = net(token.reshape(1, 1), jnp.full((1, 1), prompt, jnp.int32), None, identity)
        return argmax(net.logits(hidden[:, 0]))

    products_step = jax.jit(lambda w, e, h: products(config, w, e, h)[0])
    output_step = jax.jit(lambda e, h: argmax(h @ e))
    state = {"token": token}

    def step():
        state["token"] = streams._run_one(rid, [state["token"]])

    cases = {
        "step": step,
        "no attention": lambda: no_attention(params, jnp.int32(state["token"])).block_until_ready(),
        "products": lambda: products_step(weights, embed_t, x).block_until_ready(),
        "output": lambda: output_step(embed_t, x).block_until_ready(),
    }
    times = interleaved_times(cases, repeats, number=number)
    print(f"\nms a decode step, and the share of the step, by case{label}")
    print("| case | ms a step | ÷ step |")
    print("|---|---|---|")
    for name in CASES:
        share = describe(ratios(times[name], times["step"]), repeats=False)
        print(f"| {name} | {describe(times[name], '.2f', scale=1e3, repeats=False)} | {share} |")


if __name__ == "__main__":
    main()
