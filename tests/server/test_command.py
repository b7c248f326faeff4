"""`mstar-jax serve` as users run it: a bad flag is a one-line refusal with exit status 2, and a real
server process under load stops on `SIGTERM` within its grace period, every request either finished or
failed with a typed, retryable error, and exits 0."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import threading
from pathlib import Path

import httpx
import pytest

from mstar_jax.cli import main
from mstar_jax.models.streaming_tts.audio import pcm16
from mstar_jax.models.streaming_tts.request import TTSRequest
from mstar_jax.models.streaming_tts.routes import speech_routes
from mstar_jax.models.streaming_tts.tokenizer import ByteTokenizer
from mstar_jax.server import EngineHost, ServerSettings, create_app
from tests.server.support import serve_process, wait_for

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "70000"], "--port=70000 must be an int in [0, 65535]"),
        (["--max-waiting", "0"], "--max-waiting: max_waiting=0 must be an int >= 1"),
        (["--segment-bytes", "3"], "--segment-bytes: segment_bytes=3 must be an int >= 4"),
        (["--stream-buffer", "0"], "--stream-buffer: stream_buffer=0 must be an int >= 1"),
        (["--shutdown-grace-s", "nan"], "--shutdown-grace-s=nan must be a finite number"),
        (["--frames-per-byte", "0"], "--frames-per-byte: frames_per_byte=0.0 must be a finite number > 0.0"),
        (["--voices", "0"], "--voices=0 must be None or an int in [1, 2147483647]"),
        (["--voices", str(2**31)], "--voices=2147483648 must be None or an int in [1, 2147483647]"),
        (["--history", "0"], "--history: history=0 must be an int >= 1"),
        (["--offload-paused-after-s", "-1"], "offload_paused_after_s=-1.0 must be None or a finite number"),
        (["--host", ""], "--host='' must be a non-empty address"),
        (["--config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml: no such file"),
        (["--config", "DIR"], "cannot read it"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line(flags, says, tmp_path, capsys):
    flags = [str(tmp_path) if flag == "DIR" else flag for flag in flags]
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mstar-jax serve: error: ")
    assert says in err
    assert len(err.splitlines()) == 1


def test_a_text_vocabulary_under_256_bytes_exits_2(tts_config, tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(tts_config.read_text().replace("text_vocab_size: 256", "text_vocab_size: 16"))
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.config.text_vocab_size=16 must be >= 256: the server speaks UTF-8 bytes" in err


def test_a_port_in_use_exits_2_before_the_engine_is_built_and_writes_nothing(tts_config, tmp_path, capsys):
    config, cache = tmp_path / "tts.yaml", tmp_path / "new-cache"
    yaml_text = re.sub(r"persistent_cache_dir: .*", f"persistent_cache_dir: {cache}", tts_config.read_text())
    config.write_text(yaml_text)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--config", str(config), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--host='127.0.0.1' --port={port}: cannot bind it" in err
    assert len(err.splitlines()) == 1
    assert not cache.exists()  # made only once nothing else refuses


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-waiting", "many"], "invalid int value: 'many'"),
        (["--offload-paused-after-s", "soon"], "'soon' must be a number or 'none'"),
        (["--log-level", "loud"], "invalid choice: 'loud'"),
    ],
)
def test_argparse_refuses_a_value_of_the_wrong_type(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *flags])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"max_waiting": True}, "max_waiting=True must be an int >= 1"),
        ({"max_waiting": 0}, "max_waiting=0 must be an int >= 1"),
        ({"segment_bytes": 3}, "segment_bytes=3 must be an int >= 4"),
        ({"segment_bytes": 4.0}, "segment_bytes=4.0 must be an int >= 4"),
        ({"max_body_bytes": 0}, "max_body_bytes=0 must be an int >= 1"),
        ({"shutdown_grace_s": float("inf")}, "shutdown_grace_s=inf must be a finite number >= 0.0"),
        ({"frames_per_byte": "1"}, "frames_per_byte='1' must be a number > 0.0"),
        ({"default_max_tokens": 10, "max_tokens": 5}, "default_max_tokens=10 must be <= max_tokens=5"),
        ({"segment_bytes": 65, "max_input_bytes": 64}, "segment_bytes=65 must be <= max_input_bytes=64"),
        ({"offload_paused_after_s": float("nan")}, "offload_paused_after_s=nan must be None or a finite"),
        # A request's count past int32 would be refused by the engine, as a 500 (the program's int32).
        ({"max_frames": 2**31}, "max_frames=2147483648 must be an int in [1, 2147483647]"),
        ({"max_tokens": 2**31}, "max_tokens=2147483648 must be an int in [1, 2147483647]"),
        ({"default_max_tokens": 2**31}, "default_max_tokens=2147483648 must be an int in [1, 2147483647]"),
        ({"max_waiting": "x" * 10**6}, "max_waiting='xxxxxxxxxxxx"),  # named, not echoed whole
    ],
)
def test_server_settings_refuse_bad_values(settings, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("(", r"\(")) as refused:
        ServerSettings(**settings)
    assert len(str(refused.value)) < 200


def test_frames_for_a_text_are_its_bytes_times_frames_per_byte_over_speed_within_max_frames():
    tokens = ByteTokenizer(256, frames_per_byte=8.0, max_frames=1500)
    brute = {(n, speed): max(1, min(1500, math.ceil(n * 8.0 / speed))) for n in (0, 1, 13, 187, 188, 4096)
             for speed in (0.25, 1.0, 3.0)}  # fmt: skip
    assert {key: tokens.frames_for(*key) for key in brute} == brute
    # However large the rate, a text speaks at most max_frames (once an OverflowError and a 500).
    huge = ByteTokenizer(256, frames_per_byte=1e308, max_frames=1500)
    assert [huge.frames_for(n, 0.25) for n in (1, 4096)] == [1500, 1500]
    with pytest.raises(ValueError, match=r"max_frames=2147483648 must be an int in \[1, 2147483647\]"):
        ByteTokenizer(256, frames_per_byte=1.0, max_frames=2**31)


def test_the_host_and_the_app_refuse_bad_arguments(tts):
    engine, voices = tts
    with pytest.raises(TypeError, match="engine=3 must be a ServingEngine"):
        EngineHost(3)
    with pytest.raises(ValueError, match="stream_buffer=0 must be an int >= 1"):
        EngineHost(engine, stream_buffer=0)
    with pytest.raises(ValueError, match="max_waiting=0 must be an int >= 1"):
        EngineHost(engine, max_waiting=0)
    with pytest.raises(ValueError, match="history=0 must be an int >= 1"):
        EngineHost(engine, history=0)
    with pytest.raises(ValueError, match="offload_paused_after_s=-1 must be None or a finite number"):
        EngineHost(engine, offload_paused_after_s=-1)
    with pytest.raises(TypeError, match="observer=1 must be a HostObserver or None"):
        EngineHost(engine, observer=1)
    host = EngineHost(engine)
    host.begin_delivery()
    for count, says in ((2, r"count=2 must be an int in \[0, 1\]"), (-1, "count=-1"), (1.0, "count=1.0"),
                        (float("nan"), "count=nan"), (True, "count=True")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            host.end_delivery(count)
        assert host.delivering == 1  # refused before anything changed
    host.end_delivery()
    assert host.delivering == 0
    routes = speech_routes(voices)
    with pytest.raises(TypeError, match=r"settings=.* must be a ServerSettings"):
        create_app(engine, {"max_waiting": 1}, model_name="x", routes=routes)
    with pytest.raises(ValueError, match="model_name='' must be a non-empty str"):
        create_app(engine, model_name="", routes=routes)
    with pytest.raises(TypeError, match=r"routes=\{'voice-0': .*\} must be a ModelRoutes"):
        create_app(engine, model_name="x", routes=voices)
    with pytest.raises(ValueError, match="voices must name at least one registered voice"):
        speech_routes({})


def test_a_running_host_is_the_only_thread_that_drives_its_engine(tts):
    # A second thread stepping the engine would donate buffers the host's step still holds (a request's
    # cache lost at random): it is refused, before any state changes, and allowed again once it stops.
    engine, voices = tts

    def speak(rid: str) -> bytes:
        request = TTSRequest(rid, (104, 105), voices["voice-0"], 4, 0)
        return b"".join(pcm16(chunk.samples) for chunk in engine.stream(request))

    before = speak("before-the-host")
    host = EngineHost(engine).start()
    try:
        wait_for(lambda: engine.driver is not None, "the host thread to take the engine", 30)
        request = TTSRequest("not-through-the-host", (104, 105), voices["voice-0"], 4, 0)
        voice = engine.voices.voices[0]
        calls = [
            ("submit", (request,), {}), ("step", (), {}), ("cancel", ("anyone",), {}),
            ("pause", ("anyone",), {}), ("resume", ("anyone",), {}), ("offload", ("anyone",), {}),
            ("snapshot", (), {}), ("drain", (), {}), ("warm_up", (), {}),
            ("add_voice", (0,), {"frames": 2, "seed": 99}),
        ]  # fmt: skip
        for call, args, kwargs in calls:
            with pytest.raises(RuntimeError, match=rf"ServingEngine\.{call}\(\) was called from thread "
                               r"'MainThread' while an EngineHost drives this engine"):  # fmt: skip
                getattr(engine, call)(*args, **kwargs)
        assert "not-through-the-host" not in engine.streams
        assert engine.voices.voices[0] is voice
    finally:
        host.close()
    assert engine.driver is None
    assert speak("after-the-host") == before  # this thread may drive it again, to the same audio


def _speak(url: str, text: str, outcomes: list, answered: threading.Event | None = None) -> None:
    """Speak `text` over SSE; record how it ended. `answered` is set once the server has answered."""
    body = {"model": "streaming_tts", "voice": "voice-0", "input": text, "stream_format": "sse"}
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=60) as response:
            if answered is not None:
                answered.set()
            if response.status_code != 200:  # submitted after the signal: refused, typed
                response.read()
                outcomes.append(("refused", response.status_code, {"type": "error", **response.json()}))
                return
            last = None
            for line in response.iter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])
            outcomes.append(("streamed", 200, last))
    except httpx.TransportError as error:  # pragma: no cover - would be a bug: recorded, then asserted on
        outcomes.append(("broken", None, repr(error)))


def _speak_over_websocket(url: str, text: str, outcomes: list, answered: threading.Event) -> None:
    """Speak `text` over the WebSocket; record its close code and its last JSON message. `answered` is
    set at its first message from the server."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    last = None
    try:
        with connect(url.replace("http", "ws") + "/v1/audio/speech/stream", open_timeout=30) as ws:
            ws.send(json.dumps({"type": "start", "voice": "voice-0", "model": "streaming_tts"}))
            ws.send(json.dumps({"type": "text", "text": text}))
            ws.send(json.dumps({"type": "end"}))
            try:
                while True:
                    message = ws.recv(timeout=60)
                    answered.set()
                    if isinstance(message, str):
                        last = json.loads(message)
            except ConnectionClosed:  # closed by the server, with its code (1000 once done)
                pass
        outcomes.append(("websocket", ws.close_code, last))
    except OSError as error:  # pragma: no cover - would be a bug: recorded, then asserted on
        outcomes.append(("broken", None, repr(error)))


