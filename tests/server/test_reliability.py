"""What users expect of a server, each behaviour through the network: a body over the limit is a 413,
overload is a bounded 429 with Retry-After, a client that leaves frees its slots, a slow reader is
paused (and offloaded) instead of buffered without bound, and a device fault fails only the requests it
reached, with a typed, retryable error."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import socket
import threading
import time

import httpx
import pytest
import websockets
from websockets.sync.client import connect

from mstar_jax.engine.faults import inject_faults
from mstar_jax.models.streaming_tts.routes import speech_routes
from mstar_jax.server import ServerSettings, create_app
from tests.server.support import alone, assert_nothing_leaked, live, outcomes, wait_for

pytestmark = pytest.mark.serve

DISCONNECTING_CLIENTS = 1000


@pytest.fixture
def serve(tts):
    """`serve(**settings)`: a live server over the package's engine; its programs restored after."""
    engine, voices = tts
    programs = engine.programs

    def start(grace_s: float | None = None, send_buffer: int | None = None, **settings):
        routes = speech_routes(voices)
        app = create_app(engine, ServerSettings(**settings), model_name="streaming_tts", routes=routes)
        return app, live(app, grace_s=grace_s, send_buffer=send_buffer)

    yield start
    engine.served.programs = programs


def speech(text: str, **extra) -> dict:
    return {"model": "streaming_tts", "voice": "voice-0", "input": text, "response_format": "pcm", **extra}


def test_a_body_over_the_limit_is_a_413(serve):
    app, server = serve(max_body_bytes=256)
    with server as url:
        response = httpx.post(f"{url}/v1/audio/speech", json=speech("x" * 300))
        assert response.status_code == 413
        assert "max_body_bytes=256" in response.json()["error"]["message"]
        chunked = httpx.post(  # no Content-Length: counted as it is read
            f"{url}/v1/audio/speech", content=iter([b"{" + b" " * 200, b" " * 200 + b"}"]),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert chunked.status_code == 413
        assert outcomes(url).get("invalid") == 2  # each refusal counted, as a 400 is
        assert httpx.post(f"{url}/v1/audio/speech", json=speech("ok")).status_code == 200
    assert not app.state.host.engine.streams


def test_overload_is_a_429_with_retry_after_and_bounded(serve, tts):
    engine, _ = tts
    inject_faults(engine, "talker", lambda n: time.sleep(0.02))  # a slow device: requests pile up
    app, server = serve(max_waiting=2, retry_after_s=3, max_frames=8)
    host = app.state.host
    most_waiting = []

    async def crowd(url):
        async with httpx.AsyncClient(timeout=60) as http:

            async def one():
                response = await http.post(f"{url}/v1/audio/speech", json=speech("hello"))
                most_waiting.append(host.waiting)
                return response

            return await asyncio.gather(*(one() for _ in range(16)))

    with server as url:
        responses = asyncio.run(crowd(url))
        refused = [r for r in responses if r.status_code == 429]
        assert refused, "16 requests at once with max_waiting=2 must refuse some"
        assert all(r.headers["retry-after"] == "3" for r in refused)
        assert all(r.json()["error"]["type"] == "overloaded_error" for r in refused)
        assert all(r.status_code in (200, 429) for r in responses)
        assert all(len(r.content) == 5 * 1920 * 2 for r in responses if r.status_code == 200)
        assert max(most_waiting) <= 2
        assert 'mstar_requests_total{outcome="overloaded"}' in httpx.get(f"{url}/metrics").text
        assert_nothing_leaked(host)


def test_a_request_after_shutdown_began_is_a_retryable_503_and_counted(serve):
    app, server = serve()
    with server as url:
        app.state.host.begin_shutdown(grace_s=5.0)
        response = httpx.post(f"{url}/v1/audio/speech", json=speech("hello"), timeout=30)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "shutting_down"
        assert response.json()["error"]["retryable"]
        assert 'mstar_requests_total{outcome="shutdown"} 1.0' in httpx.get(f"{url}/metrics").text


@pytest.mark.slow
def test_clients_that_disconnect_mid_stream_free_everything(serve):
    app, server = serve(max_waiting=DISCONNECTING_CLIENTS, frames_per_byte=8.0)
    host = app.state.host

    async def leave(http, url, i):
        body = speech(f"hi {i}")  # a short prompt, 40 frames or more: the first chunk is 4 frames
        async with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_raw():
                break  # the first chunk, then the client goes away

    async def crowd(url):
        limits = httpx.Limits(max_connections=64)
        # A client queued for one of the 64 connections waits as long as the crowd may (the 300 s
        # below): on a loaded host the crowd ahead of it can take over a minute, which is no failure.
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, pool=None), limits=limits) as http:
            await asyncio.gather(*(leave(http, url, i) for i in range(DISCONNECTING_CLIENTS)))

    with server as url:
        asyncio.run(asyncio.wait_for(crowd(url), 300))
        assert_nothing_leaked(host)
        cancelled = host.engine.stats.cancelled
        assert cancelled >= DISCONNECTING_CLIENTS * 0.9  # a few may have finished before they left


