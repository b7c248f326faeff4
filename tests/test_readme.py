"""The README and the guides: their Python examples run as written, the README stays a short front page
whose links resolve, and its commands are the ones CI runs."""

import pathlib
import re

import jax
import numpy as np
import pytest

from tests.extras import SELECT_EXTRAS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CACHE_GUIDE = ROOT / "docs" / "guides" / "cache.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]


def python_blocks(page: pathlib.Path) -> list[str]:
    # ```python blocks are complete programs; ```py blocks are fragments shown for their shape.
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def test_the_readme_and_the_cache_guide_show_python_examples():
    assert python_blocks(README), "the README shows no Python example"
    assert python_blocks(CACHE_GUIDE), "the cache guide shows no Python example"


@pytest.mark.parametrize(
    "page",
    # The README's first example captures and serves the default deployment: tens of seconds.
    [pytest.param(p, marks=pytest.mark.slow) if p == README else p for p in PAGES if python_blocks(p)],
    ids=lambda p: p.name,
)
def test_python_blocks_run(page):
    for block in python_blocks(page):
        exec(compile(block, str(page), "exec"), {"__name__": "readme"})


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; what does not fit belongs in docs/guides"


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/guides/") for link in local), "the README links no guide"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def readme_commands() -> list[str]:
    """The commands of the README's "Two commands" section, one a bash block."""
    section = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_commands_as_written_then_the_extras_tests():
    install_and_run, test = readme_commands()
    assert install_and_run == (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/mstar-jax run"
    )
    assert test == ".venv/bin/python -m pytest -q"
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert any(install_and_run in line for line in commands)
    assert f"run_pytest {test} || readme_status=$?" in commands  # exactly the test command, nothing added
    extras_run = f'JAX_PLATFORMS=cpu run_pytest .venv-extras/bin/python -m pytest -q -m "{SELECT_EXTRAS}"'
    assert any(line.startswith(extras_run) for line in lines)


def test_cache_guide_example_attends_at_every_layer():
    # A step returning only the last layer's output would let XLA drop the other layers' attention: count
    # the softmax exponentials of the example's compiled step against one layer's.
    from benchmarks.bounded_kv import exponentials
    from mstar_jax.resources.kv.bounded.attention import attend
    from mstar_jax.resources.kv.bounded.config import BoundedKVStep, StreamPosition
    from mstar_jax.resources.step import Segment, StepContext

    block = python_blocks(CACHE_GUIDE)[0]
    setup = block.split("manager.ingest_request(")[0]  # the definitions, not the 200-step loop
    names = {"__name__": "readme"}
    exec(compile(setup, str(CACHE_GUIDE), "exec"), names)
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
