"""Run a synchronous tool function in a killable child process.

A Python thread cannot be stopped, so a sync function that overruns its timeout in a thread keeps running
(and keeps the interpreter from exiting). Here each call runs in a child forked from the caller for that call:
it sees the caller's memory as it is at the call (closures and globals work, nothing is imported or pickled on
the way in), and sends its result (or exception) back pickled. A call that is cancelled (the dispatcher's
timeout) or whose caller goes away SIGKILLs its child, so it really stops; children still running at
interpreter exit are SIGKILLed, so a stuck tool never delays shutdown.

What the function changes in memory stays in the child: tools that must change the caller's state should be
``async`` or use ``FunctionTool(run_in="thread")``. Results and exceptions must be picklable (an exception that
is not comes back as a ``RuntimeError`` naming it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Any

from agentrl.envs.tools.base import ToolError

#: pids of running children, to be killed at exit.
_LIVE: set[int] = set()


class ToolProcessDied(RuntimeError):
    """The child running a tool call ended without answering (crash, ``os._exit``, signal)."""


@atexit.register
def _kill_children_at_exit() -> None:
    for pid in list(_LIVE):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _child(fn: Callable[..., Any], kwargs: dict[str, Any], out: int) -> None:
    """In the forked child: run, send ``(status, value)`` pickled, and leave without running the caller's exit
    handlers or finalizers (they belong to the caller)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
        try:
            reply: tuple[str, Any] = ("ok", fn(**kwargs))
        except ToolError as exc:
            reply = ("tool_error", (str(exc), exc.kind))
        except BaseException as exc:  # the caller re-raises it
            reply = ("raise", _portable(exc))
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            data = pickle.dumps(("raise", TypeError(f"the tool's result cannot be pickled: {exc}")))
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    except BaseException:  # noqa: BLE001 - never return into the caller's code
        code = 70
    finally:
        os._exit(code)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - custom exceptions often cannot be rebuilt from their args
        return RuntimeError(f"{type(exc).__name__}: {exc}")


async def run_forked(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)`` in a child forked for this call; returns its value or raises its exception.

    Raises ToolProcessDied if the child ends without answering. If the caller is cancelled, the child is
    SIGKILLed and reaped before the cancellation propagates.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():  # forking a threaded process: the child only runs fn and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, kwargs, write_fd)
    _LIVE.add(pid)
    os.close(write_fd)
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    eof = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(read_fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            chunks.append(chunk)
        elif not eof.done():
            eof.set_result(None)

    os.set_blocking(read_fd, False)
    loop.add_reader(read_fd, readable)
    try:
        await eof
    except BaseException:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        loop.remove_reader(read_fd)
        os.close(read_fd)
        status = await _reap(pid)
    try:
        kind, value = pickle.loads(b"".join(chunks))
    except Exception:  # noqa: BLE001 - no or a truncated answer
        how = f"signal {-status}" if status < 0 else f"exit code {status}"
        raise ToolProcessDied(f"the tool's process ended without answering ({how})") from None
    if kind == "tool_error":
        raise ToolError(*value)
    if kind == "raise":
        raise value
    return value


async def _reap(pid: int) -> int:
    """Wait for the child without blocking the loop; its exit code, or -signal."""
    delay = 0.0005
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            _LIVE.discard(pid)
            return 0
        if done:
            _LIVE.discard(pid)
            return os.waitstatus_to_exitcode(status)
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            raise
        delay = min(2 * delay, 0.02)
