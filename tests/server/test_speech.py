"""Speech through the front door to clients no one here wrote: the official `openai` SDK, `httpx` and
`websockets`. The bytes a client receives equal the PCM of the same request served alone in process."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest
import websockets

from mstar_jax.models.streaming_tts.audio import wav_header
from mstar_jax.models.streaming_tts.routes import speech_routes
from mstar_jax.server import ServerSettings, create_app
from tests.server.support import alone as served_alone
from tests.server.support import assert_nothing_leaked, live, outcomes

pytestmark = pytest.mark.serve

TEXTS = ("Hello there. ", "How are you?", "hé!")
LONG = "é" * 20 + ". "  # 42 bytes in one message, one sentence: over segment_bytes=32
LONG_SEGMENTS = ("é" * 16, "é" * 4 + ". ")  # 32 bytes, then the rest
SETTINGS = ServerSettings(max_input_bytes=64, segment_bytes=32, frames_per_byte=1.0, max_frames=64)


def alone(engine, voice, text: str, seed: int = 0) -> bytes:
    """The PCM of `text` served alone by the engine in process (no server)."""
    return served_alone(engine, voice, text, SETTINGS, seed)


@pytest.fixture(scope="module")
def served(tts):
    engine, voices = tts
    # Served alone before the host starts: from then on only its thread may drive the engine.
    references = {
        (name, text): alone(engine, voice, text) for name, voice in voices.items() for text in TEXTS
    }
    references.update({("voice-0", text): alone(engine, voices["voice-0"], text) for text in LONG_SEGMENTS})
    app = create_app(engine, SETTINGS, model_name="streaming_tts", routes=speech_routes(voices))
    with live(app) as url:
        yield url, app.state.host, references


@pytest.fixture(scope="module")
def sdk(served):
    """The official client, pointed at the server (closed with the module: no socket left open)."""
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=30) as client:
        yield client


@pytest.mark.parametrize("voice", ["voice-0", "voice-1"])
def test_the_openai_sdk_streams_the_engines_audio(served, sdk, voice):
    _url, host, references = served
    with sdk.audio.speech.with_streaming_response.create(
        model="streaming_tts", voice=voice, input=TEXTS[0], response_format="pcm"
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        received = b"".join(response.iter_bytes())
    assert received == references[(voice, TEXTS[0])]
    assert_nothing_leaked(host)


def test_wav_is_a_streaming_header_then_the_same_pcm(served, sdk):
    _url, _, references = served
    with sdk.audio.speech.with_streaming_response.create(
        model="streaming_tts", voice="voice-0", input=TEXTS[2], response_format="wav"
    ) as response:
        received = response.read()
    assert received == wav_header() + references[("voice-0", TEXTS[2])]


def test_sse_streams_base64_deltas_then_done(served):
    url, _, references = served
    body = {"model": "streaming_tts", "voice": "voice-1", "input": TEXTS[1], "stream_format": "sse",
            "response_format": "pcm"}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == references[("voice-1", TEXTS[1])]


def test_the_websocket_takes_text_token_by_token_and_speaks_each_sentence(served):
    url, host, references = served
    text = TEXTS[0] + TEXTS[1]

    async def talk():
        audio, segments = [b"", b""], []
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "start", "voice": "voice-0", "model": "streaming_tts"}))
            for i in range(0, len(text), 3):  # an LLM's output, a few characters at a time
                await ws.send(json.dumps({"type": "text", "text": text[i : i + 3]}))
            await ws.send(json.dumps({"type": "end"}))
            async for message in ws:
                if isinstance(message, bytes):
                    audio[len(segments)] += message
                else:
                    event = json.loads(message)
                    if event["type"] == "segment.done":
                        segments.append(event["index"])
            assert ws.close_code == 1000
        return audio, segments

    audio, segments = asyncio.run(asyncio.wait_for(talk(), 60))
    assert segments == [0, 1]
    assert audio == [references[("voice-0", TEXTS[0])], references[("voice-0", TEXTS[1])]]
    assert_nothing_leaked(host)


def test_a_websocket_cuts_a_long_sentence_at_segment_bytes_counted_in_bytes(served):
    url, host, references = served

    async def talk():
        audio, done = [b"", b""], 0
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "text", "text": LONG}))
            await ws.send(json.dumps({"type": "end"}))
            async for message in ws:
                if isinstance(message, bytes):
                    audio[done] += message
                elif json.loads(message)["type"] == "segment.done":
                    done += 1
        return audio

    audio = asyncio.run(asyncio.wait_for(talk(), 60))
    assert audio == [references[("voice-0", segment)] for segment in LONG_SEGMENTS]
    assert_nothing_leaked(host)


def test_voices_models_health_ready_and_metrics(served, sdk):
    url, _, _ = served
    voices = httpx.get(f"{url}/v1/audio/voices").json()
    assert [v["voice_id"] for v in voices["voices"]] == ["voice-0", "voice-1"]
    assert voices["sample_rate"] == 24_000
    assert [m.id for m in sdk.models.list()] == ["streaming_tts"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").json()["ready"] is True
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "mstar_time_to_first_output_seconds_bucket{kind=\"audio\"", "mstar_step_latency_seconds_count",
        "mstar_slots_in_use{cache=\"talker_kv\"}", "mstar_queue_depth{cache=\"flow_kv\"}",
        "mstar_compilations_after_warmup 0.0", "mstar_faults ", "mstar_requests_total{outcome=\"done\"}",
    ):  # fmt: skip
        assert name in metrics, name
    assert httpx.get(f"{url}/nowhere").json()["error"]["type"] == "invalid_request_error"


GOOD = {"model": "streaming_tts", "voice": "voice-0", "input": "hi"}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        ({**GOOD, "input": 3}, "input", "input=3 must be a string"),
        ({**GOOD, "input": ""}, "input", "input='' must be a non-empty string"),
        ({**GOOD, "input": "x" * 65}, "input", "it must be at most max_input_bytes=64"),
        ({"model": "streaming_tts", "voice": "voice-0"}, "input", "input is required"),
        ({**GOOD, "voice": "alloy"}, "voice", "voice='alloy' must be one of ['voice-0', 'voice-1']"),
        ({**GOOD, "voice": "v" * 100_000}, "voice", "voice='vvvvvvvv"),
        ({**GOOD, "model": "tts-1"}, "model", "model='tts-1' must be one of ['streaming_tts']"),
        ({**GOOD, "response_format": "mp3"}, "response_format", "must be one of ['wav', 'pcm']"),
        ({**GOOD, "stream_format": "chunks"}, "stream_format", "must be one of ['audio', 'sse']"),
        ({**GOOD, "speed": "fast"}, "speed", "speed='fast' must be a number"),
        ({**GOOD, "speed": 9.0}, "speed", "speed=9.0 must be a finite number in [0.25, 4.0]"),
        (b'{"model": "streaming_tts", "voice": "voice-0", "input": "hi", "speed": NaN}', "speed", "finite"),
        ({**GOOD, "seed": -1}, "seed", "seed=-1 must be an int in [0, 4294967295]"),
        ({**GOOD, "seed": True}, "seed", "seed=True must be an int"),
        (
            b'{"model": "streaming_tts", "voice": "voice-0", "input": "hi", "speed": 1' + b"0" * 400 + b"}",
            "speed",
            "must be a finite number in [0.25, 4.0]",
        ),
        (b'{"input": "hi", "seed": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),  # past int's digits
        (b"[" * 100_000, None, "not valid JSON"),  # nested past the parser's recursion
        # Valid JSON, but no text: a lone surrogate has no UTF-8 bytes (once a 500).
        (
            {**GOOD, "input": "hi \ud800"},
            "input",
            "input='hi \\ud800' has a lone surrogate '\\ud800' at offset 3",
        ),
        ({**GOOD, "input": "\udfff"}, "input", "at offset 0; it must be valid Unicode"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_counted_invalid(served, body, param, says):
    url, host, _ = served
    before = outcomes(url).get("invalid", 0)
    response = httpx.post(
        f"{url}/v1/audio/speech",
        content=json.dumps(body) if isinstance(body, dict) else body,  # ASCII JSON: surrogates escaped
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert says in error["message"]
    assert len(error["message"]) < 300  # the value named, not echoed whole
    assert not host.engine.streams
    assert outcomes(url).get("invalid", 0) == before + 1


def test_the_sdk_raises_bad_request_for_an_unknown_voice(sdk):
    with pytest.raises(openai.BadRequestError, match="voice='nova' must be one of"):
        sdk.audio.speech.create(model="streaming_tts", voice="nova", input="hi")


def refused_frame(url: str, *frames: str | bytes) -> tuple[dict, int]:
    """The error message and close code a WebSocket session answers `frames` with, the last refused."""

    async def talk():
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            for frame in frames:
                await ws.send(frame)
            while True:  # past an accepted segment's audio and `segment.done`
                message = await ws.recv()
                if isinstance(message, str) and json.loads(message)["type"] == "error":
                    break
            error = json.loads(message)
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            return error, ws.close_code

    return asyncio.run(asyncio.wait_for(talk(), 30))


def test_a_websocket_message_refused_closes_with_1007(served):
    url, host, _ = served
    error, code = refused_frame(url, json.dumps({"type": "start", "voice": "nobody"}))
    assert code == 1007
    assert error["error"]["param"] == "voice"
    assert_nothing_leaked(host)


def test_a_binary_websocket_frame_is_refused_with_1007(served):
    url, host, _ = served
    error, code = refused_frame(url, b'{"type": "text", "text": "hi. "}')
    assert code == 1007
    assert "must be a JSON text frame, not binary" in error["error"]["message"]
    assert_nothing_leaked(host)


@pytest.mark.parametrize(
    ("frames", "param", "says"),
    [
        ([{"type": "text", "text": "hi \ud800. "}], "text", "text='hi \\ud800. ' has a lone surrogate"),
        ([{"type": "start", "seed": "\ud800"}], "seed", "seed='\\ud800' must be an int"),
        # Once accepted: the voice of text already sent changed.
        ([{"type": "text", "text": "hi"}, {"type": "start"}], "type", "type='start' is message 2"),
        ([{"type": "start"}, {"type": "start", "voice": "voice-1"}], "type", "type='start' is message 2"),
        (
            [{"type": "text", "text": "hi. "}, {"type": "flush"}, {"type": "start"}],
            "type",
            "type='start' is message 3; it may only be the first",
        ),
    ],
)
def test_a_websocket_message_refused_names_its_field_and_is_counted(served, frames, param, says):
    url, host, _ = served
    before = outcomes(url).get("invalid", 0)
    error, code = refused_frame(url, *(json.dumps(f) for f in frames))
    assert code == 1007
    assert error["error"]["param"] == param
    assert says in error["error"]["message"]
    assert_nothing_leaked(host)
    assert outcomes(url).get("invalid", 0) == before + 1


def test_audio_equals_across_concurrent_clients(served):
    url, host, references = served

    async def fetch(http, voice, text):
        body = {"model": "streaming_tts", "voice": voice, "input": text, "response_format": "pcm"}
        async with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            return b"".join([chunk async for chunk in response.aiter_bytes()])

    async def crowd():
        async with httpx.AsyncClient(timeout=60) as http:
            keys = [(v, t) for v in ("voice-0", "voice-1") for t in TEXTS] * 2
            return keys, await asyncio.gather(*(fetch(http, v, t) for v, t in keys))

    keys, received = asyncio.run(crowd())
    assert all(got == references[key] for key, got in zip(keys, received, strict=True))
    assert_nothing_leaked(host)
    assert np.all(host.engine.compilations == 0)


def test_a_websocket_client_that_leaves_mid_stream_frees_everything(served):
    url, host, _ = served

    async def leave():
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "text", "text": "a sentence long enough to speak a while. "}))
            assert isinstance(await ws.recv(), bytes)  # the first audio, then the client goes away

    asyncio.run(asyncio.wait_for(leave(), 30))
    assert_nothing_leaked(host)


def test_a_websocket_flush_speaks_what_is_buffered(served):
    url, host, references = served

    async def talk():
        audio, events = b"", []
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "text", "text": TEXTS[2]}))  # no sentence end: held
            await ws.send(json.dumps({"type": "flush"}))
            while not events or events[-1]["type"] != "segment.done":
                message = await ws.recv()
                if isinstance(message, bytes):
                    audio += message
                else:
                    events.append(json.loads(message))
            await ws.send(json.dumps({"type": "end"}))
            events += [json.loads(m) async for m in ws if isinstance(m, str)]
        return audio, [e["type"] for e in events]

    audio, kinds = asyncio.run(asyncio.wait_for(talk(), 30))
    assert audio == references[("voice-0", TEXTS[2])]
    assert kinds == ["segment.done", "done"]
    assert_nothing_leaked(host)
