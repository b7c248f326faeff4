"""Several Gemma 3 streams at once (`serve.generate`) against each stream served alone.

The small random-weight model of `test_model` (whose `greedy` matches the float64 oracle there) serves
prompts of different lengths with fewer slots than prompts, so one waits for a slot, in buckets of one
or three rows (two rows run padded with an empty one); each stream's tokens must equal what the same
prompt gets alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.serve import generate
from mstar_jax.models.gemma3.stream import DECODE, PREFILL, Gemma3Streams
from mstar_jax.resources.kv.bounded.config import SinkWindow
from tests.models.gemma3.test_model import CONFIG, random_tensors

RETENTION = SinkWindow(2, 10)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return Gemma3.from_tensors(CONFIG, random_tensors(CONFIG))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (5, 19, 1, 12)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, chunk=8)
    return [streams.greedy(prompt, NEW_TOKENS) for prompt in prompts]


def test_concurrent_streams_equal_each_served_alone(model, prompts, alone):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, max_slots=3, chunk=8, batch_sizes=(1,))
    streams.capture()
    seen: list[tuple[int, int]] = []
    result = generate(streams, prompts, NEW_TOKENS, on_token=lambda i, t: seen.append((i, t)))
    assert result.tokens == alone
    assert [t for i, t in seen if i == 1] == alone[1]  # on_token sees each stream's tokens in order
    assert result.refusals == 1  # four prompts, three slots: the last waited for one (once)
    assert result.late_captures == 0  # every step replayed a program captured ahead of time
    buckets = streams.buckets.keys()
    assert {key.bs for key in buckets} == {1, 3}  # two rows run padded to three
    assert streams.local.free_slots == streams.global_.free_slots == 3
    assert result.steps[PREFILL] >= 3
    assert result.steps[DECODE] >= NEW_TOKENS
    assert result.prompt_tokens == sum(map(len, prompts))
    assert result.new_tokens == 4 * NEW_TOKENS
    assert result.decoded_tokens == 4 * (NEW_TOKENS - 1)  # each stream's last token is never fed back


def test_a_stop_token_ends_its_stream_only(model, prompts, alone):
    stop = alone[1][5]
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, max_slots=4, chunk=8)
    result = generate(streams, prompts, NEW_TOKENS, stop_ids=[stop])
    for got, want in zip(result.tokens, alone, strict=True):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert got == want[:cut]
    assert streams.local.free_slots == 4


def test_memory_per_stream_is_both_caches_one_slot(model):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, max_slots=2)
    entry = CONFIG.num_kv_heads * CONFIG.head_dim * 4 * 2  # K and V, float32
    local_layers = CONFIG.num_layers - 1
    want = entry * (local_layers * streams.local.config.slot_capacity + streams.global_.config.slot_capacity)
    assert streams.bytes_per_stream == want


@pytest.mark.parametrize(
    ("prompts", "count", "match"),
    [
        ([], 4, r"prompts is empty"),
        ([[1, 2], []], 4, r"prompts\[1\] must be a non-empty sequence of token ids"),
        ([[1, CONFIG.vocab_size]], 4, r"prompts\[0\] holds ids outside \[0, vocab_size=64\)"),
        ([[1, 2]], 0, r"max_new_tokens=0 must be an int >= 1"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(model, prompts, count, match):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION)
    with pytest.raises(ValueError, match=match):
        generate(streams, prompts, count)
    assert streams.local.request_ids == ()
    assert streams.captures == []


def test_an_error_mid_run_gives_every_slot_back(model, prompts, alone):
    streams = Gemma3Streams(CONFIG, model, global_retention=RETENTION, max_slots=2, chunk=8)

    seen = []

    def fail_on_the_fifth_token(index, token):
        seen.append(token)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(streams, prompts, NEW_TOKENS, on_token=fail_on_the_fifth_token)
    assert streams.local.free_slots == streams.global_.free_slots == 2
    assert streams.local.request_ids == streams.global_.request_ids == ()
    assert generate(streams, prompts[:1], 3).tokens == [alone[0][:3]]  # the caches serve on


def test_a_second_start_loads_every_program_from_the_store_and_serves_the_same(
    model, prompts, alone, tmp_path
):
    import jax

    from mstar_jax.compile import ExecutableStore, count_compilations

    def start():
        jax.clear_caches()  # as a new process: nothing compiled in memory
        streams = Gemma3Streams(
            CONFIG, model, global_retention=RETENTION, max_slots=3, chunk=8, batch_sizes=(1,),
            store=ExecutableStore(tmp_path),
        )  # fmt: skip
        with count_compilations() as counter:
            (report,) = streams.capture()
        return streams, report, counter.count

    _, first, compiled = start()
    assert (first.loaded, compiled) == (0, len(first.buckets))
    streams, second, compiled = start()
    assert (second.loaded, compiled) == (len(second.buckets), 0)
    assert generate(streams, prompts, NEW_TOKENS).tokens == alone