def test_sigterm_under_load_finishes_or_fails_each_request_typed_and_exits_0(tts, tts_config, tmp_path):
    options = ("--shutdown-grace-s", "3", "--max-frames", "8000", "--max-input-bytes", "4000")
    options += ("--frames-per-byte", "2")
    log = tmp_path / "serve.log"
    with serve_process(tts_config, *options, log=log) as (server, url):
        outcomes: list = []
        shorts = [threading.Thread(target=_speak, args=(url, text, outcomes)) for text in ("one", "two")]
        for thread in shorts:  # served before the signal
            thread.start()
            thread.join(60)
        # In flight at the signal: one that finishes within the grace period, most likely, and two of
        # 8,000 frames that cannot.
        texts = ["m" * 150, "x" * 4000, "y" * 4000]
        answered = [threading.Event() for _ in range(len(texts) + 1)]
        threads = [
            threading.Thread(target=_speak, args=(url, text, outcomes, event))
            for text, event in zip(texts, answered, strict=False)
        ]
        # And a WebSocket in flight: its segment is given the grace period too, not closed at once.
        spoken: list = []
        threads.append(
            threading.Thread(target=_speak_over_websocket, args=(url, "w" * 120, spoken, answered[-1]))
        )
        for thread in threads:
            thread.start()
        # Every client answered (so none connects after the signal, when the listener has closed).
        wait_for(lambda: all(e.is_set() for e in answered), "every client to be answered", timeout_s=60)
        wait_for(lambda: _live_streams(url) >= 2, "the long streams to be under way", timeout_s=30)
        server.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.wait(60) == 0, log.read_text()
    assert len(outcomes) == 2 + len(texts)
    assert all(kind == "streamed" or (kind, status) == ("refused", 503) for kind, status, _ in outcomes), (
        outcomes
    )
    finished = [last for _, _, last in outcomes if last["type"] == "speech.audio.done"]
    failed = [last["error"] for _, _, last in outcomes if last["type"] == "error"]
    assert len(finished) + len(failed) == 2 + len(texts)
    assert len(finished) >= 2  # the short ones
    assert len(failed) >= 2, "the 8,000-frame streams outlast a 3 s grace period"
    assert all(e["type"] == "shutting_down" and e["retryable"] for e in failed), failed
    [(kind, code, last)] = spoken
    assert kind == "websocket"
    assert (code, last["type"]) in ((1000, "done"), (1013, "error")), (code, last)  # never 1012


def _live_streams(url: str) -> float:
    try:
        metrics = httpx.get(f"{url}/metrics", timeout=1).text
    except httpx.TransportError:
        return 0.0
    for line in metrics.splitlines():
        if line.startswith('mstar_slots_in_use{cache="talker_kv"}'):
            return float(line.split()[-1])
    return 0.0