def test_a_client_gone_before_its_first_chunk_is_cancelled(serve, tts):
    engine, _ = tts
    inject_faults(engine, "talker", lambda n: time.sleep(0.05))
    app, server = serve()
    host = app.state.host
    with server as url:
        before = engine.stats.cancelled
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/audio/speech", json=speech("never heard " * 4), timeout=0.05)
        wait_for(lambda: engine.stats.cancelled > before, "the abandoned request to be cancelled", 10)
        assert_nothing_leaked(host)


def _raw_request(port: int, body: dict) -> socket.socket:
    """An HTTP request sent from a socket with a tiny receive buffer, nothing read back."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_a_slow_reader_is_paused_and_offloaded_not_buffered(serve, tts):
    engine, _ = tts
    app, server = serve(
        stream_buffer=4,
        max_frames=1500,
        max_input_bytes=2000,
        frames_per_byte=1.0,
        offload_paused_after_s=0.2,
    )
    host = app.state.host
    with server as url:
        port = int(url.rsplit(":", 1)[1])
        sock = _raw_request(port, speech("x" * 1500))  # 1,500 frames: 5.8 MB of PCM
        try:
            wait_for(lambda: any(s.paused for s in engine.streams.values()), "the stream to pause", 30)
            (handle,) = list(host._live.values())
            wait_for(lambda: engine.is_offloaded(handle.request_id), "the paused stream to be offloaded", 10)
            assert handle.most_buffered <= 4 + 2  # the bound, and what steps in flight brought
            assert host.waiting == 1  # a paused stream counts against max_waiting
            received, sock_file = 0, sock.makefile("rb")
            while sock_file.readline() != b"\r\n":  # the headers
                pass
            while (size := int(sock_file.readline().strip(), 16)) > 0:  # the chunks, read at last
                received += len(sock_file.read(size))
                sock_file.readline()
            assert received == 1500 * 1920 * 2
            assert handle.pauses >= 1
            assert handle.most_buffered <= 4 + 2
        finally:
            sock.close()
        assert_nothing_leaked(host)


def _sse_events(response) -> list[tuple[str | None, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:])))
            kind = None
    return events


def test_a_fault_fails_only_the_requests_it_reached_with_a_retryable_error(serve, tts):
    engine, _ = tts
    fail_at = {"step": 3}  # mid-prefill: state written, no audio yet (a fault at step 1 loses nothing)
    calls = inject_faults(engine, "talker", lambda n: "after" if n == fail_at["step"] else None)
    app, server = serve()
    faults = engine.stats.faults
    with server as url:
        # Before the first byte: a 503 whose body says it is retryable.
        response = httpx.post(f"{url}/v1/audio/speech", json=speech("a longer text to speak"), timeout=30)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert (error["type"], error["retryable"], error["code"]) == ("state_lost", True, "StateLostError")
        # While streaming: an SSE error event, typed and retryable, after the audio already sent.
        calls[0], fail_at["step"] = 0, 14
        body = speech("a longer text to speak", stream_format="sse")
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=30) as response:
            assert response.status_code == 200
            events = _sse_events(response)
        kinds = [kind for kind, _ in events]
        assert kinds[0] is None, kinds  # audio first
        assert kinds[-1] == "error", kinds
        assert events[-1][1]["error"]["type"] == "state_lost"
        assert events[-1][1]["error"]["retryable"]
        assert base64.b64decode(events[0][1]["audio"])
        # The engine kept serving: the same request again is whole.
        again = httpx.post(f"{url}/v1/audio/speech", json=speech("a longer text to speak"), timeout=30)
        assert again.status_code == 200
        assert len(again.content) == 22 * 1920 * 2
        assert f"mstar_faults {faults + 2:.1f}" in httpx.get(f"{url}/metrics").text
        assert_nothing_leaked(app.state.host)


def test_a_fault_closes_a_websocket_with_the_retryable_code(serve, tts):
    engine, _ = tts
    inject_faults(engine, "talker", lambda n: "after" if n == 3 else None)
    app, server = serve()

    async def talk(url):
        async with websockets.connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "text", "text": "a text the fault will reach. "}))
            messages = []
            try:
                while True:
                    messages.append(await ws.recv())
            except websockets.ConnectionClosedError:  # closed with an error code
                return messages, ws.close_code

    with server as url:
        messages, code = asyncio.run(asyncio.wait_for(talk(url), 30))
        assert code == 1013  # try again later
        error = json.loads(messages[-1])["error"]
        assert (error["type"], error["retryable"]) == ("state_lost", True)
        assert_nothing_leaked(app.state.host)


def test_sigterm_lets_a_websocket_read_its_segment_to_the_end(serve, tts):
    """A signal while a WebSocket's segment is still on its way to a slow client (the engine done, its
    audio buffered, the socket full): the server waits for the client to read it (not only for the
    engine to finish it), so the client gets all of its audio, `segment.done` and `done`, and a normal
    close, never uvicorn's 1012."""
    engine, voices = tts
    settings = {"stream_buffer": 256, "frames_per_byte": 20.0}  # 260 frames: 1 MB of PCM, none paused
    text = "hello there. "
    reference = alone(engine, voices["voice-0"], text, ServerSettings(**settings))
    app, server = serve(grace_s=10.0, send_buffer=4096, **settings)
    host = app.state.host
    with server as url:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        endpoint = url.replace("http", "ws") + "/v1/audio/speech/stream"
        with connect(endpoint, sock=sock, max_queue=1, compression=None) as ws:
            for message in ({"type": "start", "voice": "voice-0"}, {"type": "text", "text": text}):
                ws.send(json.dumps(message))
            ws.send(json.dumps({"type": "end"}))
            audio, events = ws.recv(timeout=60), []
            assert isinstance(audio, bytes)
            app.state.server.handle_exit(signal.SIGTERM, None)
            wait_for(lambda: host.live == 0, "the engine to finish the segment")  # the client read 1 chunk
            assert host.delivering == 2  # the segment, its audio not all sent, and the session's end
            for message in ws:  # slowly, until the server closes (`ws.close_code` says how)
                time.sleep(0.01)
                if isinstance(message, bytes):
                    audio += message
                else:
                    events.append(json.loads(message)["type"])
            assert ws.close_code == 1000
    assert audio == reference
    assert events == ["segment.done", "done"]


