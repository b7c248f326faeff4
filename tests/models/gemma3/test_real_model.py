"""The real Gemma 3 270M (Q4_K_M GGUF) on the bounded caches, against llama.cpp.

Needs the `gemma` extra (the model package, `gguf`, `sentencepiece`); the comparison with llama.cpp
also needs `llama-cpp-python` (the `llama` extra). Each part skips, naming what is missing, where it is
absent.

llama.cpp runs two files: the shipped Q4_K_M one, whose CPU matmuls quantize activations to 8 bits (so
logits differ by up to ~1 and close calls split), and a float32 copy of the same dequantized weights,
which differs from this float32 model by summation order alone: greedy text must then be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.resources.kv.bounded.config import SinkWindow
from tests import extras

extras.skip_module_without("gemma")
pytestmark = [pytest.mark.slow, pytest.mark.gemma]

from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, load_gguf, open_gguf  # noqa: E402
from mstar_jax.models.gemma3.model import Gemma3  # noqa: E402
from mstar_jax.models.gemma3.stream import Gemma3Streams  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "def fibonacci(n):\n    ",
)
CONTINUATION = 64
MARGIN = 1.0  # logits: the Q4_K_M reference's own noise between its one-token and batched kernels
DENSE = SinkWindow(0, 4096)


@pytest.fixture(scope="module")
def path():
    return default_gguf_path()


@pytest.fixture(scope="module")
def reader(path):
    return open_gguf(path)  # parsed once: the vocabulary alone takes seconds


@pytest.fixture(scope="module")
def weights(reader):
    return load_gguf(reader)  # (config, float32 tensors by name)


@pytest.fixture(scope="module")
def loaded(weights):
    config, tensors = weights
    return config, Gemma3.from_tensors(config, tensors)


@pytest.fixture(scope="module")
def tokenizer(reader):
    return Gemma3Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def dense(loaded):
    config, model = loaded
    return Gemma3Streams(config, model, global_retention=DENSE, chunk=64)


def _llama_cpp(path):
    from tests.models.gemma3 import llama_reference

    return llama_reference.load(path, n_ctx=512)


@pytest.fixture(scope="module")
def llama(path):
    """llama.cpp on the shipped Q4_K_M file."""
    return _llama_cpp(path)


@pytest.fixture(scope="module")
def llama_f32(reader, weights, tmp_path_factory):
    """llama.cpp on a float32 GGUF of the weights this model runs (about 1.1 GB, written once)."""
    from tests.models.gemma3 import llama_reference

    copy = tmp_path_factory.mktemp("gguf") / "gemma-3-270m-f32.gguf"
    llama_reference.write_float32_copy(reader, weights[1], copy)
    return _llama_cpp(copy)


def test_the_model_counts_on(dense, tokenizer):
    tokens = dense.greedy(tokenizer.encode("One, two, three, four,"), 8)
    assert tokenizer.decode(tokens).startswith(" five, six, seven, eight")


@pytest.mark.llama
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_llama_cpps_token_for_token(dense, tokenizer, llama_f32, prompt):
    """On the same float32 weights, 64 tokens of free-running greedy decoding are llama.cpp's, and
    teacher-forced on them the log-probabilities agree closely."""
    from tests.models.gemma3 import llama_reference

    tokens = tokenizer.encode(prompt)
    assert tokens == llama_reference.tokenize(llama_f32, prompt)  # the same tokenizer, independently built
    theirs = llama_reference.greedy(llama_f32, tokens, CONTINUATION)
    assert dense.greedy(tokens, CONTINUATION) == theirs
    sequence = tokens + theirs
    difference = np.abs(dense.score(sequence) - llama_reference.log_probs(llama_f32, sequence))
    top_two = np.sort(llama_reference.logits(llama_f32, sequence)[len(tokens) - 1 : -1], axis=-1)[:, -2:]
    print(
        f"{prompt[:24]!r} float32: mean |Δ log-prob| {difference.mean():.2e}, max {difference.max():.2e}, "
        f"closest call {np.min(top_two[:, 1] - top_two[:, 0]):.3f} logit"
    )
    # Not bits: ggml's GELU reads a float16 table, so a few thousandths remain (measured: mean 2e-4 to
    # 6e-4, max 5e-3); the Q4_K_M file's 8-bit activations cost ~100 times more (below).
    assert difference.mean() < 2e-3
    assert difference.max() < 2e-2


@pytest.mark.llama
@pytest.mark.parametrize("prompt", PROMPTS)
def test_llama_cpp_on_the_quantized_file_ranks_first_what_we_do(dense, tokenizer, llama, prompt):
    """llama.cpp on the Q4_K_M file itself (its own dequantization and kernels), teacher-forced on our
    greedy text: the same argmax wherever its top two logits are at least `MARGIN` apart, and close
    log-probabilities throughout."""
    from tests.models.gemma3 import llama_reference

    tokens = tokenizer.encode(prompt)
    sequence = tokens + dense.greedy(tokens, CONTINUATION)
    theirs = llama_reference.logits(llama, sequence)[len(tokens) - 1 : -1]
    ours = dense.logits(sequence)[len(tokens) - 1 : -1]
    top_two = np.sort(theirs, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] >= MARGIN
    assert clear.sum() >= CONTINUATION // 2
    np.testing.assert_array_equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
    difference = np.abs(dense.score(sequence) - llama_reference.log_probs(llama, sequence))
    print(f"{prompt[:24]!r} Q4_K_M: mean |Δ log-prob| {difference.mean():.4f}, max {difference.max():.4f}")
    assert difference.mean() < 0.15


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
