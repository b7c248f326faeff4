"""The text endpoints of a Gemma 3 deployment, OpenAI's: completions, chat completions, models.

- `POST /v1/completions`: `model`, `prompt` (a string, or a list of token ids, as OpenAI's API takes
  it), `max_tokens`, `stop` (up to 4 strings), `temperature`, `seed`, `stream`.
- `POST /v1/chat/completions`: `messages` (`system`, `user`, `assistant`; content a string or a list of
  text parts) in Gemma's chat template (`mstar_jax.models.gemma3.chat.TextTokenizer.chat`), the same
  options, with `max_completion_tokens` (OpenAI's newer name) taken for `max_tokens`.
- `GET /v1/models`: the model served (for every deployment).

Streams are SSE: one chunk per token (its text and, as an extension, its id in `token_ids`), a last
chunk with `finish_reason` (`stop`: a stop token or string; `length`: `max_tokens`), then `[DONE]`.
The default temperature is 0, greedy (this server's default, not OpenAI's 1); `temperature` and
`seed` go to the `TextRequest` (sampled on the device, keyed by the seed). An engine whose
`TextRequest` has no such fields refuses a temperature other than 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from mstar_jax.checks import brief
from mstar_jax.models.gemma3.chat import IncrementalDecoder, TextTokenizer
from mstar_jax.models.gemma3.serving import TextRequest
from mstar_jax.server.admission import check_resources, submit_counted
from mstar_jax.server.errors import BadRequestError
from mstar_jax.server.fields import Body, check_text
from mstar_jax.server.handle import RequestHandle
from mstar_jax.server.host import EngineHost
from mstar_jax.server.metrics import ServerMetrics
from mstar_jax.server.responses import (
    ClientGoneError,
    HandleResponse,
    error_response,
    open_stream,
    sse,
    sse_error,
    until_gone,
)
from mstar_jax.server.routes import ModelRoutes, ServerContext
from mstar_jax.server.settings import ServerSettings

__all__ = ["StopMatcher", "TextService", "text_router", "text_routes"]

MAX_STOP_CHARS = 256
"""The longest `stop` string a request may give (each is matched against every token's text)."""
_ROLES = ("system", "user", "assistant")


class StopMatcher:
    """Text out as it becomes final with respect to stop strings: `feed(text)` returns what may be sent
    and whether a stop string was met (the text before it is sent, the rest never)."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held = tuple(stops), ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.held += text
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.held = self.held[: min(found)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclasses.dataclass
class TextService:
    """What the text endpoints need: the host, the limits, the served name and the tokenizer."""

    host: EngineHost
    settings: ServerSettings
    model_name: str
    tokenizer: TextTokenizer
    metrics: ServerMetrics
    _ids: Any = dataclasses.field(default_factory=itertools.count)

    def request(
        self, body: Body, prompt: list[int], *, stop_tokens: tuple[int, ...], chat: bool = False
    ) -> TextRequest:
        """The engine's request for `body` (a chat's `max_completion_tokens` is its `max_tokens`)."""
        body.choice("model", [self.model_name], default=self.model_name)
        settings = self.settings
        field = "max_tokens"
        if chat and body.fields.get("max_completion_tokens") is not None:
            if body.fields.get("max_tokens") is not None:
                raise BadRequestError(
                    "max_tokens and max_completion_tokens are both given; give one (max_completion_tokens "
                    "is OpenAI's newer name for it)",
                    param="max_completion_tokens",
                )
            field = "max_completion_tokens"
        max_tokens = body.integer(
            field, minimum=1, maximum=settings.max_tokens, default=settings.default_max_tokens
        )
        temperature = body.number("temperature", minimum=0.0, maximum=2.0, default=0.0)
        seed = body.integer("seed", minimum=0, maximum=2**32 - 1, default=0)
        body.integer("n", minimum=1, maximum=1, default=1)  # one choice a request
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(
                f"prompt token ids {bad[:5]} must be in [0, {vocab})", param="prompt", code="invalid_value"
            )
        if not prompt:
            raise BadRequestError("prompt is empty; it needs at least one token", param="prompt")
        check_resources(self.host.managers, {"decode": (field, max_tokens)})
        rid = f"text-{next(self._ids)}"
        return TextRequest(rid, tuple(prompt), max_tokens, stop_tokens, temperature=temperature, seed=seed)

    def submit(self, request: TextRequest) -> RequestHandle:
        return submit_counted(self.host, self.metrics, request)

    def encode(self, text: str, field: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as error:
            raise BadRequestError(f"{field}: {error}", param=field) from None


def _prompt(service: TextService, body: Body) -> list[int]:
    value = body.fields.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str) and value:
        return [service.tokenizer.bos_id, *service.encode(check_text("prompt", value), "prompt")]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    raise BadRequestError(
        f"prompt={brief(value)} must be a non-empty string or a non-empty list of token ids (one "
        "prompt: batches are not served)",
        param="prompt", code="invalid_value",
    )  # fmt: skip


def _messages(service: TextService, body: Body) -> list[int]:
    messages = body.fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError(f"messages={brief(messages)} must be a non-empty list", param="messages")
    turns = []
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequestError(
                f"{name}={brief(message)} must be an object with role and content", param=name
            )
        try:
            role = Body(message).choice("role", _ROLES)
        except BadRequestError as error:
            raise BadRequestError(f"{name}.{error.message}", param=f"{name}.role") from None
        turns.append((role, _content(name, message.get("content"))))
    try:
        return service.tokenizer.chat(turns)
    except ValueError as error:
        raise BadRequestError(f"messages: {error}", param="messages") from None


def _content(name: str, content: Any) -> str:
    """A message's content: a string, or text parts joined, each trimmed (as Gemma's template)."""
    if isinstance(content, str):
        return check_text(f"{name}.content", content)
    if not isinstance(content, list):
        raise BadRequestError(
            f"{name}.content={brief(content)} must be a string or a list of text parts",
            param=f"{name}.content",
        )
    texts = []
    for j, part in enumerate(content):
        field = f"{name}.content[{j}]"
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise BadRequestError(
                f"{field}={brief(part)} must be a text part, {{'type': 'text', 'text': a string}}",
                param=field,
            )
        texts.append(check_text(f"{field}.text", part["text"]).strip())
    return "".join(texts)


def text_routes(tokenizer: TextTokenizer) -> ModelRoutes:
    """The completion endpoints (module doc) of a text model speaking `tokenizer`'s vocabulary.

    Raises:
      TypeError: `tokenizer` is not a `TextTokenizer`.
    """
    if not isinstance(tokenizer, TextTokenizer):
        raise TypeError(f"tokenizer={tokenizer!r} must be a TextTokenizer for a text engine")

    def router(context: ServerContext) -> APIRouter:
        service = TextService(context.host, context.settings, context.model_name, tokenizer, context.metrics)
        return text_router(service)

    return ModelRoutes("token", router)


def text_router(service: TextService) -> APIRouter:
    """The completion endpoints (module doc) over `service`."""
    router = APIRouter()

    async def serve(request: Request, chat: bool) -> Response:
        def prepare(body: Body) -> tuple:
            stream = body.boolean("stream", default=False)
            stops = body.strings("stop", most=4, longest=MAX_STOP_CHARS)
            prompt = _messages(service, body) if chat else _prompt(service, body)
            stop_tokens = service.tokenizer.stop_tokens if chat else (service.tokenizer.eos_id,)
            text_request = service.request(body, prompt, stop_tokens=stop_tokens, chat=chat)
            return (stream, stops, text_request), text_request

        opened = await open_stream(request, service, prepare)
        if isinstance(opened, Response):
            return opened
        (stream, stops, text_request), handle, first = opened
        pieces = _pieces(service, handle, first, text_request, stops)
        shape = _Shape(service.model_name, chat, text_request)
        if stream:
            return HandleResponse(handle, _sse(pieces, shape), media_type="text/event-stream")

        async def gather() -> list:
            return [piece async for piece in pieces]

        try:  # a client that leaves while the whole completion is gathered cancels it
            parts = await until_gone(request, handle, gather())
        except ClientGoneError:
            return Response(status_code=499)
        except Exception as error:
            return error_response(error)
        return JSONResponse(shape.whole(parts))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    return router


async def _pieces(
    service: TextService, handle: RequestHandle, first: int | None, request: TextRequest, stops: Sequence[str]
) -> AsyncIterator[tuple[str, int | None, str | None]]:
    """`(text, token id, finish_reason)` per token, the last with its finish reason (None before)."""
    decoder, matcher, count = IncrementalDecoder(service.tokenizer), StopMatcher(stops), 0
    try:
        tokens = _tokens(handle, first)
        async for token in tokens:
            count += 1
            text, stopped = matcher.feed(decoder.push(token))
            if stopped:
                handle.cancel(outcome="done")  # the client has its completion: the rest is not made
                yield text, token, "stop"
                return
            last = count == request.max_new_tokens or token in request.stop_tokens
            if last:
                reason = "stop" if token in request.stop_tokens else "length"
                yield text + matcher.flush(), token, reason
                return
            yield text, token, None
        yield matcher.flush(), None, "stop"  # pragma: no cover - the engine ends at one of the above
    finally:
        handle.cancel()


async def _tokens(handle: RequestHandle, first: int | None) -> AsyncIterator[int]:
    if first is None:
        return
    yield first
    async for token in handle:
        yield token


class _Shape:
    """OpenAI's response objects for completions and chat completions."""

    def __init__(self, model: str, chat: bool, request: TextRequest):
        self.model, self.chat, self.request = model, chat, request
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def chunk(self, text: str, tokens: list[int], reason: str | None, *, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "token_ids": tokens}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": tokens}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage(self, completion: int) -> dict[str, int]:
        prompt = len(self.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self, parts: list[tuple[str, int | None, str | None]]) -> dict:
        text = "".join(p[0] for p in parts)
        tokens = [p[1] for p in parts if p[1] is not None]
        reason = parts[-1][2] if parts else "stop"
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": reason, "token_ids": tokens}
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
                "token_ids": tokens,
            }
        return {**self._head(self.object), "choices": [choice], "usage": self.usage(len(tokens))}


async def _sse(pieces: AsyncIterator[tuple[str, int | None, str | None]], shape: _Shape):
    first = True
    try:
        async for text, token, reason in pieces:
            yield sse(shape.chunk(text, [] if token is None else [token], reason, first=first))
            first = False
    except Exception as error:
        yield sse_error(error)
        return
    yield sse("[DONE]")