def blocked_device(engine) -> threading.Event:
    """Hold every talker step until the event returned is set (within 60 s)."""
    release = threading.Event()
    inject_faults(engine, "talker", lambda n: (release.wait(60), None)[1])
    return release


@pytest.mark.parametrize(
    ("messages", "queued", "submitted"),
    [
        # Five sentences: the reader waits for the writer, two segments queued behind the one speaking.
        ([{"type": "text", "text": "One. Two. Three. Four. Five. "}], 4, 4),
        ([{"type": "text", "text": "One. "}, {"type": "end"}], 2, 1),  # all sent: only a close may follow
    ],
    ids=["segments_queued", "after_end"],
)
def test_a_websocket_client_that_leaves_before_any_audio_has_every_segment_cancelled(
    serve, tts, messages, queued, submitted
):
    """A client that leaves while its segments wait for the device (none has audio yet) has them all
    cancelled at once, not once the first one speaks: they would hold `max_waiting` places, then run."""
    engine, _ = tts
    release = blocked_device(engine)
    app, server = serve()
    host = app.state.host
    try:
        with server as url:
            with connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
                for message in messages:
                    ws.send(json.dumps(message))
                wait_for(lambda: host.delivering == queued, f"{submitted} segments to be submitted")
            wait_for(lambda: host.delivering == 0, "the session to end, the device still held", 20)
            release.set()
            assert_nothing_leaked(host)
            # Each ended cancelled (by the engine, or by the host before the engine saw it), none spoke.
            assert outcomes(url).get("cancelled") == submitted
            assert "done" not in outcomes(url)
    finally:
        release.set()


def test_a_websocket_message_after_end_is_refused_with_1007(serve, tts):
    engine, _ = tts
    release = blocked_device(engine)
    app, server = serve()
    try:
        with server as url, connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            for message in ({"type": "text", "text": "One. "}, {"type": "end"}, {"type": "flush"}):
                ws.send(json.dumps(message))
            error = json.loads(ws.recv(timeout=30))
            with pytest.raises(websockets.ConnectionClosed):
                ws.recv(timeout=30)
            assert ws.close_code == 1007
            assert error["error"]["message"] == "a message after type='end'; the client may only close now"
            assert outcomes(url).get("invalid") == 1
            release.set()
            assert_nothing_leaked(app.state.host)
    finally:
        release.set()
