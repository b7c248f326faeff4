"""The README's Python examples run as written."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    # ```python blocks are complete programs; ```py blocks are fragments shown for their shape.
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README shows no Python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})


def test_readme_commands_match_ci():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    assert "mstar-jax run" in text
    assert ".venv/bin/python -m pytest -q" in text
    assert "python -m pytest -q" in ci


def test_readme_cache_example_attends_at_every_layer():
    # A step returning only the last layer's output would let XLA drop the other layers' attention: count
    # the softmax exponentials of the example's compiled step against one layer's.
    from benchmarks.bounded_kv import exponentials
    from mstar_jax.resources.kv.bounded.attention import attend
    from mstar_jax.resources.kv.bounded.config import BoundedKVStep, StreamPosition
    from mstar_jax.resources.step import Segment, StepContext

    block = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
    setup = block.split("manager.ingest_request(")[0]  # the definitions, not the 200-step loop
    names = {"__name__": "readme"}
    exec(compile(setup, str(README), "exec"), names)
    manager, config, step = names["manager"], names["config"], names["step"]
    manager.ingest_request("probe")
    s = BoundedKVStep((Segment("probe", "main", 1),), positions={"probe": StreamPosition(24, 0, 0)})
    ctx = StepContext(["probe"], "decode", 0, capture=False)
    assert manager.admit(s, ctx).ok
    plan = manager.plan(s, ctx)
    q = np.zeros((1, 1, 4, 32), np.float32)
    k = np.zeros((1, 1, 2, 32), np.float32)
    args = (manager.cache, manager.bank, plan, q, k, k)
    per_layer = exponentials(jax.jit(lambda *a: attend(*a[:3], 0, *a[3:], config=config)), *args)
    assert per_layer > 0
    assert exponentials(step, *args) == config.num_layers * per_layer
