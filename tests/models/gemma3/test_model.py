"""Gemma 3 on the bounded caches against an independent float64 NumPy forward pass with explicit masks.

A small random-weight Gemma 3 (6 layers: 5 local with a sliding window of 8, one global) is streamed
through `Gemma3Streams` in prefill chunks and one-token steps; every token's log-probability must match
the oracle's, which attends through the masks the architecture defines: a local query at i sees keys j
with 0 <= i - j < window; a global one sees every j <= i (dense), or with `SinkWindow(sink, w)` the j < sink
and those with i - j <= w. Streams run well past both windows.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.models.gemma3.gguf import Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow

CONFIG = Gemma3Config(
    vocab_size=64, num_layers=6, d_model=32, ffn_dim=48, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_eps=1e-6, rope_global_base=1_000_000.0, rope_local_base=10_000.0, sliding_window=8,
    context_length=256, bos_id=2, eos_id=1, add_bos=True,
)  # fmt: skip
TOKENS = 41


def random_tensors(config: Gemma3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named weights in PyTorch layout; norm weights near 1 as the file stores them."""
    rng = np.random.default_rng(seed)
    c = config
    e, hd, kd = c.d_model, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    normal = lambda *shape: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": normal(c.vocab_size, e), "output_norm.weight": norm(e)}
    for i in range(c.num_layers):
        shapes = {
            "attn_q": (hd, e), "attn_k": (kd, e), "attn_v": (kd, e), "attn_output": (e, hd),
            "ffn_gate": (c.ffn_dim, e), "ffn_up": (c.ffn_dim, e), "ffn_down": (e, c.ffn_dim),
        }  # fmt: skip
        tensors |= {f"blk.{i}.{name}.weight": normal(*shape) for name, shape in shapes.items()}
        for name, n in (("attn_norm", e), ("post_attention_norm", e), ("ffn_norm", e), ("post_ffw_norm", e),
                        ("attn_q_norm", c.head_dim), ("attn_k_norm", c.head_dim)):  # fmt: skip
            tensors[f"blk.{i}.{name}.weight"] = norm(n)
    return tensors


