"""Search tools: a local BM25 index (bm25s) over a JSONL corpus, and a generic HTTP search adapter (httpx).

Both render results the same way: numbered hits with id, title and a snippet cut to ``snippet_chars``.

Corpus format (JSONL): one object per line with an id field (default ``"id"``) and text fields (default
``"title"`` and ``"text"``); other fields are kept and returned with hits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from agentrl.envs.tools.base import Tool, ToolError, ToolInfrastructureError

_META = "agentrl_index.json"
_DOCS = "docs.jsonl"


class BM25Index:
    """A BM25 index over documents (dicts).

    Build with :meth:`build` (from dicts or a JSONL path), persist with :meth:`save`, reopen with :meth:`load`.
    """

    def __init__(
        self, docs: list[dict[str, Any]], retriever: Any, *, text_fields: Sequence[str], id_field: str
    ) -> None:
        self.docs, self._retriever = docs, retriever
        self.text_fields, self.id_field = tuple(text_fields), id_field

    @staticmethod
    def _tokenize(texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    @classmethod
    def build(
        cls,
        docs: Iterable[Mapping[str, Any]] | str | Path,
        *,
        text_fields: Sequence[str] = ("title", "text"),
        id_field: str = "id",
    ) -> BM25Index:
        """Index ``docs`` (dicts, or a JSONL file path). Each doc needs ``id_field`` and at least one text field."""
        import bm25s

        if isinstance(docs, (str, Path)):
            from agentrl.envs.tasks import read_rows

            docs = read_rows(docs)
        docs = [dict(d) for d in docs]
        if not docs:
            raise ValueError("cannot build a BM25 index over an empty corpus")
        for i, d in enumerate(docs):
            if id_field not in d:
                raise ValueError(f"document {i} has no {id_field!r} field (keys: {sorted(d)})")
        texts = [" ".join(str(d.get(f, "")) for f in text_fields) for d in docs]
        retriever = bm25s.BM25()
        retriever.index(cls._tokenize(texts), show_progress=False)
        return cls(docs, retriever, text_fields=text_fields, id_field=id_field)

    def save(self, directory: str | Path) -> None:
        """Write the index, the documents and the settings into ``directory`` (created if missing)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(d), show_progress=False)
        with open(d / _DOCS, "w", encoding="utf-8") as f:
            for doc in self.docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        (d / _META).write_text(json.dumps({"text_fields": list(self.text_fields), "id_field": self.id_field}))

    @classmethod
    def load(cls, directory: str | Path) -> BM25Index:
        """Reopen an index written by :meth:`save`."""
        import bm25s

        d = Path(directory)
        if not (d / _META).is_file():
            raise FileNotFoundError(
                f"{d} holds no agentrl BM25 index ({_META} missing); build and save() one first"
            )
        meta = json.loads((d / _META).read_text())
        from agentrl.envs.tasks import read_rows

        retriever = bm25s.BM25.load(str(d), show_progress=False)
        return cls(
            read_rows(d / _DOCS), retriever, text_fields=meta["text_fields"], id_field=meta["id_field"]
        )

    def search(self, query: str, k: int = 5) -> list[tuple[dict[str, Any], float]]:
        """Up to ``k`` ``(doc, score)`` pairs with a positive score, best first."""
        k = max(1, min(int(k), len(self.docs)))
        ids, scores = self._retriever.retrieve(self._tokenize([query]), k=k, show_progress=False)
        return [(self.docs[int(i)], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


def snippet(text: str, chars: int) -> str:
    """``text`` on one line, cut to ``chars`` characters at a word boundary, with ``...`` when cut."""
    t = " ".join(str(text).split())
    if len(t) <= chars:
        return t
    cut = t[:chars].rsplit(" ", 1)[0]
    return (cut or t[:chars]) + " ..."


def render_hits(
    hits: Sequence[Mapping[str, Any]], *, id_key: str, title_key: str, text_key: str, snippet_chars: int
) -> str:
    if not hits:
        return "No results."
    lines = []
    for n, h in enumerate(hits, 1):
        head = f"[{n}] {h.get(id_key, '')}"
        if h.get(title_key):
            head += f" | {h[title_key]}"
        lines.append(head)
        if h.get(text_key):
            lines.append(f"    {snippet(h[text_key], snippet_chars)}")
    return "\n".join(lines)


def _search_parameters(max_k: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "description": "keywords to search for"},
            "k": {
                "type": "integer",
                "minimum": 1,
                "maximum": max_k,
                "description": f"number of results (max {max_k})",
            },
        },
        "required": ["query"],
        "additionalProperties": False,
    }


