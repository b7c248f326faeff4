"""benchmarks/bounded_kv.py times every layer: no layer's attention is dead code in its compiled steps.

A multi-layer step that returns only the last layer's output lets XLA drop every earlier layer's
attention; the benchmark chains each layer's output into the next layer's queries. The count of softmax
exponentials in the optimized HLO is the marker: it must grow with the layers.
"""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bounded_kv
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, SourceBank

TINY = {"kv_heads": 1, "head_dim": 8, "sink": 2, "window": 6, "heads": 2, "batch": 2, "written": 20}
LAYERS = 3


def test_both_steps_compile_one_attention_per_layer():
    counts = bounded_kv.attention_counts(layers=LAYERS, **TINY)
    for name, (many, one) in counts.items():
        assert one > 0, name
        assert many == LAYERS * one, (name, many, one)
    bounded_kv.check_every_layer_attends(counts, LAYERS)  # and the benchmark's own check agrees


@partial(jax.jit, static_argnames=("config",), donate_argnums=0)
def last_layer_only(cache, bank, plan, q, k, v, *, config):
    """The benchmark's step before the fix: each layer reads the same queries; the last output leaves."""
    out = None
    for layer in range(config.num_layers):
        out, cache = attend(cache, bank, plan, layer, q, k, v, config=config, implementation="xla")
    return cache, out


def test_the_marker_sees_layers_dropped_as_dead_code():
    manager = bounded_kv.make_manager(
        slots=TINY["batch"], layers=LAYERS, kv_heads=1, head_dim=8, sink=2, window=6
    )
    plan = bounded_kv.admit_and_plan(manager, TINY["batch"], TINY["written"])
    cfg = manager.config
    q = jax.ShapeDtypeStruct((TINY["batch"], 1, TINY["heads"], 8), jnp.float32)
    k = jax.ShapeDtypeStruct((TINY["batch"], 1, 1, 8), jnp.float32)
    args = (BoundedKVCache.abstract(cfg), SourceBank.abstract(cfg, 1), plan, q, k, k)
    dropped = bounded_kv.exponentials(last_layer_only, *args, config=cfg)
    chained = bounded_kv.exponentials(bounded_kv.bounded_step, *args, config=cfg)
    one_layer = bounded_kv.attention_counts(layers=1, **TINY)["bounded"][0]
    assert dropped == one_layer  # XLA kept the last layer's attention alone
    assert chained == LAYERS * one_layer
    with pytest.raises(RuntimeError, match="dead code"):
        bounded_kv.check_every_layer_attends({"unchained": (dropped, one_layer)}, LAYERS)


def test_advance_commits_positions_through_the_manager():
    manager = bounded_kv.make_manager(slots=3, layers=1, kv_heads=1, head_dim=8, sink=2, window=6)
    bounded_kv.advance(manager, {"a": 0, "b": 5, "c": 100})
    assert [manager.written(r) for r in "abc"] == [0, 5, 100]
    assert manager.slot_of("a") is None  # nothing written, no slot claimed
    assert manager.slot_of("b") is not None
