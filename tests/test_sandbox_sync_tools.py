"""Sync ``@tool`` functions that overrun their timeout are really stopped, and never hold up interpreter exit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.envs.tools import FunctionTool, tool
from agentrl.envs.tools.base import ToolError
from agentrl.envs.tools.dispatch import Sessions, ToolBox
from agentrl.harmony.types import ToolCall

REPO = Path(__file__).resolve().parents[1]


def call(box: ToolBox, name: str, args: dict) -> object:
    return asyncio.run(box.call(ToolCall(f"functions.{name}", name, args, ""), Sessions()))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("body", ["time.sleep(600)", "while True:\n        pass"])
def test_timed_out_sync_tool_is_stopped(tmp_path, body):
    pidfile = tmp_path / "pid"

    @tool(timeout_s=0.5)
    def stuck() -> str:
        """Never returns."""
        import time  # noqa: F401

        pidfile.write_text(str(os.getpid()))
        exec(textwrap.dedent(f"import time\nif True:\n    {body}"))
        return "unreachable"

    t = time.monotonic()
    record = call(ToolBox([stuck]), "stuck", {})
    assert record.error == "tool_timeout" and "was stopped" in record.result, record
    assert time.monotonic() - t < 3
    pid = int(pidfile.read_text())
    assert pid != os.getpid()
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid)  # really stopped, not left running


def test_results_errors_and_state(tmp_path):
    seen = {"n": 1}

    @tool
    def reads_state() -> int:
        """Reads and changes the caller's state."""
        seen["n"] += 1
        return seen["n"]

    @tool
    def fails(kind: str) -> str:
        """Fails in several ways."""
        if kind == "tool":
            raise ToolError("use another value", "bad_arguments")
        if kind == "custom":

            class Odd(Exception):
                def __init__(self, a, b):
                    super().__init__(f"{a}/{b}")

            raise Odd(1, 2)
        if kind == "exit":
            os._exit(3)
        raise ValueError("kaboom")

    box = ToolBox([reads_state, fails])
    assert call(box, "reads_state", {}).result == "2"  # sees the state at the call
    seen["n"] = 10
    assert call(box, "reads_state", {}).result == "11"
    assert seen["n"] == 10  # the child's change stays in the child
    r = call(box, "fails", {"kind": "tool"})
    assert r.error == "bad_arguments" and "use another value" in r.result
    r = call(box, "fails", {"kind": "value"})
    assert r.error == "tool_exception" and "ValueError: kaboom" in r.result
    r = call(box, "fails", {"kind": "custom"})
    assert r.error == "tool_exception" and "Odd: 1/2" in r.result
    r = call(box, "fails", {"kind": "exit"})
    assert r.error == "tool_exception" and "exit code 3" in r.result


def test_thread_mode_keeps_in_process_state_and_says_when_it_abandons():
    log = []

    @tool(run_in="thread", timeout_s=0.3)
    def append(x: int) -> int:
        """Changes the caller's state."""
        if x < 0:
            time.sleep(5)
        log.append(x)
        return len(log)

    box = ToolBox([append])
    assert call(box, "append", {"x": 1}).result == "1" and log == [1]
    r = call(box, "append", {"x": -1})
    assert r.error == "tool_timeout" and "abandoned" in r.result and "stopped" not in r.result


def test_bad_run_in_names_the_choices():
    with pytest.raises(ValueError, match="process"):
        FunctionTool(lambda: 1, run_in="gpu")


SCRIPT = """
import asyncio, os, sys, time
sys.path.insert(0, {repo!r})
from agentrl.envs.tools import tool
from agentrl.envs.tools.dispatch import Sessions, ToolBox
from agentrl.harmony.types import ToolCall

@tool(run_in={run_in!r}, timeout_s={timeout})
def stuck() -> str:
    \"\"\"Never returns.\"\"\"
    open({pidfile!r}, "w").write(str(os.getpid()))
    time.sleep(600)

async def main():
    box = ToolBox([stuck])
    task = asyncio.ensure_future(box.call(ToolCall("functions.stuck", "stuck", {{}}, ""), Sessions()))
    if {wait_for_timeout}:
        print((await task).error, flush=True)
    else:
        await asyncio.sleep(0.5)
        print("leaving mid-call", flush=True)
        os._exit(0) if False else sys.exit(0)

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "run_in, wait_for_timeout", [("process", True), ("process", False), ("thread", True), ("thread", False)]
)
def test_a_stuck_tool_never_holds_up_interpreter_exit(tmp_path, run_in, wait_for_timeout):
    pidfile = tmp_path / "pid"
    script = SCRIPT.format(
        repo=str(REPO), run_in=run_in, timeout=0.3, pidfile=str(pidfile), wait_for_timeout=wait_for_timeout
    )
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 15, "the interpreter waited for the stuck tool"
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("tool_timeout", "leaving mid-call"), out
    if run_in == "process":
        pid = int(pidfile.read_text())
        deadline = time.monotonic() + 2
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid)  # the child did not outlive the interpreter
