"""Gemma 3 through the front door: a tiny random-weight model (`tests.models.gemma3.test_model`'s)
whose GGUF file names its pieces (the chat template's control tokens, characters), served to the
official `openai` SDK and `httpx`. Streamed tokens equal `Gemma3Streams.greedy`'s for the same prompt."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from mstar_jax.models.gemma3.routes import StopMatcher, text_routes
from mstar_jax.server import ServerSettings, create_app
from tests import extras
from tests.server.support import assert_nothing_leaked, live, outcomes

extras.skip_module_without("serve", "gemma")
pytestmark = [pytest.mark.serve, pytest.mark.gemma]

from mstar_jax.deployment import parse_deployment
from mstar_jax.models.gemma3 import load_gguf
from mstar_jax.models.gemma3.chat import TextTokenizer
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.models.gemma3.run import build_text_engine
from mstar_jax.models.gemma3.stream import Gemma3Streams
from tests.models.gemma3.test_deployment import write_gguf
from tests.models.gemma3.test_model import CONFIG

PIECES = [
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "\n", " ",
    *"abcdefghijklmnopqrstuvwxyz", *"0123456789", *".,!?'-:;", "user", "model", "the", "hello",
]  # fmt: skip
PIECES += [f"<unused{i}>" for i in range(CONFIG.vocab_size - len(PIECES))]
MODEL = "tiny-gemma"
HI = {"model": MODEL, "prompt": "hi"}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny.gguf"
    write_gguf(path, pieces=PIECES)
    mapping = {
        "model": {"name": "gemma3", "config": {"gguf": str(path), "global_sink": 2, "global_window": 10,
                                               "chunk": 8, "max_slots": 2}},
        "engine": {"max_batch": 2, "pipelined": True},
    }  # fmt: skip
    deployment = parse_deployment(mapping, "gemma.yaml")
    engine = build_text_engine(deployment, progress=False)
    config, tensors = load_gguf(path)
    alone = Gemma3Streams(
        config,
        Gemma3.from_tensors(config, tensors),
        global_retention=deployment.model_config.retention,
        chunk=8,
    )
    tokenizer = TextTokenizer.from_gguf(path)
    routes = text_routes(tokenizer)
    app = create_app(engine, ServerSettings(max_tokens=32), model_name=MODEL, routes=routes)
    with live(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as sdk:
        yield url, sdk, app.state.host, alone, tokenizer


def expected(alone, tokenizer, prompt, count, stops=(1,)):
    """Greedy's tokens for `prompt`, ended after a stop token as the engine ends them."""
    tokens = alone.greedy(prompt, count)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def test_streamed_completion_tokens_equal_greedys(gemma):
    url, sdk, host, alone, tokenizer = gemma
    prompt = [2, 40, 7, 8, 9, 11, 12, 13, 14, 15, 16]
    want = expected(alone, tokenizer, prompt, 20)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "stream": True}
    ids, text = [], ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                text += choice["text"]
    assert ids == want
    assert text == tokenizer.decode(want)
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(want)
    assert chunks[-1].choices[0].finish_reason == ("stop" if want[-1] == 1 else "length")
    assert_nothing_leaked(host)


def test_a_text_prompt_and_a_whole_response(gemma):
    _, sdk, _, alone, tokenizer = gemma
    prompt = [tokenizer.bos_id, *tokenizer.encode("hello the model")]
    want = expected(alone, tokenizer, prompt, 12)
    response = sdk.completions.create(model=MODEL, prompt="hello the model", max_tokens=12)
    assert response.choices[0].text == tokenizer.decode(want)
    assert response.usage.completion_tokens == len(want)


