"""Task loaders: local JSONL/parquet files in the common public formats, and (online only) the HF hub.

Every loader returns a list of task dicts with at least ``id`` and ``prompt``; the other keys depend on the
env (``answer`` for math, ``instruction_id_list``/``kwargs`` for IFEval). Nothing here touches the network
except :func:`load_hf_rows`, which only runs when called explicitly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``/``.json`` (list of objects) or ``.parquet`` file, or of a dataset shipped with
    agentrl named instead of a path (``gsm8k``, ``ifeval``, ``aime2024``, ``math500``; :mod:`agentrl.data`)."""
    from agentrl.data import DATASETS, resolve

    p = resolve(path)
    if not p.exists():
        raise FileNotFoundError(
            f"task file {str(p)!r} does not exist (shipped datasets, usable by name: {', '.join(DATASETS)})"
        )
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(f"reading {p.name} needs pyarrow: pip install pyarrow (or convert it to JSONL)") from e

        return pq.read_table(p).to_pylist()
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{p}: a .json task file must hold a list of objects")
        return data
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{p}:{i}: not valid JSON ({e.msg}); expected one JSON object per line"
                ) from e
    return rows


def load_task_file(path: str | Path) -> list[dict[str, Any]]:
    """Rows that already are task dicts (must have ``prompt``); ``id`` defaults to the row index."""
    rows = read_rows(path)
    for i, r in enumerate(rows):
        if "prompt" not in r:
            raise ValueError(f"{path}: row {i} has no 'prompt' key (keys: {sorted(r)})")
        r.setdefault("id", i)
    return rows


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_row_to_task(row: dict[str, Any], index: int) -> dict[str, Any]:
    """GSM8K ``{question, answer: "...#### 72"}`` -> ``{id, prompt, answer: "72", solution}``."""
    m = _GSM8K_ANSWER.search(row["answer"])
    if not m:
        raise ValueError(f"GSM8K row {index}: answer has no '#### <number>' line: {row['answer'][-80:]!r}")
    return {
        "id": row.get("id", index),
        "prompt": row["question"],
        "answer": m.group(1).replace(",", "").strip(),
        "solution": row["answer"],
    }


def load_gsm8k(path: str | Path) -> list[dict[str, Any]]:
    """A local GSM8K-format file (``{question, answer}`` with ``#### <final>``)."""
    return [gsm8k_row_to_task(r, i) for i, r in enumerate(read_rows(path))]


def math_row_to_task(row: dict[str, Any], index: int) -> dict[str, Any]:
    """AIME/MATH ``{problem, answer}`` or DAPO-Math (``prompt`` = chat list, ``reward_model.ground_truth``)
    -> ``{id, prompt, answer}``."""
    if "problem" in row and "answer" in row:
        prompt, answer = row["problem"], row["answer"]
    elif isinstance(row.get("prompt"), list) and isinstance(row.get("reward_model"), dict):
        prompt = next(m["content"] for m in row["prompt"] if m.get("role") == "user")
        answer = row["reward_model"]["ground_truth"]
    elif "question" in row and "answer" in row:
        prompt, answer = row["question"], row["answer"]
    else:
        raise ValueError(
            f"math row {index}: expected {{problem, answer}} (AIME/MATH) or DAPO-Math fields, got keys {sorted(row)}"
        )
    return {"id": row.get("id", index), "prompt": str(prompt), "answer": str(answer)}


def load_math(path: str | Path) -> list[dict[str, Any]]:
    """A local AIME/MATH/DAPO-style file."""
    return [math_row_to_task(r, i) for i, r in enumerate(read_rows(path))]


def ifeval_row_to_task(row: dict[str, Any], index: int) -> dict[str, Any]:
    """IFEval input format ``{key, prompt, instruction_id_list, kwargs}`` -> task dict."""
    for k in ("prompt", "instruction_id_list", "kwargs"):
        if k not in row:
            raise ValueError(f"IFEval row {index}: missing {k!r} (keys: {sorted(row)})")
    kwargs = [{k: v for k, v in (kw or {}).items() if v is not None} for kw in row["kwargs"]]
    return {
        "id": row.get("key", index),
        "prompt": row["prompt"],
        "instruction_id_list": list(row["instruction_id_list"]),
        "kwargs": kwargs,
    }


def load_ifeval(path: str | Path) -> list[dict[str, Any]]:
    """A local IFEval ``input_data.jsonl``."""
    return [ifeval_row_to_task(r, i) for i, r in enumerate(read_rows(path))]


def load_hf_rows(repo: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a dataset on the HF hub (needs network and the ``datasets`` package). Never called by
    default; e.g. ``load_hf_rows("openai/gsm8k", "test", "main")``."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("loading from the HF hub needs `pip install datasets`") from e
    return list(datasets.load_dataset(repo, config, split=split))
