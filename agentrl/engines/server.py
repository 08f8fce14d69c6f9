"""``agentrl serve model``: an OpenAI-compatible HTTP server over any RolloutEngine + ChatFormat.

Endpoints (all under ``/v1``):

- ``GET /models``: the one served model.
- ``POST /completions``: token-in-token-out. ``prompt`` is token ids (``[1, 2, 3]``), a batch of them,
  or text (encoded with the format, no special tokens). Supports ``max_tokens`` (default 16),
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ``stop_token_ids`` (default: the format's
  stop tokens), ``logprobs``. Each choice carries ``token_ids`` (the vLLM ``return_token_ids``
  extension; always sent), ``text``, and with ``logprobs`` set ``{tokens, token_logprobs,
  top_logprobs, text_offset}`` where ``tokens`` are ``"token_id:N"`` strings if
  ``return_tokens_as_token_ids`` else decoded pieces. ``finish_reason`` is ``stop`` or ``length``.
- ``POST /chat/completions``: messages and ``tools`` are rendered with the ChatFormat, the completion
  is parsed back into ``content``, ``reasoning_content`` (Harmony analysis channel) and ``tool_calls``
  (``finish_reason`` ``tool_calls``). ``stream: true`` answers with SSE chunks (content streamed per
  token) and ``stream_options.include_usage`` adds a usage chunk. ``logprobs: true`` returns per-token
  log-probs of the whole completion; ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids``.

Errors follow the OpenAI shape ``{"error": {"message", "type", "code"}}`` with status 400 for bad
requests, 401 for a wrong API key and 500 when the engine fails.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentrl.engines.base import Completion, RolloutEngine, SamplingParams
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.types import Message, ParsedTurn, ToolSpec


class RequestError(ValueError):
    """A client request the server cannot honour (HTTP 400)."""


def _sampling(body: dict[str, Any], default_stop: Sequence[int], default_max: int) -> SamplingParams:
    def num(key: str, default: float, cast=float):
        value = body.get(key)
        if value is None:
            return default
        try:
            return cast(value)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{key} must be a number, got {value!r}") from exc

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_new = (
        default_max
        if max_tokens is None
        else num("max_tokens" if "max_tokens" in body else "max_completion_tokens", default_max, int)
    )
    if max_new < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_new}")
    stop = body.get("stop_token_ids")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(t, int) for t in stop)):
        raise RequestError("stop_token_ids must be a list of integers")
    if body.get("stop"):
        raise RequestError("string stop sequences are not supported; use stop_token_ids")
    seed = body.get("seed")
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=num("temperature", 1.0),
        top_p=num("top_p", 1.0),
        top_k=max(0, num("top_k", 0, int)),
        stop_token_ids=list(stop) if stop else list(default_stop),
        seed=None if seed is None else num("seed", 0, int),
    )


def _prompts(prompt: Any, fmt: ChatFormat) -> list[list[int]]:
    """Normalise the completions ``prompt`` field to a batch of token-id lists."""
    if isinstance(prompt, str):
        return [fmt.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            batch = [prompt]
        elif all(isinstance(p, str) for p in prompt):
            return [fmt.encode(p) for p in prompt]
        elif all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            batch = prompt
        else:
            raise RequestError("prompt must be a string, a list of token ids, or a list of either")
        for ids in batch:
            bad = [t for t in ids if not 0 <= t < fmt.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {fmt.vocab_size})"
                )
        return [list(p) for p in batch]
    raise RequestError("prompt must be a non-empty string or list of token ids")


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise RequestError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def openai_to_messages(messages: Any) -> list[Message]:
    """OpenAI chat messages to :class:`Message` (tool calls -> commentary messages addressed to
    ``functions.<name>``; tool results -> role ``tool`` named after the call they answer)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"messages[{i}] must be an object with a role")
        role = m["role"]
        if role in ("system", "developer", "user"):
            out.append(Message(role=role, content=_text_of(m.get("content"))))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                out.append(Message(role="assistant", content=reasoning, channel="analysis"))
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                name = fn.get("name")
                if not name:
                    raise RequestError(f"messages[{i}].tool_calls entry has no function name")
                call_names[tc.get("id") or ""] = name
                args = fn.get("arguments", "{}")
                out.append(
                    Message(
                        role="assistant",
                        content=args if isinstance(args, str) else json.dumps(args),
                        channel="commentary",
                        recipient=f"functions.{name}",
                        content_type="json",
                    )
                )
            text = _text_of(m.get("content"))
            if text:
                out.append(Message(role="assistant", content=text, channel="final"))
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "")
            if not name:
                raise RequestError(
                    f"messages[{i}] (tool) answers an unknown tool_call_id {m.get('tool_call_id')!r}"
                )
            out.append(
                Message(
                    role="tool",
                    content=_text_of(m.get("content")),
                    name=f"functions.{name}",
                    channel="commentary",
                    recipient="assistant",
                )
            )
        else:
            raise RequestError(f"messages[{i}] has unknown role {role!r}")
    return out