class SearchTool(Tool):
    """``search(query, k)`` over a local :class:`BM25Index`.

    Args:
        index: the index.
        name, description: how the model sees the tool.
        top_k: default number of hits; ``max_k`` caps what the model may ask for.
        snippet_chars: length of each hit's snippet (taken from the last text field).
    """

    def __init__(
        self,
        index: BM25Index,
        *,
        name: str = "search",
        description: str = "Search the document collection by keywords; returns ids, titles and snippets.",
        top_k: int = 5,
        max_k: int = 20,
        snippet_chars: int = 200,
    ) -> None:
        self.index, self.name, self.description = index, name, description
        self.top_k, self.snippet_chars = top_k, snippet_chars
        self.parameters = _search_parameters(max_k)

    async def call(self, arguments: dict[str, Any], session: Any = None) -> str:
        hits = [doc for doc, _ in self.index.search(arguments["query"], arguments.get("k", self.top_k))]
        fields = self.index.text_fields
        return render_hits(
            hits,
            id_key=self.index.id_field,
            title_key=fields[0] if len(fields) > 1 else "",
            text_key=fields[-1],
            snippet_chars=self.snippet_chars,
        )


class HttpSearchTool(Tool):
    """``search(query, k)`` forwarded to an HTTP search API with httpx (GET ``url?{query_param}=...&{k_param}=k``).

    The JSON answer must hold a list of hits, at ``results_key`` (or be the list itself); each hit's
    ``id_key``/``title_key``/``snippet_key`` are shown. Timeouts and 4xx answers become tool errors the model
    reads (``tool_timeout`` / ``tool_exception``); a service that cannot be reached or answers 5xx is the
    service's failure, not the model's (:class:`~agentrl.envs.tools.base.ToolInfrastructureError`, kind
    ``tool_infrastructure``: the episode ends unscored and is run again).
    """

    def __init__(
        self,
        url: str,
        *,
        name: str = "search",
        description: str = "Search the web index by keywords; returns ids, titles and snippets.",
        query_param: str = "q",
        k_param: str | None = "k",
        results_key: str | None = "results",
        id_key: str = "url",
        title_key: str = "title",
        snippet_key: str = "snippet",
        headers: Mapping[str, str] | None = None,
        top_k: int = 5,
        max_k: int = 20,
        snippet_chars: int = 200,
        timeout_s: float = 10.0,
    ) -> None:
        self.url, self.name, self.description = url, name, description
        self.query_param, self.k_param, self.results_key = query_param, k_param, results_key
        self.id_key, self.title_key, self.snippet_key = id_key, title_key, snippet_key
        self._headers = dict(headers or {})
        self.top_k, self.snippet_chars, self.http_timeout_s = top_k, snippet_chars, timeout_s
        self.parameters = _search_parameters(max_k)
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:  # headers may hold secrets: never show them
        return f"HttpSearchTool(url={self.url!r}, name={self.name!r})"

    async def call(self, arguments: dict[str, Any], session: Any = None) -> str:
        k = int(arguments.get("k", self.top_k))
        params: dict[str, Any] = {self.query_param: arguments["query"]}
        if self.k_param:
            params[self.k_param] = k
        if self._client is None:
            self._client = httpx.AsyncClient(headers=self._headers, timeout=self.http_timeout_s)
        try:
            resp = await self._client.get(self.url, params=params)
        except httpx.TimeoutException:
            raise ToolError(
                f"the search service did not answer within {self.http_timeout_s:g} s", "tool_timeout"
            ) from None
        except httpx.HTTPError as e:
            raise ToolInfrastructureError(f"the search service is unreachable ({type(e).__name__})") from None
        if resp.status_code >= 500:
            raise ToolInfrastructureError(f"the search service answered HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise ToolError(f"the search service answered HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            data = resp.json()
            hits = data[self.results_key] if self.results_key else data
            if not isinstance(hits, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ToolError(
                f"the search service answered something that is not a result list: {resp.text[:200]}"
            ) from None
        return render_hits(
            hits[:k],
            id_key=self.id_key,
            title_key=self.title_key,
            text_key=self.snippet_key,
            snippet_chars=self.snippet_chars,
        )

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
