"""The experiment's pieces (`streaming_llm`) on the small random-weight model of `test_model`."""

from __future__ import annotations

import shutil

import matplotlib
import numpy as np
import pytest

from benchmarks.streaming_llm import skip_ahead
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.models.gemma3.streaming_llm import (
    Variant,
    binned_perplexity,
    decode_seconds,
    kjv_text,
    log_probs,
    plot_perplexity,
    sample_text,
    variants,
)
from mstar_jax.resources.kv.bounded.config import SinkWindow
from tests.models.gemma3.test_model import CONFIG, oracle_log_probs, random_tensors

matplotlib.use("Agg")


def test_variants_cover_dense_windows_and_sinks():
    got = variants(20480, [256, 1024], [0, 1, 4, 16])
    assert got == [
        Variant("dense", SinkWindow(0, 20480)),
        Variant("window 256", SinkWindow(0, 256)),
        Variant("4 sinks + window 256", SinkWindow(4, 256)),
        Variant("window 1024", SinkWindow(0, 1024)),
        Variant("4 sinks + window 1024", SinkWindow(4, 1024)),
        Variant("1 sink + window 256", SinkWindow(1, 256)),
        Variant("16 sinks + window 256", SinkWindow(16, 256)),
    ]


def test_binned_perplexity_by_hand():
    scores = np.log(np.array([0.5, 0.25, 0.5, 0.5, 0.125]))
    ends, perplexity = binned_perplexity(scores, 2)
    np.testing.assert_array_equal(ends, [2, 4, 5])
    np.testing.assert_allclose(perplexity, [np.sqrt(8), 2, 8])


def test_log_probs_are_the_oracles_and_the_plot_draws_each():
    tensors = random_tensors(CONFIG)
    model = Gemma3.from_tensors(CONFIG, tensors)
    tokens = np.random.default_rng(5).integers(0, CONFIG.vocab_size, 30)
    results = {}
    for variant in (Variant("dense", SinkWindow(0, 30)), Variant("2 sinks + 6", SinkWindow(2, 6))):
        results[variant.name] = log_probs(CONFIG, model, variant, tokens, chunk=8)
        want = oracle_log_probs(CONFIG, tensors, tokens, variant.retention)
        np.testing.assert_allclose(results[variant.name], want, rtol=0, atol=2e-4)
    ax = plot_perplexity(results, 10)
    assert [line.get_label() for line in ax.get_lines()] == ["dense", "2 sinks + 6"]
    np.testing.assert_allclose(
        ax.get_lines()[1].get_ydata(), binned_perplexity(results["2 sinks + 6"], 10)[1]
    )


def test_skip_ahead_commits_positions_without_running():
    streams = Gemma3Streams(
        CONFIG,
        Gemma3.from_tensors(CONFIG, random_tensors(CONFIG)),
        global_retention=SinkWindow(2, 6),
        chunk=8,
    )
    rid = streams.open()
    skip_ahead(streams, rid, 21)
    assert streams.local.written(rid) == streams.global_.written(rid) == 21
    assert streams.captures == []  # nothing was compiled, so nothing ran
    decode_seconds(streams, rid, 3)
    assert streams.local.written(rid) == streams.global_.written(rid) == 22


def test_sample_text_is_genesis():
    text = sample_text()
    assert text.startswith("In the beginning God created the heaven and the earth.\n")
    assert text.rstrip().endswith("then began men to call upon the name of the LORD.")


@pytest.mark.skipif(
    shutil.which("bible") is None, reason="the `bible` program is absent (apt-get install bible-kjv)"
)
def test_kjv_text_is_the_whole_bible_without_verse_references():
    text = kjv_text()
    lines = text.splitlines()
    assert len(lines) == 31102  # verses in the KJV
    assert lines[0] == "In the beginning God created the heaven and the earth."
    assert lines[-1] == "The grace of our Lord Jesus Christ be with you all. Amen."