def openai_to_tools(tools: Any) -> list[ToolSpec]:
    """OpenAI ``tools`` (``type: function``) to :class:`ToolSpec`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    specs = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        specs.append(
            ToolSpec(
                fn["name"],
                fn.get("description", ""),
                fn.get("parameters") or {"type": "object", "properties": {}},
            )
        )
    return specs


def turn_to_message(turn: ParsedTurn, fmt: ChatFormat, completion_ids: Sequence[int]) -> dict[str, Any]:
    """A parsed completion as an OpenAI assistant message. Unparseable output is returned as content
    (the decoded text), so nothing the model said is lost."""
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    reasoning = [m.content for m in turn.messages if m.channel == "analysis" and not m.recipient]
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if turn.final is not None:
        msg["content"] = turn.final
    else:
        said = [
            m.content
            for m in turn.messages
            if m.role == "assistant" and not m.recipient and m.channel != "analysis"
        ]
        if said:
            msg["content"] = "\n".join(said)
        elif not turn.tool_calls and not reasoning:
            stops = set(fmt.stop_token_ids)
            msg["content"] = fmt.decode([t for t in completion_ids if t not in stops])
    if turn.tool_calls:
        calls = []
        for tc in turn.tool_calls:
            args = tc.raw_arguments
            try:
                json.loads(args)
            except (TypeError, ValueError):
                args = json.dumps(tc.arguments)
            calls.append(
                {
                    "id": tc.call_id or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": tc.name, "arguments": args},
                }
            )
        msg["tool_calls"] = calls
    return msg


def _finish(c: Completion, msg: dict[str, Any]) -> str:
    if msg.get("tool_calls"):
        return "tool_calls"
    return "length" if c.finish_reason == "length" else "stop"


def _logprobs_block(c: Completion, fmt: ChatFormat, as_ids: bool) -> dict[str, Any]:
    pieces = [fmt.decode([t]) for t in c.token_ids]
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    return {
        "tokens": [f"token_id:{t}" for t in c.token_ids] if as_ids else pieces,
        "token_logprobs": list(c.logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


class _BearerAuth:
    """Plain ASGI middleware: HTTP requests without ``Authorization: <expected>`` get a 401 (much cheaper
    per request than Starlette's ``BaseHTTPMiddleware``)."""

    def __init__(self, app: Any, expected: bytes):
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            body = {
                "error": {
                    "message": "invalid or missing API key",
                    "type": "authentication_error",
                    "code": 401,
                }
            }
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    engine: RolloutEngine,
    fmt: ChatFormat,
    *,
    model_name: str = "agentrl",
    api_key: str | None = None,
    default_max_tokens: int = 1024,
):
    """Build the FastAPI app serving ``engine`` through ``fmt``. ``api_key`` (if set) is required as
    ``Authorization: Bearer <key>``. ``default_max_tokens`` applies to chat requests without a limit."""
    app = FastAPI(title="agentrl model server")

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    stop_ids = list(fmt.stop_token_ids)  # looked up once: openai-harmony recomputes them on every call
    if api_key:
        app.add_middleware(_BearerAuth, expected=f"Bearer {api_key}".encode())

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError):
        return error(400, str(exc), "invalid_request_error")

    @app.exception_handler(Exception)
    async def engine_failure(_: Request, exc: Exception):
        return error(500, f"{type(exc).__name__}: {exc}", "server_error")

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "agentrl"}],
        }

    def n_of(body: dict[str, Any]) -> int:
        n = body.get("n", 1)
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise RequestError(f"n must be an integer in [1, 128], got {n!r}")
        return n

    async def sample(prompt_ids: list[list[int]], s: SamplingParams, n: int) -> list[Completion]:
        """``n`` samples per prompt; sample ``j`` uses seed ``seed + j`` when a seed is given."""
        if n == 1:
            return await engine.generate(prompt_ids, s)
        out: list[Completion] = []
        batch = [p for p in prompt_ids for _ in range(n)]
        if s.seed is None:
            return await engine.generate(batch, s)
        for j in range(n):
            sj = SamplingParams(**{**s.__dict__, "seed": s.seed + j})
            out += await engine.generate(prompt_ids, sj)
        return [out[j * len(prompt_ids) + i] for i in range(len(prompt_ids)) for j in range(n)]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        if body.get("stream"):
            raise RequestError("stream is not supported on /v1/completions")
        if body.get("echo"):
            raise RequestError("echo is not supported")
        prompts = _prompts(body.get("prompt"), fmt)
        s = _sampling(body, stop_ids, 16)
        n = n_of(body)
        comps = await sample(prompts, s, n)
        want_lp = body.get("logprobs") is not None
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, c in enumerate(comps):
            choice = {
                "index": i,
                "text": fmt.decode(c.token_ids),
                "token_ids": list(c.token_ids),
                "logprobs": _logprobs_block(c, fmt, as_ids) if want_lp else None,
                "finish_reason": c.finish_reason,
            }
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = prompts[i // n]
            choices.append(choice)
        gen = sum(len(c.token_ids) for c in comps)
        prompt_tokens = sum(len(p) for p in prompts)
        # JSONResponse directly: FastAPI's jsonable_encoder would walk every token id
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": gen,
                    "total_tokens": prompt_tokens + gen,
                },
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        msgs = openai_to_messages(body.get("messages"))
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise RequestError(f"tool_choice {choice!r} is not supported (use 'auto' or 'none')")
        tools = [] if choice == "none" else openai_to_tools(body.get("tools"))
        prompt = fmt.render_prompt(msgs, tools)
        s = _sampling(body, stop_ids, default_max_tokens)
        n = n_of(body)
        comps = await sample([prompt], s, n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gen = sum(len(c.token_ids) for c in comps)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": gen, "total_tokens": len(prompt) + gen}
        replies = [(c, turn_to_message(fmt.parse(c.token_ids), fmt, c.token_ids)) for c in comps]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _sse(rid, created, model_name, replies, fmt, usage if include_usage else None),
                media_type="text/event-stream",
            )
        choices = []
        for i, (c, msg) in enumerate(replies):
            choice = {"index": i, "message": msg, "finish_reason": _finish(c, msg), "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(c.token_ids, c.logprobs, strict=True)
                    ]
                }
            if body.get("return_token_ids"):
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage,
        }
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt
        return JSONResponse(out)

    return app


