"""`benchmarks/gemma_step_parts.py`: its products chain against the float64 oracle (and the check catching a
wrong product), a quick tiny run's table, and its flags refused before any work."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import gemma_step_parts as parts
from benchmarks.gemma_decode import TINY
from mstar_jax.models.gemma3.model import Gemma3


@pytest.fixture(scope="module")
def tiny_inputs():
    model = Gemma3(TINY, rngs=nnx.Rngs(0))
    embed_t = jax.random.normal(jax.random.key(1), model.embed_t[...].shape)
    x = jax.random.normal(jax.random.key(2), (1, TINY.d_model))
    return parts.layer_weights(model), embed_t, x


def test_products_chain_matches_an_independent_float64_oracle(tiny_inputs):
    weights, embed_t, x = tiny_inputs
    _, logits = jax.jit(lambda w, e, h: parts.products(TINY, w, e, h))(weights, embed_t, x)
    # Written apart from `products`: the blocks' projections one by one, in float64.
    h = np.asarray(x, np.float64)
    rms = lambda v: v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-6)  # noqa: E731
    queries = TINY.num_heads * TINY.head_dim
    for wqkv, wo, gate_up, down in (tuple(np.asarray(w, np.float64) for w in ws) for ws in weights):
        h = h + np.einsum("bi,oi->bo", np.einsum("bi,oi->bo", rms(h), wqkv)[:, :queries], wo)
        gate, up = np.split(np.einsum("bi,oi->bo", rms(h), gate_up), 2, axis=-1)
        gelu = gate * 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        h = h + np.einsum("bi,oi->bo", gelu * up, down)
    want = rms(h) @ np.asarray(embed_t, np.float64)
    np.testing.assert_allclose(np.asarray(logits, np.float64), want, rtol=1e-4, atol=1e-4)
    parts.check_products(TINY, weights, embed_t, x)


def test_check_products_refuses_a_chain_that_drifts_from_the_oracle(tiny_inputs, monkeypatch):
    weights, embed_t, x = tiny_inputs
    honest = parts.products

    def drifting(config, weights, embed_t, x, *, xp=jnp):
        token, logits = honest(config, weights, embed_t, x, xp=xp)
        return (token, logits * 1.01) if xp is jnp else (token, logits)

    monkeypatch.setattr(parts, "products", drifting)
    with pytest.raises(AssertionError):
        parts.check_products(TINY, weights, embed_t, x)


@pytest.mark.slow
def test_quick_tiny_run_prints_every_case_as_a_share_of_the_step(capsys):
    parts.main(["--quick", "--tiny", "--prompt", "8", "--repeats", "1", "--number", "1"])
    out = capsys.readouterr().out
    assert "[--quick: 8-token prompt, 1 repeats of 1 calls; not a full run's figures]" in out
    assert "products chain: equal to the float64 oracle" in out
    rows = [line for line in out.splitlines() if re.match(r"\| [a-z]", line) and "ms a step" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(parts.CASES)
    for row in rows:
        ms, share = (float(re.match(r"\s*([\d.]+)", cell).group(1)) for cell in row.split(" | ")[1:3])
        assert ms > 0
        assert share == pytest.approx(ms / float(rows[0].split(" | ")[1].split()[0]), rel=0.06, abs=0.01)
    assert rows[0].split(" | ")[2].startswith("1.00")


@pytest.mark.parametrize(
    "argv",
    [["--repeats", "0"], ["--repeats", "nan"], ["--number", "-2"], ["--prompt", "1.5"], ["--prompt", "x"]],
)
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parts.main(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err
