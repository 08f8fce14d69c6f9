"""The served chat format: how ``agentrl serve model`` describes its :class:`ChatFormat`, and how a client
rebuilds the same format from that description, so token-in-token-out clients render prompts with the
server's own tokenizer and template (no ``format=`` guesswork).

Contract (``GET /v1/agentrl/format``, also summarised in each ``GET /v1/models`` entry under ``agentrl``):

- ``format``: ``"harmony"`` (GPT-OSS, o200k_harmony; ``options`` carry the renderer's settings such as
  ``reasoning_effort``) or ``"chat_template"`` (an HF tokenizer with its chat template);
- ``vocab_size`` and ``stop_token_ids``;
- for ``chat_template``, with ``?files=true``: ``tokenizer_files``, the text files that
  ``tokenizer.save_pretrained`` writes (``tokenizer.json``, ``tokenizer_config.json``, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from agentrl.engines.server.openai_api import ServedFormat
from agentrl.harmony.format import ChatFormat

HARMONY_OPTIONS = ("reasoning_effort", "model_identity", "knowledge_cutoff", "analysis")


def describe_format(fmt: ChatFormat, *, with_files: bool = False) -> ServedFormat:
    """The description of ``fmt`` a server publishes."""
    if fmt.name == "harmony":
        options = {k: getattr(fmt, k) for k in HARMONY_OPTIONS if hasattr(fmt, k)}
        return ServedFormat(
            format="harmony", vocab_size=fmt.vocab_size, stop_token_ids=list(fmt.stop_token_ids), options=options
        )
    files = None
    if with_files:
        tokenizer = getattr(fmt, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"format {fmt.name!r} has no tokenizer to publish")
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = {
                p.name: p.read_text(encoding="utf-8")
                for p in sorted(Path(tmp).iterdir())
                if p.is_file() and p.suffix in (".json", ".jinja", ".txt", ".model") and p.stat().st_size < 64 << 20
            }
    return ServedFormat(
        format="chat_template",
        vocab_size=fmt.vocab_size,
        stop_token_ids=list(fmt.stop_token_ids),
        tokenizer_files=files,
    )


def _cache_dir() -> Path:
    root = os.environ.get("AGENTRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentrl"
    )
    return Path(root) / "served_tokenizers"


def format_from_description(desc: ServedFormat | dict[str, Any]) -> ChatFormat:
    """Rebuild the server's :class:`ChatFormat` (a ``chat_template`` description needs ``tokenizer_files``
    and transformers). Raises ``ValueError`` for a description it cannot use."""
    desc = desc if isinstance(desc, ServedFormat) else ServedFormat.model_validate(desc)
    if desc.format == "harmony":
        from agentrl.harmony import HarmonyFormat

        known = {k: v for k, v in desc.options.items() if k in HARMONY_OPTIONS}
        fmt: ChatFormat = HarmonyFormat(**known)
    elif desc.format == "chat_template":
        if not desc.tokenizer_files:
            raise ValueError("the server described a chat_template format without its tokenizer files")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ValueError(
                "the server speaks an HF chat template; rendering it needs transformers "
                "(pip install 'agentrl-sdk[train]')"
            ) from exc
        from agentrl.harmony import ChatTemplateFormat  # type: ignore[attr-defined]

        blob = json.dumps(desc.tokenizer_files, sort_keys=True).encode()
        target = _cache_dir() / hashlib.sha256(blob).hexdigest()[:24]
        if not (target / ".complete").exists():
            target.mkdir(parents=True, exist_ok=True)
            for name, text in desc.tokenizer_files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"refusing tokenizer file name {name!r} from the server")
                (target / name).write_text(text, encoding="utf-8")
            (target / ".complete").write_text("")
        fmt = ChatTemplateFormat(AutoTokenizer.from_pretrained(str(target)), stop_token_ids=desc.stop_token_ids)
    else:
        raise ValueError(f"the server speaks chat format {desc.format!r}, which this client does not know")
    if fmt.vocab_size != desc.vocab_size:
        raise ValueError(
            f"rebuilt format has {fmt.vocab_size} ids but the server's has {desc.vocab_size}; "
            "the client's agentrl/transformers differ from the server's"
        )
    return fmt