async def _sse(rid, created, model, replies, fmt: ChatFormat, usage) -> AsyncIterator[str]:
    """Chat-completion chunks: role, reasoning, content token by token, tool calls, finish, usage."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        data = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}] if index >= 0 else [],
            **extra,
        }
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    for i, (c, msg) in enumerate(replies):
        yield chunk(i, {"role": "assistant", "content": ""})
        if msg.get("reasoning_content"):
            yield chunk(i, {"reasoning_content": msg["reasoning_content"]})
        if msg.get("content"):
            ids, sent = fmt.encode(msg["content"]), ""
            for j in range(1, len(ids) + 1):
                text = fmt.decode(ids[:j])
                if j < len(ids) and text.endswith("\ufffd"):
                    continue  # wait for the rest of a multi-byte character
                if text[len(sent) :]:
                    yield chunk(i, {"content": text[len(sent) :]})
                sent = text
        for k, tc in enumerate(msg.get("tool_calls") or []):
            yield chunk(i, {"tool_calls": [{"index": k, **tc}]})
        yield chunk(i, {}, _finish(c, msg))
    if usage is not None:
        yield chunk(-1, {}, usage=usage)
    yield "data: [DONE]\n\n"


class BackgroundServer:
    """Run an ASGI app with uvicorn in a daemon thread on ``127.0.0.1`` and a free port.

    ``with BackgroundServer(app) as srv: srv.base_url`` (``http://127.0.0.1:PORT/v1``). Startup waits
    until the server accepts requests (or raises ``RuntimeError`` after ``start_timeout_s``); leaving
    the block stops it and joins the thread.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        import socket

        import uvicorn

        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without
        # it, keep-alive responses written in two parts wait ~40 ms for a delayed ACK (Nagle)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.base_url = f"{self.url}/v1"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._start_timeout_s = start_timeout_s
        self._thread: Any = None

    def __enter__(self) -> BackgroundServer:
        import threading

        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for the thread, close the socket. Idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._sock.close()


def load_local_engine(
    model: str,
    *,
    format: str = "auto",
    device: str | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_batch_size: int = 64,
) -> tuple[RolloutEngine, ChatFormat, str]:
    """Load a local model (a built-in name such as ``tiny-gpt-oss`` / ``smollm2-135m``, a directory
    with ``config.json``, or a hub id) into the transformers engine, with the ChatFormat that fits it
    (``format="auto"``: Harmony for GPT-OSS, the HF chat template otherwise). Imports torch.
    Returns ``(engine, format, model name)``."""
    from agentrl.engines.transformers_engine import TransformersEngine
    from agentrl.models.loading import load_model

    loaded = load_model(model, device=device or "cpu", dtype=dtype, seed=seed)
    loaded.model.eval()
    fmt = loaded.chat_format(format)
    pad = getattr(loaded.tokenizer, "pad_token_id", None) if loaded.tokenizer is not None else None
    engine = TransformersEngine(
        loaded.model,
        pad_token_id=int(pad if pad is not None else 0),
        max_batch_size=max_batch_size,
        seed=seed,
    )
    return engine, fmt, model.rstrip("/").rsplit("/", 1)[-1]


def _parse_kv(argv: Sequence[str]) -> dict[str, str]:
    opts = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"agentrl serve model: arguments are key=value, got {arg!r}")
        opts[key.lstrip("-").replace("-", "_")] = value
    return opts


