"""Clients of OpenAI-compatible servers (vLLM, SGLang, ``agentrl serve model``, hosted APIs), over httpx.

Two clients share one HTTP layer (:class:`Endpoint`):

- :class:`OpenAIEngine` is a :class:`~agentrl.engines.base.RolloutEngine`. It calls ``/v1/completions``
  with the prompt as token ids and asks for the sampled token ids and their log-probs back
  (``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs``: the vLLM extensions, which
  ``agentrl serve model`` also speaks). Token-in-token-out: nothing is re-tokenised.
- :class:`ChatClient` calls ``/v1/chat/completions`` with tools, plain or streamed (SSE), for product
  agents and for evaluating hosted models that only speak chat.

Configuration: ``base_url`` (up to and including ``/v1``) and ``api_key`` come from arguments or from
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``; ``model`` from the argument, ``OPENAI_MODEL``, or the first
entry of ``GET /models``.

Failure contract: transport errors, timeouts and the statuses in :data:`RETRY_STATUSES` are retried
with the shared policy of :mod:`agentrl.http_retry` (exponential backoff with jitter, ``Retry-After``
honoured) up to ``max_retries`` times; then, or at once for
any other non-2xx status or a malformed body, :class:`EndpointError` is raised with the URL, status and
the server's message. Requests in flight are bounded by ``max_concurrency``.

Connections are spread over several small httpx pools (``POOL_SIZE`` connections each): httpcore scans
every connection of a pool on each request, so one pool of 32+ connections spends more CPU on
bookkeeping than on the request itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentrl.engines.base import AsyncClosing, Completion, SamplingParams
from agentrl.http_retry import RETRY_STATUSES, RetryableStatus, retrying

#: Connections per httpx pool (see the module docstring).
POOL_SIZE = 4


class EndpointError(RuntimeError):
    """An OpenAI-compatible endpoint failed for good (after retries) or answered something unusable."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message", err))[:500]
    return str(err)[:500]


