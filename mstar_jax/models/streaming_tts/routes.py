"""The speech endpoints of a streaming TTS deployment, OpenAI's where OpenAI defines one.

- `POST /v1/audio/speech`: `model`, `input`, `voice`, `response_format` (`wav`, the default, or
  `pcm`), `stream_format` (`audio`: the bytes as they come; `sse`: `speech.audio.delta` events of
  base64 audio, then `speech.audio.done`), `speed` (0.25 to 4: fewer or more frames for the text) and
  `seed` (an extension: the same request and seed give the same audio). Audio is sent chunk by chunk as
  the flow decoder produces it.
- `GET /v1/audio/voices`: the voices registered at start-up, `voice-0`, `voice-1`, ...
- `WebSocket /v1/audio/speech/stream`: text in as it is written (a voice agent's LLM, token by
  token), audio out as it is made. Client messages are JSON: `{"type": "start", "voice", "model",
  "seed"}` (optional, first), `{"type": "text", "text"}`, `{"type": "flush"}` (speak what is buffered),
  `{"type": "end"}` (speak the rest, then close). The text is spoken in segments, each ending at a
  sentence's end (`.`, `!`, `?` or a newline, then a space), at a flush, or past
  `ServerSettings.segment_bytes`; the server sends each segment's audio as binary frames of PCM, in
  order, then `{"type": "segment.done", "index"}`, and `{"type": "done"}` before closing with 1000. A
  refused message closes with 1007, a retryable failure (overload, a lost device state, shutdown) with
  1013, any other failure with 1011, each after an `{"type": "error", "error": {...}}` message.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocketDisconnect

from mstar_jax.models.streaming_tts.audio import SAMPLE_RATE, pcm16, wav_header
from mstar_jax.models.streaming_tts.request import AudioChunk, TTSRequest
from mstar_jax.models.streaming_tts.serving import Engine
from mstar_jax.models.streaming_tts.tokenizer import ByteTokenizer
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.server.admission import check_resources, submit_counted
from mstar_jax.server.errors import (
    WS_CLOSE_BAD_INPUT,
    WS_CLOSE_FAILED,
    WS_CLOSE_RETRY,
    BadRequestError,
    wire_error,
)
from mstar_jax.server.fields import Body, parse_json
from mstar_jax.server.handle import RequestHandle
from mstar_jax.server.host import EngineHost
from mstar_jax.server.metrics import ServerMetrics
from mstar_jax.server.responses import (
    HandleResponse,
    open_stream,
    sse,
    sse_error,
)
from mstar_jax.server.routes import ModelRoutes, ServerContext
from mstar_jax.server.settings import ServerSettings

__all__ = [
    "RESPONSE_FORMATS",
    "STREAM_FORMATS",
    "SpeechService",
    "segment_end",
    "speech_router",
    "speech_routes",
]

RESPONSE_FORMATS = ("wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
_MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm"}
_SENTENCE_END = re.compile(r"[.!?\n][\"')\]]*\s")
_PENDING_SEGMENTS = 2  # a WebSocket stops reading its client past this many segments not yet spoken


@dataclasses.dataclass
class SpeechService:
    """What the speech endpoints need: the host, the limits, the served name, the voices by name."""

    host: EngineHost
    settings: ServerSettings
    model_name: str
    voices: dict[str, Voice]
    tokenizer: ByteTokenizer
    metrics: ServerMetrics
    _ids: Any = dataclasses.field(default_factory=itertools.count)

    def request(self, body: Body, text: str, *, field: str = "input") -> TTSRequest:
        """The `TTSRequest` of `text` with the body's voice, speed and seed, every field checked."""
        body.choice("model", [self.model_name], default=self.model_name)
        voice = self.voices[body.choice("voice", list(self.voices), default=next(iter(self.voices)))]
        speed = body.number("speed", minimum=0.25, maximum=4.0, default=1.0)
        seed = body.integer("seed", minimum=0, maximum=2**32 - 1, default=0)
        tokens = self.tokenizer.encode(text)
        limit = self.settings.max_input_bytes
        if len(tokens) > limit:
            raise BadRequestError(
                f"{field} is {len(tokens)} UTF-8 bytes; it must be at most max_input_bytes={limit}",
                param=field, code="input_too_long",
            )  # fmt: skip
        frames = self.tokenizer.frames_for(len(tokens), speed)
        check_resources(self.host.managers, {"talker_decode": (field, frames)})
        return TTSRequest(f"speech-{next(self._ids)}", tokens, voice, frames, seed)

    def submit(self, request: TTSRequest) -> RequestHandle:
        return submit_counted(self.host, self.metrics, request)