# -- the oracle ----------------------------------------------------------------------------------------


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """[T, heads, D]: pairs (i, i + D/2) rotated by position * base**(-2i/D)."""
    half = x.shape[-1] // 2
    angles = positions[:, None, None] * base ** (-np.arange(half) * 2 / x.shape[-1])
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate(
        [x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1
    )


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def oracle_log_softmax(config: Gemma3Config, tensors, tokens, global_retention: SinkWindow) -> np.ndarray:
    """f64[n, V]: each position's next-token log-probabilities, from explicit attention masks."""
    c, t = config, {name: np.asarray(w, np.float64) for name, w in tensors.items()}
    n = len(tokens)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    local = (j <= i) & (i - j < c.sliding_window)
    sink, window, _ = global_retention
    global_ = (j <= i) & ((j < sink) | (i - j <= window))
    x = t["token_embd.weight"][tokens] * math.sqrt(c.d_model)
    group = c.num_heads // c.num_kv_heads
    for layer in range(c.num_layers):
        w = lambda name, layer=layer: t[f"blk.{layer}.{name}.weight"]  # noqa: E731
        is_global = c.is_global(layer)
        h = rms(x, w("attn_norm"), c.rms_eps)
        q = rms((h @ w("attn_q").T).reshape(n, c.num_heads, c.head_dim), w("attn_q_norm"), c.rms_eps)
        k = rms((h @ w("attn_k").T).reshape(n, c.num_kv_heads, c.head_dim), w("attn_k_norm"), c.rms_eps)
        v = (h @ w("attn_v").T).reshape(n, c.num_kv_heads, c.head_dim)
        base = c.rope_global_base if is_global else c.rope_local_base
        q, k = rope(q, np.arange(n), base), rope(k, np.arange(n), base)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(c.head_dim)
        scores = np.where(global_ if is_global else local, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", probs, v).reshape(n, -1)
        x = x + rms(attended @ w("attn_output").T, w("post_attention_norm"), c.rms_eps)
        h = rms(x, w("ffn_norm"), c.rms_eps)
        mlp = (gelu_tanh(h @ w("ffn_gate").T) * (h @ w("ffn_up").T)) @ w("ffn_down").T
        x = x + rms(mlp, w("post_ffw_norm"), c.rms_eps)
    logits = rms(x, t["output_norm.weight"], c.rms_eps) @ t["token_embd.weight"].T
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def oracle_log_probs(config: Gemma3Config, tensors, tokens, global_retention: SinkWindow) -> np.ndarray:
    """Log-probability of tokens[1:] given their prefixes."""
    log_softmax = oracle_log_softmax(config, tensors, tokens, global_retention)
    return log_softmax[np.arange(len(tokens) - 1), tokens[1:]]


# -- the tests -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(CONFIG)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, CONFIG.vocab_size, TOKENS).astype(np.int32)


CASES = {  # (global retention, prefill chunk): every retention chunked; one-token and long chunks once
    "dense": (SinkWindow(0, 256), 5),
    "window": (SinkWindow(0, 12), 5),
    "sinks+window": (SinkWindow(4, 12), 5),
    "1 sink + short window": (SinkWindow(1, 5), 5),
    "sinks+window, one token a step": (SinkWindow(4, 12), 1),
    "sinks+window, chunks past the windows": (SinkWindow(4, 12), 16),
}


@pytest.mark.slow
@pytest.mark.parametrize(("retention", "chunk"), list(CASES.values()), ids=list(CASES))
def test_streamed_log_probs_equal_the_masked_oracle(tensors, tokens, retention, chunk):
    model = Gemma3.from_tensors(CONFIG, tensors)
    streams = Gemma3Streams(CONFIG, model, global_retention=retention, chunk=chunk)
    got = streams.score(tokens)
    want = oracle_log_probs(CONFIG, tensors, tokens, retention)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    assert streams.local.free_slots == streams.global_.free_slots == 1  # the stream gave its slots back


def test_the_retention_changes_the_answer(tensors, tokens):
    """The oracle's masks matter here: past the windows, dense and bounded global layers disagree."""
    dense = oracle_log_probs(CONFIG, tensors, tokens, SinkWindow(0, 256))
    bounded = oracle_log_probs(CONFIG, tensors, tokens, SinkWindow(0, 5))
    assert np.abs(dense - bounded).max() > 1e-2


@pytest.mark.slow
def test_greedy_decoding_continues_as_the_oracle_ranks(tensors, tokens):
    retention = SinkWindow(2, 10)
    streams = Gemma3Streams(CONFIG, Gemma3.from_tensors(CONFIG, tensors), global_retention=retention, chunk=8)
    prompt = list(tokens[:13])
    continuation = streams.greedy(prompt, 20)
    sequence = np.asarray(prompt + continuation, np.int32)
    ranked = oracle_log_softmax(CONFIG, tensors, sequence, retention)
    # Each appended token is the oracle's argmax after the tokens before it (causal: later ones do not count).
    assert continuation == [int(np.argmax(ranked[len(prompt) - 1 + step])) for step in range(20)]


def test_bfloat16_weights_run_and_stay_close(tensors, tokens):
    model = Gemma3.from_tensors(CONFIG, tensors, dtype=jnp.bfloat16)
    got = Gemma3Streams(CONFIG, model, global_retention=SinkWindow(0, 256), chunk=16).score(tokens)
    want = oracle_log_probs(CONFIG, tensors, tokens, SinkWindow(0, 256))
    assert np.abs(got - want).mean() < 0.1


@pytest.mark.parametrize(
    ("retention", "match"),
    [
        ((0, 12), r"global_retention=\(0, 12\) must be a SinkWindow\(sink, window >= 1\)"),
        (SinkWindow(4, 0), r"global_retention=SinkWindow\(sink=4, window=0.* must be a SinkWindow"),
        (SinkWindow(0, 12, True), r"window_includes_step=True: .* must be False"),
    ],
)
def test_a_bad_global_retention_is_refused_naming_it(tensors, retention, match):
    model = Gemma3.from_tensors(CONFIG, tensors)
    with pytest.raises(ValueError, match=match):
        Gemma3Streams(CONFIG, model, global_retention=retention)
    with pytest.raises(ValueError, match=r"chunk=0 must be an int >= 1"):
        Gemma3Streams(CONFIG, model, global_retention=SinkWindow(0, 12), chunk=0)
