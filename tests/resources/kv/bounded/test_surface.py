"""The bounded cache's package is its public surface: a serving stack imports the resource and the
per-layer op from `mstar_jax.resources.kv.bounded`, and type checkers read the annotations (PEP 561)."""

from __future__ import annotations

import importlib.resources
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from functools import partial
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import mstar_jax.resources.kv.bounded as bounded
from mstar_jax.compile import CombinedRows
from mstar_jax.resources.kv.bounded import BoundedKVConfig, BoundedKVSpec, BoundedKVStep, SinkWindow, pad_step
from mstar_jax.resources.kv.bounded import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.attention import attend
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import PAD, BucketKey, Segment, SlotLease, StepContext, StepNotAdmittedError

ROOT = pathlib.Path(__file__).resolve().parents[4]
README = ROOT / "README.md"


def test_the_manager_and_attend_are_the_packages_own():
    assert bounded.attend is attend
    assert bounded.BoundedKVManager is BoundedKVManager
    for name in bounded.__all__:
        assert getattr(bounded, name).__module__.startswith("mstar_jax.resources.kv.bounded.")


# What declaring a resource must not load: the builder and its kernels (the seed's `resource_class`
# contract), nor anything that builds on the resources.
HEAVY = (
    "kernels_pallas",
    "mstar_jax.resources.kv.bounded.manager",
    "mstar_jax.resources.kv.bounded.attention",
    "mstar_jax.resources.kv.bounded.cache",
    "mstar_jax.models",
    "mstar_jax.engine",
)


