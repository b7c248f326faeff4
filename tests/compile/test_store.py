"""The executable store: a second capture loads every bucket (nothing traced or compiled) and the loaded
programs compute what the compiled ones do, the cache still donated; any mismatch falls back to
compiling, bucket by bucket; a fresh process loads them too."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.compile import BucketSet, ExecutableStore, capture, count_compilations, describe
from mstar_jax.compile import store as store_module

BUCKETS = BucketSet(graph_walk="tiny", batch_sizes=(1, 2), token_counts=(3, 5))


def _squash(x, *, power):
    return jnp.tanh(x) ** power


SQUASH = functools.partial(_squash, power=1)  # a function in the static settings, as a retention policy is


def _step(state, x, *, scale, squash=SQUASH):
    """A stateful step: the state (donated) accumulates, the output reads both."""
    state = state + squash(x * scale).sum()
    return state, x * state


def _abstract(bucket):
    return (
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((bucket.bs, bucket.num_tokens), jnp.float32),
    )


def _capture(store, *, scale=0.5, squash=SQUASH, fingerprint=None, max_workers=1):
    """Capture as a new process would: nothing compiled in memory (so every compile is counted)."""
    jax.clear_caches()
    with count_compilations() as counter:
        step = capture(
            _step, BUCKETS, _abstract, static_kwargs={"scale": scale, "squash": squash}, donate_argnums=0,
            progress=False, store=store, fingerprint=fingerprint, max_workers=max_workers,
        )  # fmt: skip
    return step, counter.count


def _run(step, bucket):
    x = np.arange(bucket.bs * bucket.num_tokens, dtype=np.float32).reshape(bucket.bs, -1) / 7
    state = jnp.asarray(1.0, jnp.float32)
    new_state, out = step.replay(bucket, state, x)
    assert state.is_deleted(), "the state argument must stay donated"
    return np.asarray(new_state), np.asarray(out)


def _oracle(bucket, scale=0.5, power=1):
    x = np.arange(bucket.bs * bucket.num_tokens, dtype=np.float64).reshape(bucket.bs, -1) / 7
    state = 1.0 + (np.tanh(x * scale) ** power).sum()
    return state, x * state


def test_a_second_capture_loads_every_bucket_and_compiles_nothing(tmp_path):
    store = ExecutableStore(tmp_path)
    first, compiled = _capture(store)
    assert compiled == len(BUCKETS)
    assert first.report.loaded == 0
    assert (store.saved, store.loaded, len(store.entries())) == (len(BUCKETS), 0, len(BUCKETS))
    again = ExecutableStore(tmp_path)
    second, compiled = _capture(again, max_workers=2)
    assert compiled == 0
    assert second.report.loaded == len(BUCKETS)
    assert second.report.compiled == 0
    assert all(b.loaded and b.lower_secs == 0 for b in second.report.buckets)
    assert (again.loaded, again.saved, again.rejected) == (len(BUCKETS), 0, 0)
    assert "loaded" in second.report.table()
    for bucket in BUCKETS:
        want_state, want_out = _oracle(bucket)
        for step in (first, second):
            state, out = _run(step, bucket)
            np.testing.assert_allclose(state, want_state, rtol=1e-6)
            np.testing.assert_allclose(out, want_out, rtol=1e-6)
        np.testing.assert_array_equal(_run(first, bucket)[1], _run(second, bucket)[1])


def test_loaded_programs_refuse_other_shapes_and_never_compile(tmp_path):
    _capture(ExecutableStore(tmp_path))
    second, _ = _capture(ExecutableStore(tmp_path))
    state, x = jnp.asarray(0.0, jnp.float32), jnp.zeros((2, 3), jnp.float32)
    with count_compilations() as counter, pytest.raises(TypeError):
        second.replay(BUCKETS.key(1, 3), state, x)
    assert counter.count == 0


@pytest.mark.parametrize(
    "change",
    ["scale", "a partial's argument", "fingerprint", "environment", "code"],
)
def test_any_difference_in_what_a_program_is_built_from_compiles_it_anew(tmp_path, monkeypatch, change):
    _capture(ExecutableStore(tmp_path))
    kwargs = {}
    if change == "scale":
        kwargs["scale"] = 0.25
    elif change == "a partial's argument":
        kwargs["squash"] = functools.partial(_squash, power=3)
    elif change == "fingerprint":
        kwargs["fingerprint"] = ("temperature", 0.7)
    elif change == "environment":
        real = store_module.environment
        monkeypatch.setattr(store_module, "environment", lambda: {**real(), "jaxlib": "0.0.0"})
    else:
        monkeypatch.setattr(store_module, "_code_digest", lambda fn: "an edited library")
    store = ExecutableStore(tmp_path)
    step, compiled = _capture(store, **kwargs)
    assert compiled == len(BUCKETS)
    assert step.report.loaded == 0
    assert (store.saved, len(store.entries())) == (len(BUCKETS), 2 * len(BUCKETS))
    bucket = BUCKETS.key(2, 5)
    power = 3 if "squash" in kwargs else 1
    want = _oracle(bucket, kwargs.get("scale", 0.5), power)[1]
    np.testing.assert_allclose(_run(step, bucket)[1], want, rtol=1e-6)


def test_a_program_only_an_address_could_describe_is_compiled_and_never_stored(tmp_path):
    """A static setting whose only description is an object's address (a new one every start) gives no
    key: the store neither loads nor writes such a program, rather than keep entries nothing can match."""

    class Squash:  # a callable object: its repr is its address
        def __call__(self, x):
            return jnp.tanh(x)

    store = ExecutableStore(tmp_path)
    step, compiled = _capture(store, squash=Squash())
    assert compiled == len(BUCKETS)
    assert (store.unkeyed, store.saved, store.entries()) == (len(BUCKETS), 0, [])
    np.testing.assert_allclose(_run(step, BUCKETS.key(1, 3))[1], _oracle(BUCKETS.key(1, 3))[1], rtol=1e-6)


def test_an_entry_that_does_not_load_is_compiled_and_replaced(tmp_path):
    _capture(ExecutableStore(tmp_path))
    broken, foreign = ExecutableStore(tmp_path).entries()[:2]
    broken.write_bytes(b"not a pickle")
    # An intact program for other arguments under this key: rejected by its argument check.
    other = tmp_path / "other"
    capture(
        _step, BucketSet(graph_walk="tiny", batch_sizes=(4,), token_counts=(9,)), _abstract,
        static_kwargs={"scale": 0.5}, donate_argnums=0, progress=False, store=ExecutableStore(other),
    )  # fmt: skip
    foreign.write_bytes(ExecutableStore(other).entries()[0].read_bytes())
    store = ExecutableStore(tmp_path)
    step, compiled = _capture(store)
    assert (compiled, store.rejected, store.loaded, store.saved) == (2, 2, len(BUCKETS) - 2, 2)
    for bucket in BUCKETS:
        np.testing.assert_allclose(_run(step, bucket)[1], _oracle(bucket)[1], rtol=1e-6)
    store = ExecutableStore(tmp_path)
    assert _capture(store)[1] == 0
    assert store.loaded == len(BUCKETS)


def test_an_entry_copied_onto_another_programs_key_is_refused(tmp_path):
    """Programs of the same arguments for two scales: one's entry copied over the other's file loads
    nothing (it would compute with the wrong scale), so that program is compiled and stored again."""
    half, quarter = ExecutableStore(tmp_path / "half"), ExecutableStore(tmp_path / "quarter")
    _capture(half)
    _capture(quarter, scale=0.25)
    for source, target in zip(half.entries(), quarter.entries(), strict=True):
        target.write_bytes(source.read_bytes())
    store = ExecutableStore(tmp_path / "quarter")
    step, compiled = _capture(store, scale=0.25)
    assert (compiled, store.rejected, store.loaded, store.saved) == (
        len(BUCKETS),
        len(BUCKETS),
        0,
        len(BUCKETS),
    )
    for bucket in BUCKETS:
        np.testing.assert_allclose(_run(step, bucket)[1], _oracle(bucket, 0.25)[1], rtol=1e-6)


def test_an_entry_that_cannot_be_written_is_skipped_and_leaves_no_partial_file(tmp_path):
    """A directory where an entry belongs: that program runs compiled, is not stored, and nothing raises."""
    _capture(ExecutableStore(tmp_path))
    blocked = ExecutableStore(tmp_path).entries()[0]
    blocked.unlink()
    blocked.mkdir()
    store = ExecutableStore(tmp_path)
    step, compiled = _capture(store)
    assert (compiled, store.rejected, store.loaded, store.saved) == (1, 1, len(BUCKETS) - 1, 0)
    assert not list(tmp_path.glob("*.partial"))
    for bucket in BUCKETS:
        np.testing.assert_allclose(_run(step, bucket)[1], _oracle(bucket)[1], rtol=1e-6)


def test_a_program_from_jaxs_persistent_cache_is_not_stored(tmp_path):
    """XLA:CPU serializes an executable it loaded from JAX's persistent cache without its kernels: stored,
    it loaded and then failed at run time ("NOT_FOUND: Function ... not found")."""
    from mstar_jax.compile import disable_persistent_cache, enable_persistent_cache

    enable_persistent_cache(str(tmp_path / "jax"), min_compile_secs=0.0, min_entry_size_bytes=-1)
    try:
        _capture(None)  # compiled, into JAX's cache
        store = ExecutableStore(tmp_path / "store")
        step, _ = _capture(store)  # every bucket from JAX's cache
        assert step.report.cache_hits == len(BUCKETS)
        assert (store.saved, store.entries()) == (0, [])
    finally:
        disable_persistent_cache()
    store = ExecutableStore(tmp_path / "store")
    step, compiled = _capture(store)  # nothing stored to load: compiled, and stored now
    assert (compiled, store.loaded, store.saved) == (len(BUCKETS), 0, len(BUCKETS))
    step, compiled = _capture(ExecutableStore(tmp_path / "store"))
    assert compiled == 0
    for bucket in BUCKETS:  # the loaded programs run
        np.testing.assert_allclose(_run(step, bucket)[1], _oracle(bucket)[1], rtol=1e-6)


def test_a_fresh_process_loads_what_another_stored(tmp_path):
    """A second start for real: a new interpreter, nothing in memory, 0 programs compiled."""
    _capture(ExecutableStore(tmp_path))
    child = textwrap.dedent(
        f"""
        import json
        from tests.compile.test_store import BUCKETS, ExecutableStore, _capture, _run
        store = ExecutableStore({str(tmp_path)!r})
        step, compiled = _capture(store)
        print(json.dumps({{"compiled": compiled, "loaded": store.loaded,
                          "out": _run(step, BUCKETS.key(2, 5))[1].tolist()}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["compiled"], found["loaded"]) == (0, len(BUCKETS))
    np.testing.assert_allclose(found["out"], _oracle(BUCKETS.key(2, 5))[1], rtol=1e-6)


def test_a_mesh_is_described_by_its_axes_and_devices():
    """A mesh's repr leaves its devices out; programs for the same axes over other devices differ."""
    devices = jax.devices()[:1]
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    assert describe(mesh) == f"Mesh({{'data': 1}}, axis_types={mesh.axis_types}, devices={[devices[0].id]})"
    assert describe(mesh) != describe(jax.sharding.Mesh(np.array(devices), ("model",)))


def test_a_store_needs_a_directory():
    with pytest.raises(ValueError, match=r"directory='' must be a non-empty path"):
        ExecutableStore("")


def test_a_stored_program_loads_onto_the_devices_it_was_compiled_for():
    """On a host of 8 devices, a one-device program (on device 0, or another) and a program on a mesh
    whose devices are not in id order each load back onto their own devices and compute what they
    compiled to (by default JAX would load them onto every device: the first fails when run, the last
    aborts the process)."""
    from tests.simulated_devices import run_child

    found = run_child(Path(__file__).with_name("store_devices_child.py"), devices=8, timeout=300)
    x = np.arange(32, dtype=np.float64).reshape(8, 4) / 9
    want = x * (1.0 + np.tanh(x).sum())
    assert set(found) == {"one device", "another single device", "mesh in reversed order"}
    for name, case in found.items():
        assert case["stores"] == [[1, 0, 0], [0, 1, 0]], name  # compiled and saved, then loaded
        assert case["equal"], name
        np.testing.assert_allclose(case["out"], want, rtol=1e-6, err_msg=name)


# The same name (`<lambda>`), bytecode and constants: only the name each reads differs.
_SQUASHES = {"sin": lambda x: jnp.sin(x), "cos": lambda x: jnp.cos(x)}


def test_two_functions_that_differ_only_in_a_name_they_read_are_two_programs(tmp_path):
    """A store once keyed a function by its bytecode and constants alone: a second capture with
    `cos` loaded the program compiled with `sin` and computed sines."""
    _capture(ExecutableStore(tmp_path), squash=_SQUASHES["sin"])
    store = ExecutableStore(tmp_path)
    step, compiled = _capture(store, squash=_SQUASHES["cos"])
    assert (compiled, store.loaded) == (len(BUCKETS), 0)
    bucket = BUCKETS.key(2, 5)
    x = np.arange(bucket.bs * bucket.num_tokens, dtype=np.float64).reshape(bucket.bs, -1) / 7
    state = 1.0 + np.cos(x * 0.5).sum()
    np.testing.assert_allclose(_run(step, bucket)[1], x * state, rtol=1e-6)


def _power(x, power=1):
    return x**power


def _keyword_power(x, *, power=1):
    return x**power


def _key(tmp_path, **static):
    bucket = BUCKETS.key(1, 3)
    return ExecutableStore(tmp_path).key(
        _step, bucket, _abstract(bucket), static_kwargs={"scale": 0.5, **static}, donate_argnums=(0,)
    )


def _with_defaults(fn, defaults=None, kwdefaults=None):
    copy = type(fn)(fn.__code__, fn.__globals__, fn.__name__, defaults, fn.__closure__)
    copy.__kwdefaults__ = kwdefaults
    return copy


def _arrays_differing_in_an_elided_element(xp):
    one = np.zeros(4096, np.float32)
    other = one.copy()
    other[2048] = 1.0  # `repr` shows "..." in its place
    return xp.asarray(one), xp.asarray(other)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(lambda: (_with_defaults(_power, (1,)), _with_defaults(_power, (3,))), id="a default"),
        pytest.param(
            lambda: (
                _with_defaults(_keyword_power, kwdefaults={"power": 1}),
                _with_defaults(_keyword_power, kwdefaults={"power": 3}),
            ),
            id="a keyword-only default",
        ),
        pytest.param(lambda: _arrays_differing_in_an_elided_element(np), id="a NumPy array"),
        pytest.param(lambda: _arrays_differing_in_an_elided_element(jnp), id="a JAX array"),
    ],
)
def test_values_a_repr_would_confuse_get_different_keys(tmp_path, values):
    one, other = values()
    assert _key(tmp_path, squash=one) != _key(tmp_path, squash=other)
    assert _key(tmp_path, squash=one) == _key(tmp_path, squash=values()[0])


