"""StreamingLLM's experiment (Xiao et al., arXiv 2309.17453) on Gemma 3, as library functions.

Gemma 3's local layers are a sliding window by design; its global layers are the ones a bounded cache
changes. `variants` names the global caches the paper compares (dense, window only, sinks + window),
`log_probs` streams a text through one of them, `binned_perplexity` and `plot_perplexity` give the
paper's perplexity-against-position figure, and `decode_seconds` times one decode step.
`benchmarks/streaming_llm.py` runs the whole experiment; the notebook
`notebooks/streaming_llm_gemma3.ipynb` a short version.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence

import numpy as np

from mstar_jax.models.gemma3.gguf import Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.stream import Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow

__all__ = [
    "Variant",
    "binned_perplexity",
    "decode_seconds",
    "kjv_text",
    "log_probs",
    "plot_perplexity",
    "sample_text",
    "variants",
]

_VERSE_REFERENCE = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+ ", re.MULTILINE)


def kjv_text() -> str:
    """The whole King James Version (4.4 MB), one verse a line, from Debian's `bible-kjv` package.

    Raises:
      FileNotFoundError: when the `bible` program is not installed (`apt-get install bible-kjv`).
    """
    program = shutil.which("bible")
    if program is None:
        raise FileNotFoundError("the `bible` program is not installed; `apt-get install bible-kjv` gives it")
    text = subprocess.run([program, "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    return _VERSE_REFERENCE.sub("", text.stdout)


def sample_text() -> str:
    """Genesis 1-4 of the King James Version (14 kB, shipped with the package), for short runs."""
    return importlib.resources.files(__package__).joinpath("texts/genesis_1_4.txt").read_text("utf-8")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One global cache of the experiment: its name (for tables and legends) and its retention."""

    name: str
    retention: SinkWindow


def variants(
    length: int, windows: Sequence[int], sinks: Sequence[int], *, main_sink: int = 4
) -> list[Variant]:
    """The global caches to compare on a text of `length` tokens.

    Dense (every position kept); at each window, window only and `main_sink` sinks + window; the other
    sink counts at the smallest window, where they matter most.
    """
    dense = [Variant("dense", SinkWindow(0, length))]
    out = []
    for window in windows:
        out.append(Variant(f"window {window}", SinkWindow(0, window)))
        if main_sink:
            out.append(Variant(f"{main_sink} sinks + window {window}", SinkWindow(main_sink, window)))
    smallest = min(windows)
    for sink in (s for s in sinks if s not in (0, main_sink)):
        out.append(Variant(f"{sink} sink{'s' * (sink > 1)} + window {smallest}", SinkWindow(sink, smallest)))
    return dense + out


def log_probs(
    config: Gemma3Config, model: Gemma3, variant: Variant, tokens: Sequence[int], *, chunk: int = 256
) -> np.ndarray:
    """f64[len - 1]: each token's log-probability given those before it, as the variant's caches keep
    them (streamed in chunks, at flat memory)."""
    return Gemma3Streams(config, model, global_retention=variant.retention, chunk=chunk).score(tokens)


def binned_perplexity(scores: np.ndarray, bin_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(each bin's last position, the perplexity over the bin's tokens) for consecutive bins of
    `bin_size` scored tokens (a last partial bin included)."""
    starts = np.arange(0, len(scores), bin_size)
    ends = np.minimum(starts + bin_size, len(scores))
    return ends, np.array([np.exp(-scores[a:b].mean()) for a, b in zip(starts, ends, strict=True)])


def plot_perplexity(results: Mapping[str, np.ndarray], bin_size: int, *, title: str = "", ax=None):
    """The paper's figure: perplexity against position, one line per variant (log scale). Returns the
    matplotlib axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    for name, scores in results.items():
        ends, perplexity = binned_perplexity(scores, bin_size)
        ax.plot(ends, perplexity, label=name, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel(f"perplexity over each {bin_size} tokens")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def decode_seconds(streams: Gemma3Streams, rid: str, token: int, clock=time.perf_counter) -> float:
    """Wall time of one decode step of `rid` (its next token fetched to the host)."""
    start = clock()
    _, out = streams.run([(rid, [token])])
    if out is None:
        raise RuntimeError(f"the decode step of {rid!r} was refused")
    return clock() - start
