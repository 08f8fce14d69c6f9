"""A transformers fast tokenizer for GPT-OSS built offline, with ids identical to the Harmony encoding.

Built from the same ``o200k_base.tiktoken`` that :mod:`agentrl.harmony.encoding` rebuilds, with transformers'
``TikTokenConverter`` (needs ``tiktoken``) and the o200k split pattern, plus every Harmony special token at
its Harmony id. The conversion takes a while, so the result is cached as ``tokenizer.json`` next to the
vocabulary file (atomic write). transformers and tiktoken are imported only when this is called.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.harmony.encoding import (
    O200K_SHA256,
    default_cache_dir,
    ensure_o200k_file,
    load_harmony_encoding_offline,
    write_cache_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# tiktoken's o200k_base pre-tokenisation pattern (the regex that splits text before BPE).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
GPT_OSS_VOCAB_SIZE = 201088
_CACHE_NAME = f"gpt-oss-tokenizer-{O200K_SHA256[:12]}.json"
_lock = threading.Lock()


def _special_tokens() -> list[tuple[int, str]]:
    """(id, text) of every Harmony special token inside GPT-OSS's vocabulary, ordered by id."""
    enc = load_harmony_encoding_offline()
    pairs = [
        (enc.encode(s, allowed_special={s}, disallowed_special=())[0], s) for s in enc.special_tokens_set
    ]
    return sorted((i, s) for i, s in pairs if i < GPT_OSS_VOCAB_SIZE)


def _build_tokenizer_json(vocab_file: Path) -> str:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = _special_tokens()
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=O200K_PATTERN).converted()
    base = backend.get_vocab_size()
    if specials[0][0] != base or [i for i, _ in specials] != list(range(base, base + len(specials))):
        raise RuntimeError("Harmony special ids are not contiguous after the o200k vocabulary")
    backend.add_special_tokens([AddedToken(s, normalized=False, special=True) for _, s in specials])
    return backend.to_str()


def harmony_hf_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` whose ids equal the Harmony encoding's, specials included
    (201,088 tokens; bos ``<|startoftext|>``, eos ``<|return|>``, pad ``<|endoftext|>``).

    ``cache_dir`` defaults to the tiktoken cache of :func:`default_cache_dir`. Needs ``transformers`` and
    ``tiktoken`` (the ``train`` extra); raises ``ImportError`` naming them otherwise.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ImportError(
            "harmony_hf_tokenizer needs transformers: pip install 'agentrl-sdk[train]'"
        ) from exc
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _CACHE_NAME
    with _lock:
        if not target.is_file():
            try:
                import tiktoken  # noqa: F401  (TikTokenConverter reads the vocabulary with it)
            except ImportError as exc:
                raise ImportError(
                    "building the GPT-OSS tokenizer needs tiktoken: pip install tiktoken"
                ) from exc
            payload = _build_tokenizer_json(ensure_o200k_file(cache))
            json.loads(payload)  # sanity: the backend serialised valid JSON
            write_cache_file(target, payload.encode("utf-8"))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(target),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
