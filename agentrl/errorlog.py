"""Tracebacks for whoever changes the code: a run directory's ``errors.log``, and ``AGENTRL_DEBUG=1``.

Users see one line per failure: a failed episode's ``Type: message`` (in its trajectory, the metrics, an
evaluation's ``errors.jsonl``) and a fatal error's ``agentrl <command>: ...``. The full traceback of every failed
episode (one that raised, or one a tool's backend ended) and of every fatal error goes to ``errors.log`` in the run
directory: plain text, appended, one block per failure, a header line ``=== <UTC time> <what>`` and then the
traceback. With ``AGENTRL_DEBUG=1`` (any value but empty or ``0``) nothing is turned into a line: the exception of a
failing episode and a fatal error are re-raised where they happen. Stdlib only.
"""

from __future__ import annotations

import os
import time
import traceback

ERRORS_LOG = "errors.log"
DEBUG_ENV = "AGENTRL_DEBUG"


def debug() -> bool:
    """True when ``AGENTRL_DEBUG`` asks for errors to be re-raised instead of reported in one line."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def format_exception(exc: BaseException) -> str:
    """The full traceback of ``exc`` (chained causes included), as Python prints it."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def append(directory: str | os.PathLike, what: str, text: str) -> str:
    """Append one block (``=== <UTC time> <what>`` and ``text``) to ``directory/errors.log`` (created with the
    directory when missing); returns the file's path. A block is one ``write`` on an ``O_APPEND`` descriptor, so
    concurrent writers do not interleave."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ERRORS_LOG)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    block = f"=== {stamp} {what}\n{text.rstrip()}\n\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, block.encode("utf-8", errors="replace"))
    finally:
        os.close(fd)
    return path
