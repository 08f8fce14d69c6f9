"""Turn an OpenAPI 3 spec into tools, one per operation, called over HTTP with httpx.

Each operation becomes a tool named after its ``operationId`` whose JSON-schema parameters are its path, query
and header parameters (schemas taken from the spec, ``$ref`` resolved) plus ``body`` for a JSON request body.

Behaviour of a call:

- The base URL comes from ``base_url``, else the environment variable named by ``base_url_env``, else the
  spec's first ``servers`` entry. Auth headers come from ``headers`` and/or ``headers_env`` (header name ->
  environment variable). Header values are never logged, shown in ``repr`` or put in observations.
- Connection errors and 5xx answers are retried ``retries`` times with the shared policy of
  :mod:`agentrl.http_retry` (exponential backoff from ``backoff_s``, with jitter, ``Retry-After`` honoured);
  a timeout is reported at once as ``tool_timeout``.
- A 4xx answer goes back to the model as an observation (``HTTP 404: ...``); 400 and 422 are recorded as
  ``bad_arguments``. A 5xx after the last retry is ``tool_exception``.
- At most ``max_response_bytes`` of a body are read; JSON bodies are re-serialised compactly.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

import httpx

from agentrl.envs.tools.base import Tool, ToolError, ToolOutput
from agentrl.http_retry import RetryableStatus, retrying

log = logging.getLogger(__name__)
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def resolve_refs(node: Any, spec: Mapping[str, Any], _seen: tuple[str, ...] = ()) -> Any:
    """A copy of ``node`` with local ``$ref`` pointers (``#/components/...``) inlined; a cycle becomes
    ``{"type": "object"}``."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            if not ref.startswith("#/"):
                raise ValueError(f"only local $ref pointers are supported, got {ref!r}")
            if ref in _seen:
                return {"type": "object"}
            target: Any = spec
            for part in ref[2:].split("/"):
                target = target[part.replace("~1", "/").replace("~0", "~")]
            merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
            return resolve_refs(merged, spec, (*_seen, ref))
        return {k: resolve_refs(v, spec, _seen) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_refs(v, spec, _seen) for v in node]
    return node


def to_json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAPI schema object as JSON Schema: 3.0's ``nullable`` becomes a ``null`` type; ``title`` dropped."""
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("title", "xml", "externalDocs", "example", "discriminator", "readOnly", "writeOnly"):
            continue
        if isinstance(v, dict):
            out[k] = to_json_schema(v)
        elif isinstance(v, list) and k in ("anyOf", "oneOf", "allOf", "prefixItems"):
            out[k] = [to_json_schema(x) if isinstance(x, dict) else x for x in v]
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: to_json_schema(s) for name, s in v.items()}
        else:
            out[k] = v
    if out.pop("nullable", False):
        t = out.get("type")
        if isinstance(t, str):
            out["type"] = [t, "null"]
        elif "type" not in out:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


def _drop_null_alternative(schema: dict[str, Any]) -> dict[str, Any]:
    """``{anyOf: [X, {type: null}], ...}`` -> ``{...X, ...}`` for optional parameters: leaving the parameter
    out already means null, and models read the plain type more easily."""
    alts = schema.get("anyOf")
    if isinstance(alts, list) and len(alts) == 2 and {"type": "null"} in alts:
        other = next(a for a in alts if a != {"type": "null"})
        return {**{k: v for k, v in schema.items() if k != "anyOf"}, **other}
    return schema


def _tool_name(op: Mapping[str, Any], method: str, path: str) -> str:
    raw = op.get("operationId") or f"{method}_{path}"
    name = re.sub(r"[^A-Za-z0-9_]+", "_", raw).strip("_")
    return name or f"{method}_op"