def test_chat_streams_greedys_reply_in_gemmas_template(gemma):
    _, sdk, host, alone, tokenizer = gemma
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt = tokenizer.chat([("system", "be brief"), ("user", "hello")])
    assert prompt[:2] == [2, 3]  # <bos><start_of_turn>
    assert tokenizer.decode(prompt) == "user\nbe brief\n\nhello\nmodel\n"
    want = expected(alone, tokenizer, prompt, 16, stops=tokenizer.stop_tokens)
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(want)
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert whole.choices[0].message.content == tokenizer.decode(want)
    # OpenAI's newer name for it (once ignored: the default 16 tokens, whatever was asked).
    short = expected(alone, tokenizer, prompt, 5, stops=tokenizer.stop_tokens)
    newer = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert newer.choices[0].message.content == tokenizer.decode(short)
    assert newer.usage.completion_tokens == len(short)
    assert_nothing_leaked(host)


def test_the_chat_prompt_is_gemmas_template_token_for_token(gemma):
    *_, tokenizer = gemma
    messages = [("system", "be brief"), ("user", "  hi "), ("assistant", "hello\n"), ("user", "bye")]
    # Gemma 3's template: the system text opens the first user turn, contents are trimmed, an
    # assistant's turn is the model's, and the prompt ends opening the model's turn.
    template = (
        "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
    control = {"<bos>": tokenizer.bos_id, "<start_of_turn>": 3, "<end_of_turn>": 4}
    want = []
    for piece in re.split(r"(<bos>|<start_of_turn>|<end_of_turn>)", template):
        want += [control[piece]] if piece in control else tokenizer.encode(piece) if piece else []
    assert tokenizer.chat(messages) == want


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 has role 'user'"),
        ([{"role": "assistant", "content": "a"}], "message 0 has role 'assistant'"),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            "message 1 has role 'system'",
        ),
    ],
)
def test_chat_turns_out_of_gemmas_order_are_a_400(gemma, messages, says):
    url, _, host, _, _ = gemma
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    assert says in response.json()["error"]["message"]
    assert_nothing_leaked(host)


def test_a_stop_string_ends_the_text_before_it():
    matcher = StopMatcher(["ab", "xyz"])
    assert matcher.feed("hello a") == ("hello ", False)  # "a" may start "ab": held
    assert matcher.feed("x") == ("a", False)
    assert matcher.feed("yzzz") == ("", True)


def test_a_stop_string_over_http_ends_the_completion_and_counts_as_done(gemma):
    url, sdk, host, alone, tokenizer = gemma
    prompt = [2, 40, 7, 8, 9, 11, 12, 13, 14, 15, 16]
    text = tokenizer.decode(expected(alone, tokenizer, prompt, 20))
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle of the reply
    assert stop
    assert text.index(stop) > 0
    before = outcomes(url)
    response = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stop=stop)
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    assert_nothing_leaked(host)
    after = outcomes(url)
    assert after.get("done", 0) == before.get("done", 0) + 1
    assert after.get("cancelled", 0) == before.get("cancelled", 0)


def test_models_and_the_time_to_first_token(gemma):
    url, sdk, _, _, _ = gemma
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert 'mstar_time_to_first_output_seconds_count{kind="token"}' in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/v1/audio/voices").status_code == 404  # a text deployment speaks no audio