def test_a_set_is_described_in_the_same_order_in_every_process():
    assert describe({"b", "c", "a"}) == "set('a', 'b', 'c')"
    assert describe(frozenset({3, 1, 2})) == "frozenset(1, 2, 3)"


@pytest.mark.parametrize(
    "setting",
    ["jax_default_matmul_precision", "jax_threefry_partitionable", "XLA_FLAGS", "LIBTPU_INIT_ARGS"],
)
def test_a_jax_setting_or_compiler_flag_is_part_of_the_key(tmp_path, monkeypatch, setting):
    before = _key(tmp_path)
    if setting.startswith("jax_"):
        old = jax.config.values[setting]
        new = "highest" if setting == "jax_default_matmul_precision" else not old
        jax.config.update(setting, new)
        try:
            after = _key(tmp_path)
        finally:
            jax.config.update(setting, old)
    else:
        with monkeypatch.context() as patch:
            patch.setenv(setting, "--xla_some_flag=1")
            after = _key(tmp_path)
    assert before != after
    assert _key(tmp_path) == before


@pytest.mark.parametrize("module", ["steps", "__init__"])
def test_an_edit_to_a_helper_in_the_steps_package_is_another_program(tmp_path, monkeypatch, module):
    """A step's helpers in its own package are part of the program, for a step in a module of the
    package or in its `__init__.py`; the step's module alone was once."""
    name = f"helper_package_for_store_{module.strip('_')}"
    package = tmp_path / name
    package.mkdir()
    step_source = "from .helpers import squash\n\ndef step(state, x):\n    return state, squash(x)\n"
    (package / "__init__.py").write_text(step_source if module == "__init__" else "")
    (package / "helpers.py").write_text("def squash(x):\n    return x * 2\n")
    if module == "steps":
        (package / "steps.py").write_text(step_source)
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = importlib.import_module(f"{name}.steps" if module == "steps" else name)

    def key():
        store_module._source_digest.cache_clear()
        store_module._step_files.cache_clear()
        bucket = BUCKETS.key(1, 3)
        return ExecutableStore(tmp_path / "store").key(
            steps.step, bucket, _abstract(bucket), static_kwargs={}, donate_argnums=()
        )

    before = key()
    (package / "helpers.py").write_text("def squash(x):\n    return x * 3\n")
    assert key() != before
    (package / "helpers.py").write_text("def squash(x):\n    return x * 2\n")
    assert key() == before