class OpenAPIOperation(Tool):
    """One operation of an :class:`OpenAPIToolset` as a tool (built by the toolset, not directly)."""

    def __init__(
        self, toolset: OpenAPIToolset, method: str, path: str, op: Mapping[str, Any], spec: Mapping[str, Any]
    ):
        self.toolset, self.method, self.path = toolset, method.upper(), path
        self.name = _tool_name(op, method, path)
        desc = " ".join(x for x in (op.get("summary"), op.get("description")) if x)
        self.description = (desc or f"{self.method} {path}")[:1000]
        self.locations: dict[str, str] = {}
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in op.get("parameters", []):
            p = resolve_refs(p, spec)
            if p.get("in") not in ("path", "query", "header"):
                continue
            schema = to_json_schema(p.get("schema", {}))
            if not (p.get("required") or p["in"] == "path"):
                schema = _drop_null_alternative(schema)
            if p.get("description") and "description" not in schema:
                schema["description"] = p["description"]
            props[p["name"]] = schema
            self.locations[p["name"]] = p["in"]
            if p.get("required") or p["in"] == "path":
                required.append(p["name"])
        body = op.get("requestBody")
        if body:
            body = resolve_refs(body, spec)
            content = body.get("content", {})
            media = content.get("application/json") or next(iter(content.values()), {})
            props["body"] = to_json_schema(media.get("schema", {}))
            self.locations["body"] = "body"
            if body.get("required"):
                required.append("body")
        self.parameters = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            self.parameters["required"] = required

    async def call(self, arguments: dict[str, Any], session: Any = None) -> ToolOutput:
        path = self.path
        query: dict[str, Any] = {}
        headers: dict[str, str] = {}
        body: Any = None
        for key, value in arguments.items():
            where = self.locations[key]
            if where == "path":
                path = path.replace("{" + key + "}", quote(str(value), safe=""))
            elif where == "query":
                query[key] = str(value).lower() if isinstance(value, bool) else value
            elif where == "header":
                headers[key] = str(value)
            else:
                body = value
        return await self.toolset.request(self.method, path, params=query, headers=headers, json_body=body)

    async def aclose(self) -> None:
        await self.toolset.aclose()


