"""The one place a :class:`~agentrl.harmony.ChatFormat` is chosen by name (``format=`` everywhere:
``agentrl train``, ``eval``, ``view``, ``serve model``, the verl agent loop, the runtime).

Names:

- ``harmony``: the shared :class:`~agentrl.harmony.HarmonyFormat` (GPT-OSS; offline o200k_harmony).
- ``chat_template``: :class:`~agentrl.harmony.ChatTemplateFormat` over the model's own tokenizer.
- ``auto``: Harmony for GPT-OSS models (``model_type == "gpt_oss"``) and for models without an HF
  tokenizer (they speak Harmony), the tokenizer's chat template otherwise.
- anything else: an HF tokenizer name or directory whose chat template to use
  (``ChatTemplateFormat.from_pretrained``; imports transformers).
"""

from __future__ import annotations

from typing import Any

from agentrl.harmony.format import ChatFormat

#: The format names with a fixed meaning; any other name is an HF tokenizer to load.
FORMAT_NAMES = ("auto", "harmony", "chat_template")

_DEFAULT: ChatFormat | None = None


def default_format() -> ChatFormat:
    """The shared default :class:`~agentrl.harmony.HarmonyFormat` (built once per process)."""
    global _DEFAULT
    if _DEFAULT is None:
        from agentrl.harmony.harmony_format import HarmonyFormat

        _DEFAULT = HarmonyFormat()
    return _DEFAULT


def make_format(name: str = "auto", *, tokenizer: Any = None, model_type: str | None = None) -> ChatFormat:
    """The ChatFormat called ``name`` (see the module docstring).

    Args:
        name: ``auto``, ``harmony``, ``chat_template``, or an HF tokenizer name/path.
        tokenizer: the model's HF tokenizer, or ``None`` for models that speak Harmony.
        model_type: the model's ``config.model_type`` when known (``auto`` picks Harmony for ``gpt_oss``).

    Raises:
        ValueError: ``chat_template`` without a tokenizer, or an empty name.
    """
    if not name:
        raise ValueError(f"format must be one of {', '.join(FORMAT_NAMES)} or an HF tokenizer path, got {name!r}")
    if name == "auto":
        name = "harmony" if tokenizer is None or model_type == "gpt_oss" else "chat_template"
    if name == "harmony":
        return default_format()
    from agentrl.harmony.chat_template import ChatTemplateFormat

    if name == "chat_template":
        if tokenizer is None:
            raise ValueError(
                "format=chat_template needs the model's HF tokenizer, but this model has none (it speaks "
                "Harmony): use format=harmony or format=auto"
            )
        return ChatTemplateFormat(tokenizer)
    return ChatTemplateFormat.from_pretrained(name)