def test_a_function_read_from_a_file_outside_the_library_is_keyed_by_that_file(tmp_path, monkeypatch):
    """A retention policy reading a module constant: an edit to the constant is another program."""
    (tmp_path / "policy_for_store.py").write_text("SCALE = 2\n\ndef policy(x):\n    return x * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from policy_for_store import policy

    before = describe(policy)
    (tmp_path / "policy_for_store.py").write_text("SCALE = 3\n\ndef policy(x):\n    return x * SCALE\n")
    store_module._source_digest.cache_clear()
    assert describe(policy) != before


def test_the_same_sources_in_another_folder_have_the_same_digest(tmp_path):
    """Another checkout, container mount or host: the same code, the same keys."""
    for folder in ("one", "two/deeper"):
        (tmp_path / folder / "pkg").mkdir(parents=True)
        (tmp_path / folder / "pkg" / "a.py").write_text("A = 1\n")
        (tmp_path / folder / "pkg" / "b.py").write_text("B = 2\n")
    files = lambda folder, *names: tuple(str(tmp_path / folder / "pkg" / n) for n in names)  # noqa: E731
    digest = store_module._source_digest
    assert digest(files("one", "a.py", "b.py")) == digest(files("two/deeper", "a.py", "b.py"))
    (tmp_path / "two/deeper/pkg/c.py").write_text("A = 1\n")  # a's bytes under another name
    assert digest(files("one", "a.py", "b.py")) != digest(files("two/deeper", "c.py", "b.py"))


def test_a_set_in_a_functions_code_is_described_the_same_under_every_hash_seed():
    """`x in {...}` compiles to a frozenset constant, whose repr follows the process's string hashes."""
    code = (
        "from mstar_jax.compile.store import describe\n"
        "print(describe(lambda word: word in {'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'}))\n"
    )
    described = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env
        )
        described.add(done.stdout.strip().splitlines()[-1])
    assert len(described) == 1, described


def test_an_array_of_objects_gives_no_key(tmp_path):
    """Its bytes are pointers, another process's differ: no key would ever match."""
    assert _key(tmp_path, squash=np.array(["a", 1], dtype=object)) is None
