"""Small public datasets shipped with agentrl, for offline evaluation and tests (no network, no download).

Each lives in its own folder beside this file with its licence (``LICENSE*``) and provenance
(``SOURCE.md``: origin, commit, sha256). All are permissively licensed (MIT or Apache-2.0), 1.4 MB together.

| name | file | rows | licence | env that reads it |
|---|---|---|---|---|
| ``gsm8k`` | ``gsm8k/test.jsonl`` (GSM8K test split) | 1319 | MIT | ``gsm8k`` (its default evaluation set) |
| ``ifeval`` | ``ifeval/input_data.jsonl`` (IFEval prompts) | 541 | Apache-2.0 | ``verifyif`` (its default evaluation set) |
| ``aime2024`` | ``aime/aime_2024.jsonl`` (AIME 2024 I + II) | 30 | MIT | ``retool`` (``tasks=aime2024``) |
| ``math500`` | ``math500/test.jsonl`` (MATH-500) | 500 | MIT | ``retool`` (``tasks=math500``) |

A dataset name works wherever a task file path does (``agentrl eval env=retool tasks=math500``,
``data.tasks=aime2024`` in training, ``ReToolEnv.tasks(path="math500")``): :func:`resolve` maps it to the file.
"""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parent

#: dataset name -> file path relative to this package
DATASETS: dict[str, str] = {
    "gsm8k": "gsm8k/test.jsonl",
    "ifeval": "ifeval/input_data.jsonl",
    "aime2024": "aime/aime_2024.jsonl",
    "math500": "math500/test.jsonl",
}


def dataset_path(name: str) -> Path:
    """The file of a shipped dataset; raises KeyError listing the names."""
    if name not in DATASETS:
        raise KeyError(f"no shipped dataset {name!r}; shipped: {', '.join(DATASETS)}")
    return _ROOT / DATASETS[name]


def resolve(path_or_name: str | os.PathLike[str]) -> Path:
    """``path_or_name`` as a path: an existing file stays itself; a shipped dataset's name (and no such file)
    becomes that dataset's file; anything else is returned unchanged (the caller reports it missing)."""
    p = Path(path_or_name)
    if not p.exists() and str(path_or_name) in DATASETS:
        return dataset_path(str(path_or_name))
    return p