def _run_fresh(code: str) -> None:
    """Run `code` in a new interpreter (this one has imported everything already); fail with its stderr."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_declaring_a_spec_imports_no_manager_kernel_or_model():
    _run_fresh(f"""
        import sys
        from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, SinkWindow
        from mstar_jax.resources.spec import apply_yaml_overrides, resolve_spec_dependencies

        config = BoundedKVConfig(
            num_layers=2, num_heads=2, head_dim=4, rows_per_request=1, max_source_len=8,
            retention=SinkWindow(2, 4),
        )
        specs = [BoundedKVSpec("kv", {{"talker"}}, config)]
        apply_yaml_overrides(specs, {{"resources": {{"kv": {{"max_slots": 4}}}}}})
        resolve_spec_dependencies(specs)
        loaded = sorted(
            name for name in sys.modules
            if any(name == heavy or name.startswith(heavy + ".") for heavy in {HEAVY!r})
        )
        assert not loaded, f"declaring a spec imported {{loaded}}"

        # The builder comes on demand, through the property, and is the package's own.
        import mstar_jax.resources.kv.bounded as bounded
        builder = specs[0].resource_class
        assert "mstar_jax.resources.kv.bounded.manager" in sys.modules
        assert builder is bounded.BoundedKVManager
        assert builder.__module__ == "mstar_jax.resources.kv.bounded.manager"
    """)


def test_the_package_exports_lazily_and_lists_them():
    _run_fresh("""
        import sys
        import mstar_jax.resources.kv.bounded as bounded

        assert "mstar_jax.resources.kv.bounded.manager" not in sys.modules
        assert set(bounded.__all__) <= set(dir(bounded))  # autodoc and completion see them before use
        from mstar_jax.resources.kv.bounded import attend, pad_step
        assert attend.__module__ == "mstar_jax.resources.kv.bounded.attention"
        assert "mstar_jax.resources.kv.bounded.manager" not in sys.modules  # one name, one submodule
        namespace = {}
        exec("from mstar_jax.resources.kv.bounded import *", namespace)
        assert set(bounded.__all__) <= set(namespace)
        try:
            bounded.no_such_name
        except AttributeError as error:
            assert "no_such_name" in str(error)
        else:
            raise AssertionError("an unknown name must raise AttributeError")
    """)


def test_both_packages_are_marked_typed():
    for package in ("mstar_jax", "kernels_pallas"):
        assert importlib.resources.files(package).joinpath("py.typed").is_file()


# -- driving the cache without engine plumbing -------------------------------------------------------

H, G, D = 4, 2, 8
CONFIG = BoundedKVConfig(
    num_layers=1, num_heads=G, head_dim=D, rows_per_request=1, max_source_len=4,
    retention=SinkWindow(4, 16), max_slots=3,
)  # fmt: skip


def manager_with(*rids: str) -> BoundedKVManager:
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, CONFIG), num_sources=1)
    for rid in rids:
        manager.ingest_request(rid)
    return manager


def test_a_step_needs_no_context():
    step = BoundedKVStep(
        (Segment("a", "main", 2), Segment(f"{PAD}0", "main", 0), Segment("b", "main", 1)),
        {"a": Pos(0, 0), "b": Pos(0, 0)},
    )
    ctx = StepContext.for_step(step)
    assert (ctx.request_ids, tuple(ctx.padded_request_ids)) == (("a", "b"), ("a", "b", f"{PAD}0"))
    assert (ctx.graph_walk, ctx.slot, ctx.capture, ctx.slot_lease) == ("eager", 0, False, None)
    assert ctx.is_padding_row(f"{PAD}0")
    assert not ctx.is_padding_row("a")
    bucket = BucketKey("decode", 4, 2)
    leased = StepContext.for_step(step, bucket)
    assert (leased.graph_walk, leased.slot_lease) == ("decode", SlotLease(0, bucket))
    # The engine's way, with a context built by hand, plans the same table.
    by_hand = StepContext(["a", "b"], "decode", 0, capture=False)
    by_hand.set_padded_rids(["a", "b", f"{PAD}0"])
    engine, bare = manager_with("a", "b"), manager_with("a", "b")
    assert engine.admit(step, by_hand).ok
    assert bare.admit(step).ok
    np.testing.assert_array_equal(engine.plan(step, by_hand).table, bare.plan(step).table)
    bare.commit(step)
    assert (bare.written("a"), bare.written("b")) == (2, 1)
    with pytest.raises(StepNotAdmittedError):  # the default context guards commit as the engine's does
        bare.commit(step)
    assert (bare.written("a"), bare.written("b")) == (2, 1)


def test_pad_step_lays_groups_out_as_the_module_draws_them():
    step = BoundedKVStep(
        (Segment("a", "main", 1), Segment("b", "main", 1), Segment("c", "main", 4)),
        {rid: Pos(0, 0) for rid in "abc"},
        {"c": 4},
    )
    bucket = BucketKey("mixed", 4, 4, CombinedRows(4, 2))
    padded = pad_step(step, bucket, groups=((2, 4), (1, 2)))
    ids = [seg.request_id for seg in padded.step.segments]
    assert ids == ["a", "b", f"{PAD}0", f"{PAD}1", "c", f"{PAD}2"]
    assert [seg.span for seg in padded.step.segments] == [1, 1, 0, 0, 4, 0]
    assert dict(padded.rows) == {"a": 0, "b": 1, "c": 4}
    assert padded.num_rows == 6
    assert padded.bucket == bucket
    assert padded.ctx.slot_lease == SlotLease(0, bucket)
    assert padded.ctx.request_ids == ("a", "b", "c")
    assert padded.step.positions == step.positions
    assert padded.step.step_tokens == {"c": 4}
    unpadded = pad_step(step, BucketKey("prefill", 2, 4), pad=False)  # a mesh: bs counts a shard's rows
    assert unpadded.step.segments == step.segments
    assert unpadded.ctx.slot_lease.bucket.bs == 2


def test_pad_step_refuses_what_no_bucket_row_can_hold():
    step = BoundedKVStep(tuple(Segment(r, "main", 1) for r in "abc"), {r: Pos(0, 0) for r in "abc"})
    with pytest.raises(ValueError, match=r"group 0 has 3 rows but bucket decode\[bs=2,tokens=1\] holds 2; "):
        pad_step(step, BucketKey("decode", 2, 1))
    with pytest.raises(ValueError, match=r"groups=\[\(1, 2\), \(1, 2\)\] cover 2 rows; the step has 3"):
        pad_step(step, BucketKey("decode", 4, 1), groups=((1, 2), (1, 2)))
    with pytest.raises(ValueError, match=r"padding ids \(prefix PAD\)"):
        pad_step(BoundedKVStep((Segment(f"{PAD}0", "main", 0),)), BucketKey("decode", 2, 1))


def test_padded_arrays_hold_each_row_where_the_plan_has_it():
    step = BoundedKVStep((Segment("a", "main", 1), Segment("b", "main", 3)), {"a": Pos(0, 0), "b": Pos(0, 0)})
    padded = pad_step(step, BucketKey("walk", 4, 3), groups=((1, 2), (1, 2)))  # rows a 0, b 2
    ids = padded.pad([np.array([7]), np.array([1, 2, 3])], fill=-1)
    np.testing.assert_array_equal(ids, [[7, -1, -1], [-1, -1, -1], [1, 2, 3], [-1, -1, -1]])
    # [B * R, T, ...] with R = 2 rows per request: each request's two rows move together.
    q = np.arange(2 * 2 * 2 * 1, dtype=np.float32).reshape(4, 2, 1)
    out = padded.pad(q, fill=np.nan)
    assert out.shape == (8, 3, 1)
    np.testing.assert_array_equal(out[[0, 1, 4, 5], :2], q)
    assert np.isnan(out[[2, 3, 6, 7]]).all()
    assert np.isnan(out[:, 2]).all()
    np.testing.assert_array_equal(padded.unpad(out, rows_per_request=2)[:, :2], q)
    np.testing.assert_array_equal(padded.unpad(ids), [[7, -1, -1], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"shape \(4,\); bucket walk\[bs=4,tokens=3\] holds 3"):
        padded.pad([np.array([1]), np.arange(4)])
    with pytest.raises(ValueError, match=r"holds 1 arrays; the step has 2 requests"):
        padded.pad([np.array([1])])
    with pytest.raises(ValueError, match=r"values.shape=\(3, 2, 1\) must be \[B \* R, T, ...\] with B=2"):
        padded.pad(q[:3])
    with pytest.raises(ValueError, match=r"T <= 3"):
        padded.pad(np.zeros((2, 4)))


def test_the_engines_declare_pads_with_pad_step():
    """`engine.batch.declare` pads a talker batch through `pad_step` (the serving layer's `declare`):
    decode rows then prefill rows of a combined bucket, each group padded to its own rows; no padding on
    a mesh (pad=False)."""
    from mstar_jax.engine.batch import declare

    def row(rid: str, span: int, decode: bool):
        voice = SimpleNamespace(position=lambda written: Pos(3, written, 1))
        stream = SimpleNamespace(request_id=rid, request=SimpleNamespace(voice=voice))
        return SimpleNamespace(stream=stream, span=span, decode=decode)

    rows = [row("p", 4, False), row("d", 1, True), row("e", 1, True)]
    mixed = BucketKey("talker_mixed", 5, 4, CombinedRows(3, 2))
    prefill = BucketKey("talker_prefill", 4, 4)
    expected = {
        (mixed, True): ["d", "e", PAD + "0", "p", PAD + "1"],
        (prefill, True): ["p", "d", "e", PAD + "0"],
        (mixed, False): ["d", "e", "p"],
        (prefill, False): ["p", "d", "e"],
    }
    for (bucket, pad), ids in expected.items():
        declared, ordered = declare(
            bucket, rows, keys=("talker_kv",), pad=pad,
            positions=lambda streams: [s.request.voice.position(2) for s in streams],
        )  # fmt: skip
        step, ctx = declared.padded.step, declared.padded.ctx
        assert declared.sub.steps == {"talker_kv": step}
        assert declared.sub.ctx is ctx
        assert [seg.request_id for seg in step.segments] == ids
        assert [r.stream.request_id for r in ordered] == [i for i in ids if not i.startswith(PAD)]
        assert [seg.span for seg in step.segments] == [{"p": 4, "d": 1, "e": 1}.get(i, 0) for i in ids]
        assert step.positions == {i: Pos(3, 2, 1) for i in ("p", "d", "e")}
        assert list(ctx.padded_request_ids) == [i for i in ids if not i.startswith(PAD)] + [
            i for i in ids if i.startswith(PAD)
        ]
        assert (ctx.graph_walk, ctx.slot_lease.bucket) == (bucket.graph_walk, bucket)


# -- the device state passed and returned ------------------------------------------------------------


def run_steps(manager: BoundedKVManager, cache, rng) -> tuple[list[np.ndarray], object]:
    outs = []
    for written, span in ((0, 3), (3, 1), (4, 1)):
        step = BoundedKVStep((Segment("a", "main", span),), {"a": Pos(0, written)})
        assert manager.admit(step).ok
        q = rng.standard_normal((1, span, H, D)).astype(np.float32)
        k = rng.standard_normal((1, span, G, D)).astype(np.float32)
        out, cache = STEP(cache, manager.bank, manager.plan(step), q=q, k=k, v=k)
        manager.commit(step)
        outs.append(np.asarray(out))
    return outs, cache


STEP = jax.jit(partial(attend, layer=0, config=CONFIG, implementation="xla"), donate_argnums=0)


def test_a_caller_can_hold_the_device_state():
    functional, holding = manager_with("a"), manager_with("a")
    assert jax.tree.map(lambda x: (x.shape, x.dtype), functional.abstract_cache()) == jax.tree.map(
        lambda x: (x.shape, x.dtype), holding.cache
    )
    cache = functional.take_cache()
    with pytest.raises(
        RuntimeError, match=r"the caller holds the device cache \(take_cache\(\) handed it out\)"
    ):
        functional.cache  # noqa: B018 (the property refuses: no stale zeros for offload to read)
    outs, cache = run_steps(functional, cache, np.random.default_rng(1))
    held, holding.cache = run_steps(holding, holding.cache, np.random.default_rng(1))
    for got, want in zip(outs, held, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(holding.cache), strict=True):
        np.testing.assert_array_equal(got, want)
    functional.cache = cache  # handed back: offload and reload work on it
    before = np.asarray(cache.k[0])[functional.slot_of("a")]
    assert functional.offload("a") > 0
    assert functional.reload("a")
    np.testing.assert_array_equal(np.asarray(functional.cache.k[0])[functional.slot_of("a")], before)
    functional.take_cache()
    with pytest.raises(RuntimeError, match=r"give it back with manager.cache = cache"):
        functional.take_cache()  # one holder at a time


# -- the README's integration ------------------------------------------------------------------------


def test_readme_integration_runs_and_attends_what_the_stream_holds():
    from tests.resources.kv.bounded.test_step_width import oracle

    text = README.read_text().split("## Use the cache from your own serving stack", 1)[1]
    block = re.search(r"```python\n(.*?)```", text, flags=re.S).group(1)
    names = {"__name__": "readme"}
    exec(compile(block, str(README), "exec"), names)
    out, manager = names["out"], names["manager"]
    # Replay the example's draws: a prefill of 3 (a) and 5 (b) tokens, then one decode token each.
    rng, heads, kv_heads, dim = np.random.default_rng(0), 4, 2, 16
    draws = {}
    for tokens in ((3, 5), (1, 1)):
        q = [rng.standard_normal((n, heads, dim), np.float32) for n in tokens]
        k = [rng.standard_normal((n, kv_heads, dim), np.float32) for n in tokens]
        draws[tokens] = (q, k)
    assert out.shape == (2, 8, heads, dim)
    (_, k1), (q2, k2) = draws[(3, 5)], draws[(1, 1)]
    for b in range(2):
        keys = np.concatenate([k1[b], k2[b]])
        np.testing.assert_allclose(
            out[b, :1], oracle(keys, keys, q2[b], retained=len(k1[b])), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_array_equal(out[b, 1:], 0)
    assert (manager.written("a"), manager.written("b")) == (4, 6)
    assert manager.free_slots == 2
