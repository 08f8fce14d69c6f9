"""The FastAPI app of ``agentrl serve model``: an OpenAI-compatible API over any RolloutEngine + ChatFormat.

Endpoints:

- ``GET /v1/models``: the one served model; its ``agentrl`` field describes the chat format (see
  :mod:`agentrl.engines.server.served_format`). ``GET /v1/agentrl/format[?files=true]``: the full description.
- ``POST /v1/completions``: token-in-token-out. ``prompt`` is token ids, a batch of them, or text
  (encoded with the format, no special tokens). ``max_tokens`` (default 16), ``temperature``, ``top_p``,
  ``top_k``, ``seed``, ``n``, ``stop_token_ids`` (default: the format's stop tokens), ``logprobs``. Each
  choice carries ``token_ids`` (the vLLM ``return_token_ids`` extension; always sent), ``text``, and with
  ``logprobs`` set ``{tokens, token_logprobs, top_logprobs, text_offset}`` where ``tokens`` are
  ``"token_id:N"`` strings if ``return_tokens_as_token_ids`` else decoded pieces.
- ``POST /v1/chat/completions``: messages and ``tools`` are rendered with the ChatFormat, the completion
  is parsed back into ``content``, ``reasoning_content`` and ``tool_calls`` (``finish_reason``
  ``tool_calls``). ``stream: true`` answers with SSE chunks sent as the tokens are sampled (for engines
  whose ``generate`` takes ``on_token``, such as the transformers engine; others stream once sampled);
  ``stream_options.include_usage`` adds a usage chunk. ``logprobs: true`` returns per-token log-probs;
  ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids``.
- ``GET /health``.

Requests and responses are pydantic models (:mod:`agentrl.engines.server.openai_api`). Errors follow the OpenAI
shape ``{"error": {"message", "type", "code"}}``: 400 for a bad request (the message names the field), 401
for a wrong API key, 503 when generation was aborted by a shutdown, 500 when the engine fails.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrl.engines.base import Completion, EngineAborted, RolloutEngine, SamplingParams
from agentrl.engines.server.chat_stream import DeltaStreamer, delta_choice, sse_chunk
from agentrl.engines.server.openai_api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    RequestError,
    Usage,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    openai_to_messages,
    openai_to_tools,
    prompt_batch,
    turn_to_message,
    validation_message,
)
from agentrl.engines.server.served_format import describe_format
from agentrl.harmony.format import ChatFormat

OnToken = Callable[[int, int], None]


def _json(model: Any) -> Response:
    """A pydantic response serialised by pydantic-core (FastAPI's encoder would walk every token id)."""
    return Response(model.model_dump_json(exclude_none=True), media_type="application/json")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class _BearerAuth:
    """Plain ASGI middleware: HTTP requests without ``Authorization: <expected>`` get a 401 (much cheaper
    per request than Starlette's ``BaseHTTPMiddleware``)."""

    def __init__(self, app: Any, expected: bytes):
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            await _error(401, "invalid or missing API key", "authentication_error")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Sampler:
    """``n`` samples per prompt through the engine; sample ``j`` uses seed ``seed + j`` when a seed is
    given. ``on_token(choice_index, token_id)`` is forwarded when the engine supports it."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.streams = "on_token" in inspect.signature(engine.generate).parameters

    async def _generate(self, prompts: list[list[int]], s: SamplingParams, on_token: OnToken | None) -> list[Completion]:
        if on_token is not None and self.streams:
            return await self.engine.generate(prompts, s, on_token=on_token)  # type: ignore[call-arg]
        return await self.engine.generate(prompts, s)

    async def sample(
        self, prompts: list[list[int]], s: SamplingParams, n: int, on_token: OnToken | None = None
    ) -> list[Completion]:
        """Completions ordered prompt-major: ``[p0s0, p0s1, ..., p1s0, ...]``."""
        if n == 1 or s.seed is None:
            batch = [p for p in prompts for _ in range(n)]
            return await self._generate(batch, s, on_token)
        out: list[Completion] = []
        for j in range(n):
            sj = SamplingParams(**{**s.__dict__, "seed": s.seed + j})
            cb = None if on_token is None else (lambda i, t, j=j: on_token(i * n + j, t))
            out += await self._generate(prompts, sj, cb)
        return [out[j * len(prompts) + i] for i in range(len(prompts)) for j in range(n)]


def create_app(
    engine: RolloutEngine,
    fmt: ChatFormat,
    *,
    model_name: str = "agentrl",
    api_key: str | None = None,
    default_max_tokens: int = 1024,
) -> FastAPI:
    """Build the FastAPI app serving ``engine`` through ``fmt``. ``api_key`` (if set) is required as
    ``Authorization: Bearer <key>``. ``default_max_tokens`` applies to chat requests without a limit."""
    app = FastAPI(title="agentrl model server")
    stop_ids = list(fmt.stop_token_ids)  # looked up once: openai-harmony recomputes them on every call
    sampler = _Sampler(engine)
    summary = describe_format(fmt)
    full_description: list[Any] = []  # built on first request (saving a tokenizer takes a moment)
    if api_key:
        app.add_middleware(_BearerAuth, expected=f"Bearer {api_key}".encode())

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        return _error(400, validation_message(exc.errors()), "invalid_request_error")

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError):
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineAborted)
    async def shutting_down(_: Request, exc: EngineAborted):
        return _error(503, str(exc), "server_shutting_down")

    @app.exception_handler(Exception)
    async def engine_failure(_: Request, exc: Exception):
        return _error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return _json(ModelList(data=[ModelCard(id=model_name, agentrl=summary)]))

    @app.get("/v1/agentrl/format")
    async def served_format(files: bool = False):
        if not files or summary.format == "harmony":
            return _json(summary)
        if not full_description:
            full_description.append(await asyncio.to_thread(describe_format, fmt, with_files=True))
        return _json(full_description[0])

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest):
        prompts = prompt_batch(body.prompt, fmt)
        s = body.sampling(stop_ids, 16)
        comps = await sampler.sample(prompts, s, body.n)
        want_lp = body.logprobs is not None
        choices = [
            CompletionChoice(
                index=i,
                text=fmt.decode(c.token_ids),
                token_ids=list(c.token_ids),
                logprobs=completion_logprobs(c, fmt, body.return_tokens_as_token_ids) if want_lp else None,
                finish_reason=c.finish_reason,
                prompt_token_ids=prompts[i // body.n] if body.return_token_ids else None,
            )
            for i, c in enumerate(comps)
        ]
        usage = Usage.of(sum(len(p) for p in prompts) * body.n, sum(len(c.token_ids) for c in comps))
        return _json(
            CompletionResponse(
                id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name, choices=choices, usage=usage
            )
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatCompletionRequest):
        msgs = openai_to_messages(body.messages)
        tools = [] if body.tool_choice == "none" else openai_to_tools(body.tools)
        prompt = fmt.render_prompt(msgs, tools)
        s = body.sampling(stop_ids, default_max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(sampler, fmt, prompt, s, body.n, rid, created, model_name, include_usage),
                media_type="text/event-stream",
            )
        comps = await sampler.sample([prompt], s, body.n)
        choices = []
        for i, c in enumerate(comps):
            msg = turn_to_message(fmt.parse(c.token_ids), fmt, c.token_ids)
            choices.append(
                ChatChoice(
                    index=i,
                    message=msg,
                    finish_reason=finish_reason(c, msg),
                    logprobs=chat_logprobs(c) if body.logprobs else None,
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                )
            )
        usage = Usage.of(len(prompt), sum(len(c.token_ids) for c in comps))
        out = ChatCompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt if body.return_token_ids else None,
        )
        return _json(out)

    return app


async def _stream(
    sampler: _Sampler,
    fmt: ChatFormat,
    prompt: list[int],
    s: SamplingParams,
    n: int,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE events of a streamed chat completion: the role, then deltas as tokens are sampled, then the
    parsed rest (tool calls), the finish reason per choice, usage, ``[DONE]``. An engine failure midway
    is sent as an ``error`` event."""
    queue: asyncio.Queue = asyncio.Queue()
    streamers = [DeltaStreamer(fmt) for _ in range(n)]

    def on_token(index: int, token: int) -> None:
        queue.put_nowait((index, token))

    task = asyncio.create_task(sampler.sample([prompt], s, n, on_token))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        for i in range(n):
            yield sse_chunk(rid, created, model, [delta_choice(i, {"role": "assistant", "content": ""})])
        fed = [0] * n
        while (item := await queue.get()) is not None:
            index, token = item
            fed[index] += 1
            for delta in streamers[index].feed(token):
                yield sse_chunk(rid, created, model, [delta_choice(index, delta)])
        try:
            comps = task.result()
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line is already sent
            error = {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": 500}
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
        for i, c in enumerate(comps):
            for token in c.token_ids[fed[i] :]:  # engines without on_token: everything arrives here
                for delta in streamers[i].feed(token):
                    yield sse_chunk(rid, created, model, [delta_choice(i, delta)])
            _, rest, finish = streamers[i].finish(c)
            for delta in rest:
                yield sse_chunk(rid, created, model, [delta_choice(i, delta)])
            yield sse_chunk(rid, created, model, [delta_choice(i, {}, finish)])
        if include_usage:
            usage = Usage.of(len(prompt), sum(len(c.token_ids) for c in comps))
            yield sse_chunk(rid, created, model, [], usage=usage.model_dump())
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():  # the client went away: stop waiting for the engine
            task.cancel()

