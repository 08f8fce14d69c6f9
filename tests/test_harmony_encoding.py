"""Offline Harmony encoding: the vocabulary rebuilt from quicktok-v1, cache handling, and the HF tokenizer."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.harmony.encoding import (
    O200K_FILENAME,
    O200K_SHA256,
    build_o200k_tiktoken_bytes,
    ensure_o200k_file,
)

_LOAD = textwrap.dedent(
    """
    import os, sys
    from agentrl.harmony import HarmonyFormat
    fmt = HarmonyFormat()
    assert fmt.decode(fmt.encode("offline 🙂")) == "offline 🙂"
    print(os.environ.get("TIKTOKEN_ENCODINGS_BASE", ""))
    """
)
_CONTROL = textwrap.dedent(
    """
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    try:
        load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        print("FAILED", type(e).__name__)
    else:
        print("LOADED")
    """
)


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIKTOKEN_")}
    env.update(AGENTRL_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"), **extra)
    return env


def _offline_prefix() -> tuple[list[str], dict[str, str]]:
    """A command prefix with no network namespace, or (fallback) proxies pointing at a closed port."""
    for prefix in (["unshare", "-n"], ["unshare", "--user", "--net"]):
        if shutil.which(prefix[0]) and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix, {}
    dead = "http://127.0.0.1:9"
    return [], {"HTTPS_PROXY": dead, "HTTP_PROXY": dead, "https_proxy": dead, "http_proxy": dead}


def test_rebuilt_vocabulary_has_the_official_hash():
    payload = build_o200k_tiktoken_bytes()
    assert hashlib.sha256(payload).hexdigest() == O200K_SHA256
    assert len(payload) == 3_613_922


def test_loads_offline_into_a_fresh_cache(tmp_path):
    prefix, extra = _offline_prefix()
    env = _clean_env(tmp_path, **extra)
    # control: without our loader openai-harmony cannot fetch its vocabulary in this sandbox
    control = subprocess.run(
        [*prefix, sys.executable, "-c", _CONTROL],
        env={**env, "TIKTOKEN_RS_CACHE_DIR": str(tmp_path / "empty")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert control.stdout.startswith("FAILED"), control.stdout + control.stderr
    run = subprocess.run(
        [*prefix, sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    cache = tmp_path / "cache" / "tiktoken"
    assert run.stdout.strip() == str(cache)
    assert hashlib.sha256((cache / O200K_FILENAME).read_bytes()).hexdigest() == O200K_SHA256
    assert [p.name for p in cache.iterdir()] == [O200K_FILENAME]  # no temporary files left behind


def test_user_settings_are_respected(tmp_path):
    theirs = tmp_path / "theirs"
    ensure_o200k_file(theirs)
    env = _clean_env(tmp_path, TIKTOKEN_ENCODINGS_BASE=str(theirs))
    run = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(theirs)
    assert not (tmp_path / "cache").exists()  # nothing written to our cache

    env = _clean_env(tmp_path, TIKTOKEN_ENCODINGS_BASE=str(tmp_path / "nothing-here"))
    run = subprocess.run(
        [*_offline_prefix()[0], sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert "TIKTOKEN_ENCODINGS_BASE" in run.stderr and "unset them" in run.stderr


def test_corrupt_cache_file_is_rebuilt(tmp_path):
    path = ensure_o200k_file(tmp_path)
    path.write_bytes(b"garbage")
    assert ensure_o200k_file(tmp_path) == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256


def test_unwritable_cache_gives_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="AGENTRL_CACHE"):
        ensure_o200k_file(blocker / "sub")


def test_hf_tokenizer_has_identical_ids(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tiktoken")
    from agentrl.harmony import HarmonyFormat, harmony_hf_tokenizer

    fmt = HarmonyFormat()
    tok = harmony_hf_tokenizer(tmp_path)
    assert len(tok) == fmt.vocab_size == 201088
    texts = [
        'Hello wörld!  日本語 🙂 x = [1,2,3]\n\n  def f():\n\treturn "it\'s"  ',
        "<|start|>assistant<|channel|>analysis<|message|>I'LL think 123456 +-*/ ...<|end|>",
        '<|start|>assistant to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>{"q": 1}<|call|>',
        "CamelCaseWords and ALLCAPS'LL don't\r\n\r\n   trailing   ",
    ]
    for text in texts:
        want = fmt.encoding.encode(text, allowed_special="all")
        assert tok.encode(text, add_special_tokens=False) == want
        assert tok.decode(want) == text
    specials = sorted(fmt._special_ids)[:-1]  # all inside the model vocabulary
    assert tok.convert_ids_to_tokens(specials) == [fmt.decode([i]) for i in specials]
    assert (tok.eos_token_id, tok.pad_token_id) == (fmt.tokens.return_, 199999)
