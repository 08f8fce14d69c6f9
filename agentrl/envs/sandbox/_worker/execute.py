"""The code side: what runs in the forked child that executes the code (stateless runs and session kernels)."""

import ast
import base64
import io
import linecache
import os
import sys
import traceback
import types

FILENAME = "<cell>"

#: Where the worker's modules were loaded from: the zipapp inside the sandbox (see ``isolation.WORKER_BOOTSTRAP``),
#: this package's directory otherwise. The code's tracebacks leave out frames of files there.
SOURCE = os.path.dirname(os.path.abspath(__file__))
#: The environment the code sees (HOME and TMPDIR are its private working directory).
CODE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
WORKDIR = "/tmp"


def execute(code, namespace, want_display, cap, files=None, fetch=(), compiled=None):
    """Run ``code`` in ``namespace`` and return {exit_code, kind, display, error, files}; output goes to fds 1/2.

    ``files`` (path -> base64) are written first and ``fetch`` paths read back afterwards (base64, None if
    missing or too big), both with the code's own privileges. ``compiled``: ``code`` already compiled (by the
    worker, before the fork, where compiling is cheap), for stateless runs.
    """
    display = error = None
    try:
        for path, b64 in (files or {}).items():
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(b64 or ""))
        if want_display:
            tree = ast.parse(code, FILENAME, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, FILENAME, "exec"), namespace)
            if last is not None:
                value = eval(compile(last, FILENAME, "eval"), namespace)
                if value is not None:
                    display = repr(value)[:cap]
        else:
            exec(compiled or compile(code, FILENAME, "exec"), namespace)
        exit_code, kind = 0, "ok"
    except SystemExit as exc:
        exit_code = _system_exit_code(exc)
        kind = "ok" if exit_code == 0 else "error"
    except BaseException as exc:  # the code's failure is data, never the kernel's death
        kind = "oom" if isinstance(exc, MemoryError) else "error"
        exit_code = 1
        error = {"ename": type(exc).__name__[:cap], "evalue": _safe_str(exc)[:cap]}
        linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
        _print_user_traceback(exc)
    _flush_std()
    return {
        "exit_code": exit_code,
        "kind": kind,
        "display": display,
        "error": error,
        "files": _fetch_files(fetch, 4 * cap),
    }


def _fetch_files(paths, budget):
    out = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read(budget + 1)
        except (OSError, ValueError):  # missing, unreadable, or not a valid path (NUL, lone surrogate)
            data = None
        if data is None or len(data) > budget:
            out[path] = None
        else:
            budget -= len(data)
            out[path] = base64.b64encode(data).decode("ascii")
    return out


def fresh_main():
    """A new ``__main__`` module, registered in sys.modules, whose dict is the code's global namespace (so that
    pickle finds the code's functions, e.g. for multiprocessing)."""
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    return main.__dict__


#: Code up to this size is compiled by the worker before it forks (a cold child pays ~10x for compiling).
_PRECOMPILE_MAX = 64 * 1024


def _precompile(code):
    """``code`` compiled, or None: then the child compiles it and reports any error as the code's own."""
    if len(code) > _PRECOMPILE_MAX:
        return None
    try:
        return compile(code, FILENAME, "exec")
    except Exception:
        return None


def _system_exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(_safe_str(exc.code) + "\n")
    return 1


def _safe_str(obj):
    try:
        return str(obj)
    except BaseException:
        return f"<unprintable {type(obj).__name__}>"


def _print_user_traceback(exc):
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if os.path.dirname(f.filename) != SOURCE]
        )
        sys.stderr.write("".join(te.format()))
    except BaseException:
        sys.stderr.write(f"{type(exc).__name__} (traceback unavailable)\n")


def _flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def _fresh_std_streams():
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