class OpenAPIToolset:
    """The tools of one OpenAPI 3 spec, sharing an httpx client.

    Args:
        spec: the parsed spec (dict).
        base_url / base_url_env: where the API lives (see the module docstring for the order).
        headers: fixed headers (e.g. ``{"Authorization": "Bearer ..."}``); ``headers_env`` maps header names to
            environment variables read at construction (a missing variable is an error naming it).
        timeout_s: per-request timeout; ``retries``/``backoff_s``: retry policy for 5xx and connection errors.
        max_response_bytes: bytes of a response body read at most (the rest is dropped with a marker).
        include / exclude: operation ids (tool names) to keep / drop.
    """

    def __init__(
        self,
        spec: Mapping[str, Any],
        *,
        base_url: str | None = None,
        base_url_env: str | None = None,
        headers: Mapping[str, str] | None = None,
        headers_env: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_response_bytes: int = 16_000,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
    ) -> None:
        if not str(spec.get("openapi", "")).startswith("3"):
            raise ValueError(
                f"expected an OpenAPI 3 spec (field 'openapi': '3.x'), got {spec.get('openapi')!r}"
            )
        self.spec = copy.deepcopy(dict(spec))
        url = base_url or (os.environ.get(base_url_env) if base_url_env else None)
        if not url:
            servers = self.spec.get("servers") or []
            url = servers[0].get("url") if servers else None
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(
                "no absolute base URL for the API: pass base_url=..., set the environment variable named by "
                f"base_url_env ({base_url_env!r}), or give the spec an absolute 'servers' URL"
            )
        self.base_url = url.rstrip("/")
        secret_headers = dict(headers or {})
        for header, var in (headers_env or {}).items():
            if var not in os.environ:
                raise ValueError(
                    f"header {header!r} should come from the environment variable {var!r}, which is not set"
                )
            secret_headers[header] = os.environ[var]
        self._headers = secret_headers
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_response_bytes = max_response_bytes
        self._client: httpx.AsyncClient | None = None
        keep = set(include) if include is not None else None
        drop = set(exclude)
        self.tools: list[OpenAPIOperation] = []
        for path, item in self.spec.get("paths", {}).items():
            for method in _METHODS:
                if method in item:
                    op = {
                        **item[method],
                        "parameters": [*item.get("parameters", []), *item[method].get("parameters", [])],
                    }
                    t = OpenAPIOperation(self, method, path, op, self.spec)
                    if (keep is None or t.name in keep) and t.name not in drop:
                        self.tools.append(t)
        if keep is not None and (missing := keep - {t.name for t in self.tools}):
            raise ValueError(f"operations not in the spec: {sorted(missing)}")

    @classmethod
    def from_url(cls, spec_url: str, **kwargs: Any) -> OpenAPIToolset:
        """Fetch the spec (JSON) from ``spec_url`` (blocking) and build the toolset; ``base_url`` defaults to the
        spec URL's origin."""
        resp = httpx.get(spec_url, timeout=kwargs.get("timeout_s", 10.0), headers=kwargs.get("headers"))
        resp.raise_for_status()
        if "base_url" not in kwargs and "base_url_env" not in kwargs:
            u = httpx.URL(spec_url)
            kwargs["base_url"] = f"{u.scheme}://{u.netloc.decode()}"
        return cls(resp.json(), **kwargs)

    def __repr__(self) -> str:  # never show header values
        return f"OpenAPIToolset(base_url={self.base_url!r}, tools={[t.name for t in self.tools]}, headers={sorted(self._headers)})"

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self._headers, timeout=self.timeout_s
            )
        return self._client

    async def request(
        self, method: str, path: str, *, params: dict[str, Any], headers: dict[str, str], json_body: Any
    ) -> ToolOutput:
        """Send one request with the retry policy; returns the observation (see the module docstring)."""
        client = self._get_client()

        def note(state: Any) -> None:
            exc = state.outcome.exception()
            last = str(exc) if isinstance(exc, RetryableStatus) else f"connection error ({type(exc).__name__})"
            log.info("openapi %s %s: %s (attempt %d)", method, path, last, state.attempt_number)

        policy = retrying(
            self.retries,
            backoff_s=self.backoff_s,
            max_backoff_s=max(self.backoff_s, 8.0),
            retry_on=(httpx.TransportError, RetryableStatus),
            before_sleep=note,
        )
        try:
            async for attempt in policy:
                with attempt:
                    try:
                        req = client.build_request(method, path, params=params, headers=headers, json=json_body)
                        resp = await client.send(req, stream=True)
                        try:
                            status, text = resp.status_code, await self._read_bounded(resp)
                        finally:
                            await resp.aclose()
                    except httpx.TimeoutException:
                        raise ToolError(f"{method} {path} timed out after {self.timeout_s:g} s", "tool_timeout") from None
                    if status >= 500:
                        raise RetryableStatus(status, text)
                    if status >= 400:
                        return ToolOutput(f"HTTP {status}: {text}", "bad_arguments" if status in (400, 422) else None)
                    return ToolOutput(text)
        except RetryableStatus as exc:
            raise ToolError(f"{method} {path} failed after {self.retries + 1} attempts: {exc}") from None
        except httpx.TransportError as exc:
            raise ToolError(
                f"{method} {path} failed after {self.retries + 1} attempts: connection error ({type(exc).__name__})"
            ) from None
        raise AssertionError("unreachable: tenacity either returns, or raises the last error")

    async def _read_bounded(self, resp: httpx.Response) -> str:
        buf = bytearray()
        cut = False
        async for chunk in resp.aiter_bytes():
            buf.extend(chunk)
            if len(buf) > self.max_response_bytes:
                cut = True
                break
        raw = bytes(buf[: self.max_response_bytes]).decode("utf-8", "replace")
        if cut:
            return raw + f"\n[... response cut at {self.max_response_bytes} bytes]"
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":"))
        except ValueError:
            return raw

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
