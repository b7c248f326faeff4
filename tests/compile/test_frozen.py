"""Frozen weights: a program captured with `frozen_argnums` takes its weights as a `FrozenTree` (flattened
once) and computes what it computes from the tree itself; `replay` freezes a tree passed there; the
executable store keeps such programs; the engine hands every step the same frozen weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mstar_jax.compile import (
    BucketSet,
    ExecutableStore,
    FrozenTree,
    ReplayError,
    capture,
    count_compilations,
    freeze,
)
from mstar_jax.compile.frozen import thaw

BUCKETS = BucketSet(graph_walk="tiny", batch_sizes=(1, 2), token_counts=(3,))


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first, self.second = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)


GRAPHDEF, PARAMS = nnx.split(_Model(nnx.Rngs(0)))


def _step(params, state, x):
    """Weights (an nnx.State), a donated state and inputs, as the engine's programs take them."""
    model = nnx.merge(GRAPHDEF, params)
    out = model.second(jnp.tanh(model.first(x)))
    return state + 1, out


def _abstract(bucket):
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    return spec, jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((bucket.bs, 3), jnp.float32)


def _oracle(x: np.ndarray) -> np.ndarray:
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(PARAMS))
    first, second = p["first"], p["second"]
    return np.tanh(x @ first["kernel"] + first["bias"]) @ second["kernel"] + second["bias"]


def test_freeze_keeps_the_leaves_and_thaws_to_the_tree():
    frozen = freeze(PARAMS)
    assert freeze(frozen) is frozen
    assert len(frozen.leaves) == len(jax.tree.leaves(PARAMS)) == 4
    assert jax.tree.structure(frozen.thaw()) == jax.tree.structure(PARAMS)
    for a, b in zip(jax.tree.leaves(frozen.thaw()), jax.tree.leaves(PARAMS), strict=True):
        assert a is b
    assert thaw(3) == 3
    # One pytree node over the leaves: its flattening returns them as they are.
    leaves, treedef = jax.tree.flatten(frozen)
    assert all(a is b for a, b in zip(leaves, frozen.leaves, strict=True))
    assert isinstance(jax.tree.unflatten(treedef, leaves), FrozenTree)


@pytest.mark.parametrize("frozen_argument", [True, False], ids=["frozen", "tree"])
def test_a_frozen_capture_computes_what_the_tree_does(frozen_argument):
    step = capture(_step, BUCKETS, _abstract, donate_argnums=1, frozen_argnums=0, progress=False)
    assert step.frozen_argnums == (0,)
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    params, state = (freeze(PARAMS) if frozen_argument else PARAMS), jnp.zeros((), jnp.int32)
    with count_compilations() as counter:
        state, out = step.replay(BUCKETS.key(2, 3), params, state, x)
    assert counter.count == 0
    assert int(state) == 1
    np.testing.assert_allclose(np.asarray(out), _oracle(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_the_store_keeps_frozen_programs(tmp_path):
    store = ExecutableStore(str(tmp_path))
    capture(_step, BUCKETS, _abstract, donate_argnums=1, frozen_argnums=(0,), progress=False, store=store)
    jax.clear_caches()
    with count_compilations() as counter:
        second = capture(
            _step, BUCKETS, _abstract, donate_argnums=1, frozen_argnums=(0,), progress=False, store=store
        )
    assert counter.count == 0
    assert all(report.loaded for report in second.report.buckets)
    x = np.ones((1, 3), np.float32)
    _, out = second.replay(BUCKETS.key(1, 3), freeze(PARAMS), jnp.int32(0), x)
    np.testing.assert_allclose(np.asarray(out), _oracle(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("frozen_argnums", "match"),
    [
        ((1,), "name the same argument"),
        ((-1,), "frozen_argnums"),
        (("0",), "frozen_argnums"),
        ((0.0,), "frozen_argnums"),
    ],
)
def test_bad_frozen_argnums_are_refused(frozen_argnums, match):
    with pytest.raises((ValueError, TypeError), match=match):
        capture(_step, BUCKETS, _abstract, donate_argnums=1, frozen_argnums=frozen_argnums, progress=False)


def test_weights_of_another_structure_are_refused_without_compiling():
    step = capture(_step, BUCKETS, _abstract, donate_argnums=1, frozen_argnums=(0,), progress=False)
    other = freeze({"kernel": jnp.ones((3, 4))})
    state = jnp.zeros((), jnp.int32)
    with (
        count_compilations() as counter,
        pytest.raises(ReplayError, match="arguments it was not compiled for"),
    ):
        step.replay(BUCKETS.key(1, 3), other, state, np.ones((1, 3), np.float32))
    assert counter.count == 0
    assert not state.is_deleted()  # refused before the donated state was consumed