def _said(content) -> dict:
    """A chat body of one user message of `content`."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("completions", {"model": MODEL, "prompt": 3}, "prompt", "must be a non-empty string or"),
        ("completions", {"model": MODEL, "prompt": []}, "prompt", "must be a non-empty string or"),
        ("completions", {"model": MODEL, "prompt": [1, 999]}, "prompt", "token ids [999] must be in [0, 64)"),
        ("completions", {**HI, "max_tokens": 0}, "max_tokens", "max_tokens=0 must be an int in [1, 32]"),
        ("completions", {**HI, "max_tokens": 33}, "max_tokens", "in [1, 32]"),
        ("completions", {**HI, "max_tokens": 2.5}, "max_tokens", "max_tokens=2.5 must be an int"),
        (
            "completions",
            {"model": "gpt-4", "prompt": "hi"},
            "model",
            "model='gpt-4' must be one of ['tiny-gemma']",
        ),
        ("completions", {**HI, "temperature": -1}, "temperature", "temperature=-1"),
        ("completions", {**HI, "stop": [1]}, "stop", "must be a non-empty string"),
        ("completions", {**HI, "stop": "x" * 257}, "stop", "each of at most 256 characters"),
        ("completions", {**HI, "seed": "x"}, "seed", "seed='x' must be an int"),
        ("completions", {**HI, "stream": "yes"}, "stream", "stream='yes' must be a bool"),
        (
            "completions",
            {"model": MODEL, "prompt": "HI"},
            "prompt",
            "'H' at offset 0 is not in the model's vocabulary",
        ),
        ("chat/completions", {"model": MODEL, "messages": []}, "messages", "must be a non-empty list"),
        (
            "chat/completions",
            {**_said("hi"), "max_completion_tokens": 33},
            "max_completion_tokens",
            "max_completion_tokens=33 must be an int in [1, 32]",
        ),
        (
            "chat/completions",
            {**_said("hi"), "max_completion_tokens": "4"},
            "max_completion_tokens",
            "max_completion_tokens='4' must be an int",
        ),
        (
            "chat/completions",
            {**_said("hi"), "max_completion_tokens": 4, "max_tokens": 4},
            "max_completion_tokens",
            "max_tokens and max_completion_tokens are both given",
        ),
        (
            "chat/completions",
            {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role",
            "messages[0].role='bot' must be one of",
        ),
        (
            "chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "messages[0].content=5 must be a string",
        ),
        (
            "chat/completions",
            {"model": MODEL, "messages": ["hello"]},
            "messages[0]",
            "messages[0]='hello' must be an object with role and content",
        ),
        (
            "chat/completions",
            _said([{"type": "text", "text": "a"}, {"type": "image_url"}]),
            "messages[0].content[1]",
            "messages[0].content[1]={'type': 'image_url'} must be a text part",
        ),
        (
            "chat/completions",
            _said([{"type": "text", "text": 5}]),
            "messages[0].content[0]",
            "messages[0].content[0]={'type': 'text', 'text': 5} must be a text part",
        ),
        # A lone surrogate is valid JSON ("\ud800") but no text: it has no UTF-8 bytes and no tokens.
        ("completions", {**HI, "prompt": "hi \ud800"}, "prompt", "lone surrogate '\\ud800' at offset 3"),
        ("completions", {**HI, "stop": ["a", "b\udfff"]}, "stop", "stop='b\\udfff' has a lone surrogate"),
        (
            "chat/completions",
            _said("\udc80hi"),
            "messages[0].content",
            "messages[0].content='\\udc80hi' has a lone surrogate '\\udc80' at offset 0",
        ),
        (
            "chat/completions",
            _said([{"type": "text", "text": "a"}, {"type": "text", "text": "b\ud800"}]),
            "messages[0].content[1].text",
            "lone surrogate '\\ud800' at offset 1",
        ),
    ],
)
def test_a_bad_text_request_is_a_400_naming_the_field_and_counted_invalid(gemma, path, body, param, says):
    url, _, host, _, _ = gemma
    before = outcomes(url).get("invalid", 0)
    # Sent as ASCII JSON, the way a client's JSON library escapes a lone surrogate.
    response = httpx.post(
        f"{url}/v1/{path}", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert says in error["message"]
    assert not host.engine.streams
    assert outcomes(url).get("invalid", 0) == before + 1


def test_a_sampled_completion_is_the_same_for_the_same_seed(gemma):
    url, _, host, _, _ = gemma
    body = {"model": MODEL, "prompt": [2, 40, 7, 8], "max_tokens": 12, "temperature": 1.5}

    def tokens(seed: int) -> list[int]:
        response = httpx.post(f"{url}/v1/completions", json={**body, "seed": seed}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    first = tokens(7)
    assert tokens(7) == first
    assert any(tokens(seed) != first for seed in (8, 9, 10))
    assert_nothing_leaked(host)