USAGE = """usage: agentrl serve model model=PATH [format=auto|harmony|chat_template] [host=127.0.0.1] [port=8000]
                           [served_model_name=NAME] [api_key=KEY] [max_tokens=1024] [device=cpu|cuda] [dtype=float32|bfloat16]

Serves a local transformers model (tiny-gpt-oss, smollm2-135m, a directory with config.json, or a hub id) over an OpenAI-compatible API:
/v1/completions with token ids in and token ids + log-probs out, and /v1/chat/completions with tools."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``agentrl serve model``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    opts = _parse_kv(argv)
    if "model" not in opts:
        print(USAGE, file=sys.stderr)
        return 2
    import uvicorn

    engine, fmt, name = load_local_engine(
        opts.pop("model"),
        format=opts.pop("format", "auto"),
        device=opts.pop("device", None),
        dtype=opts.pop("dtype", "float32"),
    )
    host, port = opts.pop("host", "127.0.0.1"), int(opts.pop("port", "8000"))
    app = create_app(
        engine,
        fmt,
        model_name=opts.pop("served_model_name", name),
        api_key=opts.pop("api_key", None),
        default_max_tokens=int(opts.pop("max_tokens", "1024")),
    )
    if opts:
        print(f"agentrl serve model: unknown options {sorted(opts)}\n\n{USAGE}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
