"""Frames between the host and the worker, and between the worker and the code's processes: 4-byte big-endian
length + UTF-8 JSON; the result frame an execution writes is untrusted and validated here."""

import json
import os
import struct

_HEADER = struct.Struct(">I")

#: Result kinds the code's process may report; everything else about a result is decided by the worker.
_RESULT_KINDS = ("ok", "error", "oom")


def read_frame(fd, limit):
    """Read one frame from ``fd``; return the decoded object, or None at EOF. Raises ValueError if malformed."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > limit:
        raise ValueError(f"frame of {size} bytes exceeds the limit of {limit}")
    body = _read_exact(fd, size)
    if body is None:
        raise ValueError("frame truncated")
    return json.loads(body.decode("utf-8"))


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            if got:
                raise ValueError("frame truncated")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_frame(fd, obj):
    _write_body(fd, json.dumps(obj).encode("utf-8"))


def _write_body(fd, body):
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def write_result(fd, result, nonce=""):
    """Send an execution result. The common case (no display, error or files) skips json, whose first use
    after a fork costs a fifth of a millisecond: body ``S<exit code> <kind>[ <nonce>]``; otherwise a JSON object.
    ``nonce``: a session kernel echoes the one its request carried."""
    if result["display"] is None and result["error"] is None and not result["files"]:
        body = b"S%d %s" % (result["exit_code"], result["kind"].encode())
        _write_body(fd, body + b" " + nonce.encode() if nonce else body)
    else:
        write_frame(fd, {**result, "nonce": nonce} if nonce else result)


_RESULT_FIELDS = {"exit_code", "kind", "display", "error", "files"}


def parse_result(body, fetch, cap, nonce=""):
    """Decode and validate a result frame written by the code's process (so: untrusted, maybe forged).

    Returns a dict with exactly {exit_code, kind, display, error, files}: ``exit_code`` in 0..255, ``kind`` one of
    :data:`_RESULT_KINDS`, ``display`` a str of at most ``cap`` characters or None, ``error`` None or {ename,
    evalue} (str), ``files`` only paths that were asked for (``fetch``), each a str of base64 or None, within
    the fetch budget. Strings come back as valid Unicode (lone surrogates escaped, see :func:`clean_text`). A
    frame must carry ``nonce`` if one is given (a session's request carries a fresh one). Raises ValueError for
    anything else.
    """
    if body[:1] == b"S":
        code, kind, got = (body[1:].decode("ascii").split(" ") + [""])[:3]
        if not code.isdigit() or len(code) > 3 or body.count(b" ") != (2 if nonce else 1):
            raise ValueError("malformed result")
        raw = {"exit_code": int(code), "kind": kind, "display": None, "error": None, "files": {}}
    else:
        raw = json.loads(body.decode("utf-8"))
        got = raw.pop("nonce", "") if isinstance(raw, dict) else ""
    if got != nonce or not isinstance(raw, dict) or set(raw) != _RESULT_FIELDS:
        raise ValueError("malformed result")
    exit_code, kind, display, error, files = (
        raw[k] for k in ("exit_code", "kind", "display", "error", "files")
    )
    if type(exit_code) is not int or not 0 <= exit_code <= 255 or kind not in _RESULT_KINDS:
        raise ValueError("malformed result")
    if display is not None and (type(display) is not str or len(display) > cap):
        raise ValueError("malformed result")
    if error is not None and not (
        type(error) is dict
        and set(error) == {"ename", "evalue"}
        and all(type(v) is str and len(v) <= cap for v in error.values())
    ):
        raise ValueError("malformed result")
    if type(files) is not dict or not set(files) <= set(fetch):
        raise ValueError("malformed result")
    budget = 4 * cap * 4 // 3 + 4 * len(files)
    for value in files.values():
        if value is not None:
            if type(value) is not str or len(value) > budget:
                raise ValueError("malformed result")
            budget -= len(value)
    return {
        "exit_code": exit_code,
        "kind": kind,
        "display": None if display is None else clean_text(display),
        "error": None if error is None else {k: clean_text(v) for k, v in error.items()},
        "files": {clean_text(k): v for k, v in files.items()},
    }


def result_frame_limit(cap, fetch):
    """The largest result frame a run asked to fetch ``fetch`` can legitimately produce, bytes: display and
    error (JSON may spell each character as a 12-byte surrogate pair escape), the fetch budget in base64 and
    every requested path with its JSON overhead."""
    paths = sum(12 * len(p) + 16 for p in fetch)
    return 65536 + 36 * cap + 4 * cap * 4 // 3 + paths


def clean_text(text):
    """``text`` as valid Unicode: lone surrogates (which no UTF-8 encoder accepts) become ``\\udXXX`` escapes."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