class Endpoint(AsyncClosing):
    """One OpenAI-compatible base URL: auth, bounded concurrency, retries with backoff.

    Use as an async context manager or call :meth:`aclose`. ``timeout_s`` bounds each attempt.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 16.0,
        max_concurrency: int = 64,
        headers: dict[str, str] | None = None,
    ):
        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError(
                "no endpoint: pass base_url (e.g. http://127.0.0.1:8000/v1) or set OPENAI_BASE_URL"
            )
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._model = model or os.environ.get("OPENAI_MODEL")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sem = asyncio.Semaphore(max_concurrency)
        hdrs = dict(headers or {})
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        pools = max(1, -(-max_concurrency // POOL_SIZE))
        size = -(-max_concurrency // pools)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self._clients = [
            httpx.AsyncClient(timeout=timeout_s, headers=hdrs, limits=limits) for _ in range(pools)
        ]
        self._load = [0] * pools
        self._model_lock = asyncio.Lock()
        self.retries_done = 0

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    def _url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    @contextlib.contextmanager
    def _pool(self) -> Iterator[httpx.AsyncClient]:
        """The least-loaded connection pool, held for the whole request (body included)."""
        i = min(range(len(self._clients)), key=self._load.__getitem__)
        self._load[i] += 1
        try:
            yield self._clients[i]
        finally:
            self._load[i] -= 1

    async def _send(
        self, client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None, stream: bool
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response (opened for streaming if ``stream``)."""
        url = self._url(path)

        def count_retry(_: Any) -> None:
            self.retries_done += 1

        policy = retrying(
            self.max_retries, backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s, before_sleep=count_retry
        )
        try:
            async for attempt in policy:
                with attempt:
                    req = client.build_request(method, url, json=body)
                    resp = await client.send(req, stream=stream)
                    if resp.status_code < 300:
                        return resp
                    if stream:
                        await resp.aread()
                    message = _error_text(resp)
                    await resp.aclose()
                    if resp.status_code in RETRY_STATUSES:
                        raise RetryableStatus.from_response(resp, message)
                    raise EndpointError(
                        f"{method} {url} failed: HTTP {resp.status_code}: {message}", status=resp.status_code, url=url
                    )
        except RetryableStatus as exc:
            raise EndpointError(
                f"{method} {url} failed after {self.max_retries + 1} attempts: {exc}", status=exc.status, url=url
            ) from None
        except httpx.TransportError as exc:  # connect errors, timeouts, broken connections
            raise EndpointError(
                f"{method} {url} failed after {self.max_retries + 1} attempts: {type(exc).__name__}: {exc}", url=url
            ) from None
        raise AssertionError("unreachable: tenacity either returns, or raises the last error")

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON request/response with retries; raises :class:`EndpointError`."""
        async with self._sem:
            with self._pool() as client:
                resp = await self._send(client, method, path, body, stream=False)
        try:
            data = resp.json()
        except ValueError as exc:
            raise EndpointError(
                f"{resp.url} answered non-JSON: {resp.text[:200]!r}", url=str(resp.url)
            ) from exc
        if not isinstance(data, dict):
            raise EndpointError(
                f"{resp.url} answered {type(data).__name__}, expected an object", url=str(resp.url)
            )
        return data

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST and yield each SSE ``data:`` JSON event until ``[DONE]``. Retries only before the first
        byte; a stream broken midway raises :class:`EndpointError`."""
        async with self._sem:
            with self._pool() as client:
                resp = await self._send(client, "POST", path, body, stream=True)
                try:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            return
                        try:
                            event = json.loads(payload)
                        except ValueError as exc:
                            raise EndpointError(f"bad SSE event from {resp.url}: {payload[:200]!r}") from exc
                        if isinstance(event, dict) and "error" in event:
                            raise EndpointError(
                                f"{resp.url} stream error: {event['error']}", url=str(resp.url)
                            )
                        yield event
                except httpx.TransportError as exc:
                    raise EndpointError(f"stream from {resp.url} broke: {exc}", url=str(resp.url)) from exc
                finally:
                    await resp.aclose()

    async def served_format(self) -> Any:
        """The server's own :class:`~agentrl.harmony.format.ChatFormat` from ``GET agentrl/format``
        (``agentrl serve model``), or ``None`` when the server does not describe one (vLLM, SGLang,
        hosted APIs). Raises :class:`EndpointError` if the server is unreachable, ``ValueError`` if its
        description cannot be used here."""
        from agentrl.engines.server.served_format import format_from_description

        try:
            desc = await self.request("GET", "agentrl/format?files=true")
        except EndpointError as exc:
            if exc.status in (404, 405):
                return None
            raise
        return format_from_description(desc)

    async def model(self) -> str:
        """The model name to send: as configured, else the first id from ``GET /models``."""
        async with self._model_lock:
            if self._model is None:
                data = await self.request("GET", "models")
                models = data.get("data") or []
                if not models:
                    raise EndpointError(f"{self._url('models')} lists no models; pass model=...")
                self._model = str(models[0]["id"])
            return self._model


def _token_id(tok: Any) -> int:
    if isinstance(tok, int):
        return tok
    if isinstance(tok, str) and tok.startswith("token_id:"):
        return int(tok[len("token_id:") :])
    raise EndpointError(
        f"cannot read a token id from {tok!r}; the server must support return_tokens_as_token_ids"
    )


def parse_completion_choice(choice: dict[str, Any]) -> Completion:
    """A ``/v1/completions`` choice to a :class:`Completion` (token ids from ``token_ids`` or from
    ``logprobs.tokens`` as ``"token_id:N"``). Raises :class:`EndpointError` if ids or log-probs are
    missing or their lengths disagree."""
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        if not lp.get("tokens"):
            if choice.get("text") == "" and lp:
                ids = []
            else:
                raise EndpointError(
                    "the endpoint returned no token ids: it must honour return_token_ids or "
                    "return_tokens_as_token_ids (vLLM >= 0.10, agentrl serve model)"
                )
        else:
            ids = [_token_id(t) for t in lp["tokens"]]
    logprobs = lp.get("token_logprobs")
    if logprobs is None:
        raise EndpointError("the endpoint returned no log-probs (request had logprobs=1)")
    if len(logprobs) != len(ids) or any(x is None for x in logprobs):
        raise EndpointError(f"the endpoint returned {len(ids)} token ids but log-probs {logprobs[:8]!r}...")
    finish = choice.get("finish_reason") or "stop"
    return Completion(
        token_ids=[int(t) for t in ids],
        logprobs=[float(x) for x in logprobs],
        finish_reason="length" if finish == "length" else "stop",
    )