def speech_routes(voices: Mapping[str, Voice]) -> ModelRoutes:
    """The speech endpoints (module doc) of a TTS `Engine` with `voices` registered (name -> `Voice`).

    Raises:
      ValueError: no voice; TypeError (when mounted): an engine of another model.
    """
    voices = dict(voices)
    if not voices:
        raise ValueError("voices must name at least one registered voice for a speech engine")

    def router(context: ServerContext) -> APIRouter:
        engine, settings = context.host.engine, context.settings
        if not isinstance(engine, Engine):
            raise TypeError(f"engine={engine!r} must be the streaming TTS model's Engine for speech routes")
        tokenizer = ByteTokenizer(
            engine.model.config.text_vocab_size, frames_per_byte=settings.frames_per_byte,
            max_frames=settings.max_frames,
        )  # fmt: skip
        name, metrics = context.model_name, context.metrics
        return speech_router(SpeechService(context.host, settings, name, voices, tokenizer, metrics))

    return ModelRoutes("audio", router)


def speech_router(service: SpeechService) -> APIRouter:
    """The speech endpoints (module doc) over `service`."""
    router = APIRouter()

    @router.get("/v1/audio/voices")
    async def voices() -> JSONResponse:
        listed = [
            {"voice_id": name, "name": name, "frames": v.frames, "index": v.index}
            for name, v in service.voices.items()
        ]
        return JSONResponse({"object": "list", "voices": listed, "sample_rate": SAMPLE_RATE})

    @router.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        def prepare(body: Body) -> tuple:
            text = body.string("input")
            response_format = body.choice("response_format", RESPONSE_FORMATS, default="wav")
            stream_format = body.choice("stream_format", STREAM_FORMATS, default="audio")
            tts = service.request(body, text)
            return (response_format, stream_format, tts), tts

        opened = await open_stream(request, service, prepare)
        if isinstance(opened, Response):
            return opened
        (response_format, stream_format, tts), handle, first = opened
        chunks = _audio(handle, first, response_format)
        if stream_format == "sse":
            return HandleResponse(
                handle,
                _sse(chunks, tts),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return HandleResponse(handle, chunks, media_type=_MEDIA[response_format])

    @router.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        await websocket.accept()
        await _Session(service, websocket).run()

    return router


async def _audio(handle: RequestHandle, first: AudioChunk | None, response_format: str):
    """The request's audio bytes, chunk by chunk; cancels the request if its reader stops early."""
    try:
        if response_format == "wav":
            yield wav_header()
        if first is not None:
            yield pcm16(first.samples)
            async for chunk in handle:
                yield pcm16(chunk.samples)
    finally:
        handle.cancel()  # nothing once it ended; else its client left: free its slots


async def _sse(chunks, tts: TTSRequest):
    """The audio as OpenAI's speech events; a failure after the first byte is an `error` event."""
    try:
        async for data in chunks:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except Exception as error:
        yield sse_error(error)
        return
    usage = {"input_tokens": len(tts.text), "output_tokens": tts.frames}
    yield sse({"type": "speech.audio.done", "usage": {**usage, "total_tokens": sum(usage.values())}})


def segment_end(text: str, limit: int, *, final: bool) -> int:
    """Where the first segment of buffered `text` ends (0: wait for more): after its first sentence's
    end within `limit` UTF-8 bytes; else, past `limit` bytes, after the last space within them (or
    at the last character within them); else, when `final` or at `limit` bytes, after all of it.
    `limit` is at least 4, so a segment holds at least one character."""
    if not text:
        return 0
    encoded = text.encode()
    room = len(encoded[:limit].decode("utf-8", "ignore"))  # the characters within `limit` bytes
    end = _SENTENCE_END.search(text, 0, room)
    if end is not None:
        return end.end()
    if len(encoded) > limit:
        return text.rfind(" ", 0, room) + 1 or room
    return len(text) if final or len(encoded) == limit else 0


def _unless_gone(received: dict[str, Any]) -> dict[str, Any]:
    """A WebSocket's message as received; raises `WebSocketDisconnect` where it says the client left."""
    if received["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(received.get("code", 1000))
    return received


class _Session:
    """One WebSocket's text in, audio out (module doc)."""

    def __init__(self, service: SpeechService, websocket: WebSocket):
        self.service, self.ws = service, websocket
        self.segments: asyncio.Queue[RequestHandle | None] = asyncio.Queue(_PENDING_SEGMENTS)
        self.handles: list[RequestHandle] = []
        self.options = Body({})
        self.buffer = ""
        self.ended = False
        self._ahead: asyncio.Future | None = None  # a message read while the writer's queue was full
        self._undelivered = 0  # items queued for the writer and not yet sent whole (`host.delivering`)

    async def run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        writer = asyncio.ensure_future(self._write())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            ended = reader in done and reader.exception() is None and reader.result() == "end"
            if ended and writer not in done:  # every segment submitted: speak them unless the client leaves
                reader = asyncio.ensure_future(self._read(after_end=True))
                await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            failed = next((t for t in (reader, writer) if t.done() and t.exception() is not None), None)
            if failed is not None:  # the other stops first: it must not send once the socket closes
                for task in (reader, writer):
                    task.cancel()
                await asyncio.gather(reader, writer, return_exceptions=True)
                await self._fail(failed.exception())
        finally:
            for task in (reader, writer, self._ahead):
                if task is not None:
                    task.cancel()
            self.service.host.end_delivery(self._undelivered)
            self._undelivered = 0
            for handle in self.handles:
                handle.cancel()

    async def _fail(self, error: BaseException) -> None:
        if isinstance(error, WebSocketDisconnect):
            return
        wired = wire_error(error)
        code = WS_CLOSE_BAD_INPUT if wired.status in (400, 413) else (
            WS_CLOSE_RETRY if wired.retryable else WS_CLOSE_FAILED
        )  # fmt: skip
        try:
            await self.ws.send_text(json.dumps({"type": "error", **wired.body()}))
            await self.ws.close(code=code, reason=wired.kind)
        except Exception:
            pass

    async def _read(self, *, after_end: bool = False) -> str:
        """Take the client's messages until its `end` ("end") or until it leaves ("gone"). `after_end`:
        the client may only leave now; a message it sends is refused."""
        try:
            for number in itertools.count(1):
                received = await self._receive()
                if after_end:
                    raise BadRequestError("a message after type='end'; the client may only close now")
                await self._take(number, received.get("text"))
                if self.ended:
                    return "end"
        except WebSocketDisconnect:
            return "gone"
        except BadRequestError:  # the client's message refused before the host saw it: counted here
            self.service.metrics.refused("invalid")
            raise

    async def _receive(self) -> dict[str, Any]:
        """The client's next message (the one read ahead, if any); raises `WebSocketDisconnect` when it
        has left."""
        received = await (self._ahead or self.ws.receive())
        self._ahead = None
        return _unless_gone(received)

    async def _queue(self, item: RequestHandle | None) -> None:
        """Hand `item` to the writer. While its queue is full, read the client's next message ahead, so
        that a client that leaves is seen at once (its segments cancelled), not only once the writer
        next sends; one message ahead is as far as a full queue lets the client get. A shutdown waits
        for the item to be sent (`EngineHost.delivering`): a segment's audio, or the session's end."""
        self.service.host.begin_delivery()
        self._undelivered += 1
        if not self.segments.full():
            self.segments.put_nowait(item)
            return
        put = asyncio.ensure_future(self.segments.put(item))
        try:
            while not put.done():
                if self._ahead is None:
                    self._ahead = asyncio.ensure_future(self.ws.receive())
                await asyncio.wait({put, self._ahead}, return_when=asyncio.FIRST_COMPLETED)
                if self._ahead.done():  # a message, kept for `_receive`; or the client left
                    _unless_gone(self._ahead.result())
                    await put
        finally:
            put.cancel()

    async def _take(self, number: int, raw: str | None) -> None:
        """Act on the client's message `number` (1: its first), `raw` its text (None: binary)."""
        if raw is None:  # a binary frame: the client speaks JSON text messages only
            raise BadRequestError("a message must be a JSON text frame, not binary", param="type")
        if len(raw.encode()) > self.service.settings.max_body_bytes:
            raise BadRequestError(f"a message is over max_body_bytes={self.service.settings.max_body_bytes}")
        message = parse_json(raw)
        kind = message.choice("type", ("start", "text", "flush", "end"))
        if kind == "start":
            if number > 1:  # the voice of text already sent must not change
                raise BadRequestError(
                    f"type='start' is message {number}; it may only be the first", param="type"
                )
            self.options = message
            self.service.request(message, " ")  # its fields checked now, not at the first segment
        elif kind == "text":
            self.buffer += message.string("text", empty=True)
            await self._cut(final=False)
        else:
            await self._cut(final=True)
            if kind == "end":
                await self._queue(None)
                self.ended = True

    async def _cut(self, *, final: bool) -> None:
        """Submit the buffered text's complete segments (all of it when `final`)."""
        while cut := segment_end(self.buffer, self.service.settings.segment_bytes, final=final):
            text, self.buffer = self.buffer[:cut], self.buffer[cut:]
            if text.strip():
                handle = self.service.submit(self.service.request(self.options, text, field="text"))
                self.handles = [h for h in self.handles if not h.ended]  # a long session keeps none
                self.handles.append(handle)
                await self._queue(handle)

    async def _write(self) -> None:
        index = 0
        while (handle := await self.segments.get()) is not None:
            async for chunk in handle:
                await self.ws.send_bytes(pcm16(chunk.samples))
            await self.ws.send_text(json.dumps({"type": "segment.done", "index": index}))
            self._delivered()
            index += 1
        await self.ws.send_text(json.dumps({"type": "done"}))
        await self.ws.close(code=1000)
        self._delivered()

    def _delivered(self) -> None:
        self._undelivered -= 1
        self.service.host.end_delivery()
