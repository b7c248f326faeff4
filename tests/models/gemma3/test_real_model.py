"""The real Gemma 3 270M (Q4_K_M GGUF) on the bounded caches, against llama.cpp on the same file.

Needs the `gemma` extra (the model package, `gguf`, `sentencepiece`); the comparison with llama.cpp
also needs `llama-cpp-python`. Each part skips, naming what is missing, where it is absent.

llama.cpp quantizes activations to 8 bits in its CPU matmuls with quantized weights, while this model
runs the dequantized weights in float32, so the two agree on greedy tokens and closely on
log-probabilities, not bit for bit.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from mstar_jax.resources.kv.bounded.config import SinkWindow
from tests.models.gemma3.extra import skip_module_without_the_gemma_extra

skip_module_without_the_gemma_extra()

from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf  # noqa: E402
from mstar_jax.models.gemma3.model import Gemma3  # noqa: E402
from mstar_jax.models.gemma3.stream import Gemma3Streams  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "def fibonacci(n):\n    ",
)
CONTINUATION = 64
MARGIN = 1.0  # logits
DENSE = SinkWindow(0, 4096)


@pytest.fixture(scope="module")
def path():
    return default_gguf_path()


@pytest.fixture(scope="module")
def reader(path):
    return open_gguf(path)  # parsed once: the vocabulary alone takes seconds


@pytest.fixture(scope="module")
def loaded(reader):
    config, tensors = load_gguf(reader)
    return config, Gemma3.from_tensors(config, tensors)


@pytest.fixture(scope="module")
def tokenizer(reader):
    return Gemma3Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def dense(loaded):
    config, model = loaded
    return Gemma3Streams(config, model, global_retention=DENSE, chunk=64)


@pytest.fixture(scope="module")
def llama(path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[gemma,llama]')")
    from tests.models.gemma3 import llama_reference

    return llama_reference.load(path, n_ctx=512)


def test_the_model_counts_on(dense, tokenizer):
    tokens = dense.greedy(tokenizer.encode("One, two, three, four,"), 8)
    assert tokenizer.decode(tokens).startswith(" five, six, seven, eight")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_text_llama_cpp_writes_is_the_text_we_rank_first(dense, tokenizer, llama, prompt):
    """Teacher-forced on llama.cpp's 64-token greedy continuation: the same tokens, the same argmax at
    every position where llama.cpp's own top two logits are at least `MARGIN` apart (its logits move by
    up to ~1 between its one-token and batched kernels, so closer calls are its noise, not a finding),
    and close log-probabilities throughout."""
    from tests.models.gemma3 import llama_reference

    tokens = tokenizer.encode(prompt)
    assert tokens == llama_reference.tokenize(llama, prompt)  # the same tokenizer, independently built
    sequence = tokens + llama_reference.greedy(llama, tokens, CONTINUATION, incremental=False)
    theirs = llama_reference.logits(llama, sequence)[len(tokens) - 1 : -1]
    ours = dense.logits(sequence)[len(tokens) - 1 : -1]
    top_two = np.sort(theirs, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] >= MARGIN
    assert clear.sum() >= CONTINUATION // 2
    np.testing.assert_array_equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    difference = np.abs(dense.score(sequence) - llama_reference.log_probs(llama, sequence))
    print(f"{prompt[:24]!r}: mean |Δ log-prob| {difference.mean():.4f}, max {difference.max():.4f}")
    assert difference.mean() < 0.15


def test_greedy_code_matches_llama_cpp_token_for_token(dense, tokenizer, llama):
    """Where no step is a close call, free-running greedy decoding writes llama.cpp's 64 tokens."""
    from tests.models.gemma3 import llama_reference

    tokens = tokenizer.encode(PROMPTS[2])
    assert dense.greedy(tokens, CONTINUATION) == llama_reference.greedy(llama, tokens, CONTINUATION)


def test_a_bounded_global_cache_equals_the_dense_one_while_the_stream_fits(loaded, dense, tokenizer):
    """Global layers keeping 4 sinks + 60 recent keys see every key for the first 65 tokens, so they
    give the dense model's log-probabilities there, and differ once keys are evicted."""
    config, model = loaded
    bounded = Gemma3Streams(config, model, global_retention=SinkWindow(4, 60), chunk=64)
    text = " ".join([PROMPTS[1]] * 6)
    tokens = tokenizer.encode(text)[:160]
    got, want = bounded.score(tokens), dense.score(tokens)
    fits = 4 + 60  # token i (its log-prob at index i - 1) sees every key while i <= sink + window
    np.testing.assert_allclose(got[:fits], want[:fits], rtol=0, atol=1e-4)
    assert np.abs(got[fits + 8 :] - want[fits + 8 :]).max() > 1e-3