class _EndpointClient(AsyncClosing):
    """A client of one :class:`Endpoint` (given, or built from ``endpoint_kwargs``), closed with it."""

    def __init__(self, endpoint: Endpoint | None = None, **endpoint_kwargs: Any):
        self.endpoint = endpoint or Endpoint(**endpoint_kwargs)

    async def aclose(self) -> None:
        await self.endpoint.aclose()


class OpenAIEngine(_EndpointClient):
    """A :class:`~agentrl.engines.base.RolloutEngine` backed by an OpenAI-compatible completions API.

    One request per prompt (bounded by the endpoint's concurrency), so a slow or retried prompt never
    holds up the others. ``stop_token_ids`` and ``top_k`` are sent as the vLLM extensions of those names.
    """

    def _body(self, model: str, prompt: Sequence[int], s: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(map(int, prompt)),
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if s.top_k:
            body["top_k"] = s.top_k
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    async def _one(self, prompt: Sequence[int], sampling: SamplingParams) -> Completion:
        model = await self.endpoint.model()
        data = await self.endpoint.request("POST", "completions", self._body(model, prompt, sampling))
        choices = data.get("choices") or []
        if len(choices) != 1:
            raise EndpointError(f"completions returned {len(choices)} choices for one prompt")
        return parse_completion_choice(choices[0])

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """One :class:`Completion` per prompt, in order; raises :class:`EndpointError` on failure."""
        return list(await asyncio.gather(*(self._one(p, sampling) for p in prompts)))


@dataclass
class ChatResult:
    """An assistant reply from chat completions.

    ``message`` is the OpenAI-shaped assistant message (``role``, ``content``, optional
    ``tool_calls`` with JSON-string ``arguments``, optional ``reasoning_content``); ``usage`` the
    server's token counts; ``latency_s`` wall time of the request (with retries).
    """

    message: dict[str, Any]
    finish_reason: str
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0

    @property
    def content(self) -> str:
        return self.message.get("content") or ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.message.get("tool_calls") or []


class ChatClient(_EndpointClient):
    """Chat completions with tools against any OpenAI-compatible endpoint.

    ``sampling`` keys (``temperature``, ``max_tokens``, ``top_p``, ``seed``...) are passed through.
    """

    async def _body(self, messages, tools, sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": await self.endpoint.model(), "messages": list(messages), **sampling}
        if tools:
            body["tools"] = list(tools)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (), **sampling: Any
    ) -> ChatResult:
        """One non-streamed reply; raises :class:`EndpointError`."""
        t0 = time.perf_counter()
        data = await self.endpoint.request(
            "POST", "chat/completions", await self._body(messages, tools, sampling, False)
        )
        choices = data.get("choices") or []
        if not choices or not isinstance(choices[0].get("message"), dict):
            raise EndpointError(f"chat completions answered without a message: {str(data)[:200]}")
        msg = dict(choices[0]["message"])
        msg.setdefault("role", "assistant")
        return ChatResult(
            msg, choices[0].get("finish_reason") or "stop", data.get("usage") or {}, time.perf_counter() - t0
        )

    async def stream_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (), **sampling: Any
    ) -> AsyncIterator[str | ChatResult]:
        """Stream one reply: yields each content delta (``str``) as it arrives, then the assembled
        :class:`ChatResult` (tool-call deltas merged by index) last."""
        t0 = time.perf_counter()
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish, usage = "stop", {}
        async for event in self.endpoint.stream(
            "chat/completions", await self._body(messages, tools, sampling, True)
        ):
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content.append(delta["content"])
                    yield delta["content"]
                if delta.get("reasoning_content"):
                    reasoning.append(delta["reasoning_content"])
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        int(tc.get("index", len(calls))),
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        yield ChatResult(msg, finish, usage, time.perf_counter() - t0)
