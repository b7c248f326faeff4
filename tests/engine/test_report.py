"""The step-latency plot: points the y axis cuts off are counted on the figure, not dropped silently."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mstar_jax.engine.report import plot_step_latency, step_latency_figure


def _engine(latencies_ms: list[float], rows: int = 2) -> SimpleNamespace:
    """What the plot reads of an engine: step records (walk, latency, positions) and its nodes' caches."""
    records = [
        SimpleNamespace(walk="talker_decode", latency=ms / 1e3, positions=tuple(range(i, i + rows)))
        for i, ms in enumerate(latencies_ms)
    ]
    cache = lambda key, slot_tokens: SimpleNamespace(  # noqa: E731
        spec=SimpleNamespace(resource_key=key), config=SimpleNamespace(slot_tokens=slot_tokens)
    )
    nodes = {
        name: SimpleNamespace(managers=(cache(f"{name}_kv", n),))
        for name, n in (("talker", 36), ("flow", 16))
    }
    return SimpleNamespace(records=records, nodes=nodes)


def _texts(fig) -> list[str]:
    return [text.get_text() for text in fig.axes[0].texts]


def test_points_above_the_axis_are_counted_on_the_plot():
    # 1,000 steps of 1 ms and 3 first-call outliers: the 99.5th percentile sits at index 0.995 x 1,002
    # = 996.99 of the sorted values, both neighbours 1 ms, so the axis stops at 1.2 ms and the 3
    # outliers, 2 rows each, are cut.
    latencies = [1.0] * 1000 + [250.0, 90.0, 40.0]
    fig = step_latency_figure(_engine(latencies))
    ax = fig.axes[0]
    assert ax.get_ylim() == (0.0, np.percentile(latencies, 99.5) * 1.2)
    assert ax.get_ylim()[1] == 1.2
    assert _texts(fig) == ["6 points above 1.2 ms not shown (max 250.0 ms)"]


def test_one_hidden_point_is_singular_and_none_hidden_says_nothing():
    fig = step_latency_figure(_engine([1.0] * 400 + [30.0], rows=1))  # index 0.995 x 400 = 398: 1 ms
    assert _texts(fig) == ["1 point above 1.2 ms not shown (max 30.0 ms)"]
    assert _texts(step_latency_figure(_engine([1.0, 2.0, 3.0]))) == []
    assert _texts(step_latency_figure(_engine([]))) == []


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "step_latency.png"
    plot_step_latency(_engine([1.0] * 10 + [50.0]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
