"""The streaming TTS model over the bounded caches against dense full-history references.

The references keep every stream entry a request ever wrote (voice included) in one array and attend
it through a mask built from the retention definition (docs/design.md §3): they never see a slot, a ring or a
plan table. Then: a combined decode+prefill step equals running each row alone.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.models.streaming_tts.voices import VoiceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVStep
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.step import BucketKey, Segment, SlotLease, StepContext
from tests.models.reference import make_reference_flow, make_reference_talker, voice_prompt

TINY = StreamingTTSConfig(
    text_vocab_size=16, codec_vocab_size=16, d_model=32, talker_layers=2, talker_heads=2, talker_kv_heads=1,
    talker_head_dim=8, talker_ffn_dim=32, min_voice_frames=3, max_voice_frames=6, talker_sink_extra=2,
    talker_window=6, query_window=7, flow_d_model=16, flow_layers=1, flow_heads=2, flow_head_dim=8,
    flow_chunk=4, flow_window=5, flow_steps=2, mel_bins=4, max_slots=4,
)  # fmt: skip
SEED = np.uint32(11)


@pytest.fixture(scope="module")
def setup():
    model = StreamingTTSModel(TINY)
    specs = {spec.resource_key: spec for spec in TINY.resource_specs()}
    talker, flow = (
        BoundedKVManager(specs["talker_kv"], num_sources=2),
        BoundedKVManager(specs["flow_kv"], num_sources=2),
    )
    bank = VoiceBank(model, talker, flow)
    voice = bank.add(1, frames=5, seed=3)
    steps = {
        "talker": jax.jit(model.talker_step, donate_argnums=1),
        "mixed": jax.jit(model.talker_combined_step, donate_argnums=1),
        "flow": jax.jit(model.flow_step, donate_argnums=1),
    }
    return model, talker, flow, voice, steps


def run_step(manager, fn, params, rids, positions, spans, arrays, bucket_tokens):
    """Admit, plan (padded to `bucket_tokens`), run `fn` and commit one step for `rids`."""
    step = BoundedKVStep(
        tuple(Segment(r, "main", s) for r, s in zip(rids, spans, strict=True)),
        dict(zip(rids, positions, strict=True)),
        dict(zip(rids, spans, strict=True)),
    )
    ctx = StepContext(list(rids), "walk", 0, capture=False)
    ctx.slot_lease = SlotLease(0, BucketKey("walk", len(rids), bucket_tokens))
    assert manager.admit(step, ctx).ok
    plan = manager.plan(step, ctx)
    manager.cache, out = fn(params, manager.cache, manager.bank, plan, *arrays)
    manager.commit(step, ctx)
    return jax.device_get(out)


def pad(tokens, width):
    out = np.zeros(width, np.int32)
    out[: len(tokens)] = tokens
    return out


# -- talker -----------------------------------------------------------------------------------------


def test_talker_matches_dense_reference_through_prefill_and_past_the_wrap(setup):
    model, talker_kv, _, voice, steps = setup
    codes_voice, _, _ = voice_prompt(TINY, 3, voice.frames)
    text = np.array([3, 1, 4, 1, 5, 9, 2], np.int32)
    prefill = [*text, model.bos]  # 8 tokens: chunks of 4 and 3+1 (the second padded to the 4 bucket)
    chunks = [prefill[:4], prefill[4:7], prefill[7:]]
    decode_steps = 22  # window 6: the ring wraps several times
    total = voice.frames + len(prefill) + decode_steps

    # Bounded cache, through the manager.
    rid = "talk"
    talker_kv.ingest_request(rid)
    written, got = 0, []
    for chunk in chunks:
        args = (pad(chunk, 4)[None], np.array([len(chunk)], np.int32), np.array([SEED]))
        code = run_step(
            talker_kv,
            steps["talker"],
            model.talker_params,
            [rid],
            [voice.position(written)],
            [len(chunk)],
            args,
            4,
        )
        written += len(chunk)
    got.append(int(code[0]))
    for _ in range(decode_steps):
        args = (model.code_tokens([[got[-1]]]), np.array([1], np.int32), np.array([SEED]))
        code = run_step(
            talker_kv, steps["talker"], model.talker_params, [rid], [voice.position(written)], [1], args, 1
        )
        written += 1
        got.append(int(code[0]))
    talker_kv.remove_request(rid)

    # Dense reference over the whole history (voice computed unpadded, at its own length).
    tk, tv = model.talker_voice_kv(
        model.talker_params, model.code_tokens(codes_voice), jnp.int32(voice.frames)
    )
    shape = (TINY.talker_layers, TINY.talker_kv_heads, total + 4, TINY.talker_head_dim)
    hist_k = jnp.zeros(shape).at[:, :, : voice.frames].set(tk[:, 0])
    hist_v = jnp.zeros(shape).at[:, :, : voice.frames].set(tv[:, 0])
    sink, window, _ = model.talker_kv.retention_for(voice.frames)
    ref_step = make_reference_talker(model, total)
    n, want = voice.frames, []
    for chunk in [*chunks, *([None] * decode_steps)]:
        tokens = np.asarray(chunk if chunk is not None else model.code_tokens([want[-1]]), np.int32)
        m = len(tokens)
        hist_k, hist_v, code = ref_step(
            model.talker_params, hist_k, hist_v, pad(tokens, 4)[None], m, n, sink, window, SEED
        )
        n += m
        if chunk is None or chunk is chunks[-1]:
            want.append(int(code))
    assert got == want


# -- flow -------------------------------------------------------------------------------------------


def test_flow_matches_dense_reference_with_reverse_order_and_cfg_rows(setup):
    model, _, flow_kv, voice, steps = setup
    codes_voice, mel_voice, noise_voice = voice_prompt(TINY, 3, voice.frames)
    rng = np.random.default_rng(5)
    lengths = [4, 4, 4, 3]  # the window (5) cuts chunks; the last chunk is short (padded to 4)
    chunks = [rng.integers(0, TINY.codec_vocab_size, n).astype(np.int32) for n in lengths]
    total = voice.frames + sum(lengths)

    rid = "flow"
    flow_kv.ingest_request(rid)
    written, got = 0, []
    for chunk in chunks:
        args = (pad(chunk, 4)[None], np.array([SEED]))
        mel, samples = run_step(
            flow_kv, steps["flow"], model.flow_params, [rid], [voice.position(written)], [len(chunk)], args, 4
        )
        written += len(chunk)
        assert np.isfinite(samples).all()
        got.append(mel[0, : len(chunk)])
    flow_kv.remove_request(rid)

    fk, fv = model.flow_voice_kv(
        model.flow_params, codes_voice, mel_voice, noise_voice, jnp.int32(voice.frames)
    )
    shape = (TINY.flow_layers, 2, TINY.flow_heads, total + 4, TINY.flow_head_dim)
    hist_k = jnp.zeros(shape).at[:, :, :, : voice.frames].set(fk)
    hist_v = jnp.zeros(shape).at[:, :, :, : voice.frames].set(fv)
    sink, window, _ = model.flow_kv.retention_for(voice.frames)
    ref_chunk = make_reference_flow(model, total)
    n = voice.frames
    for chunk, mel in zip(chunks, got, strict=True):
        m = len(chunk)
        hist_k, hist_v, want = ref_chunk(
            model.flow_params, hist_k, hist_v, pad(chunk, 4)[None], m, n, sink, window, SEED
        )
        n += m
        np.testing.assert_allclose(mel, want[:m], rtol=2e-5, atol=2e-5)


# -- combined step ----------------------------------------------------------------------------------


def test_combined_step_equals_each_row_alone(setup):
    model, talker_kv, _, voice, steps = setup
    params = model.talker_params
    # Two decode rows at different positions (one past the wrap), built by real steps first.
    history = {"d0": 3, "d1": 11}
    for rid, decodes in history.items():
        talker_kv.ingest_request(rid)
        written = 0
        prompt = [5, 6, 7, model.bos]
        run_step(
            talker_kv,
            steps["talker"],
            params,
            [rid],
            [voice.position(0)],
            [4],
            (np.array([prompt], np.int32), np.array([4], np.int32), np.array([SEED])),
            4,
        )
        written = 4
        for i in range(decodes):
            args = (model.code_tokens([[i % 16]]), np.array([1], np.int32), np.array([SEED]))
            run_step(talker_kv, steps["talker"], params, [rid], [voice.position(written)], [1], args, 1)
            written += 1
        history[rid] = written
    talker_kv.ingest_request("p0")
    before = copy.deepcopy(talker_kv)

    dec_tokens = model.code_tokens([[2], [9]])
    pre_tokens = np.array([[1, 2, 3, 0]], np.int32)  # 3 real tokens in a 4-token bucket
    seeds = np.array([1, 2, 3], np.uint32)
    rids = ["d0", "d1", "p0"]
    positions = [voice.position(history["d0"]), voice.position(history["d1"]), voice.position(0)]
    combined = run_step(
        talker_kv, steps["mixed"], params, rids, positions, [1, 1, 3],
        (dec_tokens, np.array([1, 1], np.int32), pre_tokens, np.array([3], np.int32), seeds), 4,
    )  # fmt: skip

    alone = copy.deepcopy(before)
    one = np.array([1], np.int32)
    singles = [
        run_step(alone, steps["talker"], params, [rid], [pos], [span], (tokens, length, seed), bucket)
        for rid, pos, span, tokens, length, seed, bucket in [
            ("d0", positions[0], 1, dec_tokens[:1], one, seeds[:1], 1),
            ("d1", positions[1], 1, dec_tokens[1:], one, seeds[1:2], 1),
            ("p0", positions[2], 3, pre_tokens, np.array([3], np.int32), seeds[2:], 4),
        ]
    ]
    np.testing.assert_array_equal(combined, np.concatenate(singles))
    for rid in rids:
        slot_a, slot_b = talker_kv.slot_of(rid), alone.slot_of(rid)
        assert slot_a == slot_b
        for layer in range(TINY.talker_layers):
            np.testing.assert_allclose(
                talker_kv.cache.k[layer][slot_a], alone.cache.k[layer][slot_b], rtol=1e-6, atol=1e-6
            )
            np.testing.assert_allclose(
                talker_kv.cache.v[layer][slot_a], alone.cache.v[layer][slot_b], rtol=1e-6, atol=1e-6
            )
    for rid in rids:
        talker_kv.remove_request(rid)


def test_voice_bank_rejects_bad_voices(setup):
    model, talker_kv, flow_kv, _, _ = setup
    bank = VoiceBank(model, talker_kv, flow_kv)
    with pytest.raises(ValueError, match="frames=2 must be in"):
        bank.add(0, frames=2, seed=0)
    with pytest.raises(ValueError, match="voice index=7"):
        bank.add(7, frames=4, seed=0)


def test_config_geometry_is_what_the_model_reads():
    # The flow's cache holds each frame's keys of the last Euler step only: one layer each.
    assert TINY.flow_kv_config.num_layers == TINY.flow_layers
    assert dataclasses.replace(TINY, flow_steps=3).flow_kv_config.num_layers == TINY.flow_layers
