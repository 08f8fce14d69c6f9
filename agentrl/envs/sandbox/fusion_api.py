"""SandboxFusion's HTTP API, as pydantic models: the request and response bodies of ``POST /run_code`` and
``POST /run_jupyter`` (field names and enum values as in the ``sandbox-fusion`` client, version 0.3.7),
plus the mapping between them and :class:`~agentrl.envs.sandbox.base.ExecResult`. ``memory_limit_MB`` is
from SandboxFusion's server models (the client package omits it; verl sends it).

Shared by our server (``agentrl serve sandbox``) and our client (:mod:`.fusion`). Unknown request fields are
ignored; timeouts must be finite and positive (``cell_timeout`` may be 0: no per-cell limit), else the server
answers 422. Responses are strict models (no extra fields, no type coercion): an answer is built only from
validated values of the right types, whatever the code in the sandbox printed or wrote.

Our server adds two optional fields to every execution's result (``CommandRunResult`` and ``CellRunResult``),
which SandboxFusion clients ignore: ``exec_status``, the sandbox's own verdict (one of
:data:`~agentrl.envs.sandbox.base.STATUSES`: it tells an out-of-memory kill or a signal from an ordinary error),
and ``truncated`` (output was cut). Our client reads them instead of guessing from the printed text, which the
code controls; answers of a real SandboxFusion server lack them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.envs.sandbox.base import ExecResult

ExecStatus = Literal["ok", "error", "timeout", "killed", "oom", "sandbox_error"]
CommandRunStatus = Literal["Finished", "Error", "TimeLimitExceeded"]
RunStatus = Literal["Success", "Failed", "SandboxError"]

#: Languages this implementation runs. SandboxFusion knows many more; we answer those with SandboxError.
PYTHON_LANGUAGES = ("python", "python3")


class _Strict(BaseModel):
    """A response model: exact types, no extra fields."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Request(BaseModel):
    """A request model: NaN and infinity are refused (HTTP 422), unknown fields ignored."""

    model_config = ConfigDict(allow_inf_nan=False)


class CommandRunResult(_Strict):
    status: CommandRunStatus
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    exec_status: ExecStatus | None = None  # ours (see the module note)
    truncated: bool | None = None  # ours


class RunCodeRequest(_Request):
    code: str
    language: str = "python"
    compile_timeout: float = Field(10, ge=0)  # accepted and checked; Python needs no compile step
    run_timeout: float = Field(10, gt=0)
    stdin: str | None = None
    memory_limit_MB: int = Field(-1, ge=-1)  # -1 (or 0): the server's default
    files: dict[str, str | None] = Field(default_factory=dict)  # path -> base64 content
    fetch_files: list[str] = Field(default_factory=list)


class RunCodeResponse(_Strict):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(_Request):
    cells: list[str]
    cell_timeout: float = Field(0, ge=0)  # 0: only total_timeout applies
    total_timeout: float = Field(45, gt=0)
    memory_limit_MB: int = Field(-1, ge=-1)  # accepted; sessions keep the pool's limit
    kernel: Literal["python3"] = "python3"
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(_Strict):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]
    exec_status: ExecStatus | None = None  # ours (see the module note)
    truncated: bool | None = None  # ours


class RunJupyterResponse(_Strict):
    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def command_result(result: ExecResult) -> CommandRunResult:
    """One execution as SandboxFusion's ``CommandRunResult`` (a timeout has no return code)."""
    return CommandRunResult(
        status="TimeLimitExceeded" if result.status == "timeout" else "Finished",
        execution_time=result.duration_s,
        return_code=None if result.status == "timeout" else result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        exec_status=result.status,
        truncated=result.truncated,
    )


def run_code_response(result: ExecResult) -> RunCodeResponse:
    """An :class:`ExecResult` as the body of a ``/run_code`` answer (fetched files included)."""
    if result.status == "sandbox_error":
        return RunCodeResponse(status="SandboxError", message=result.message or "sandbox error")
    run = command_result(result)
    status: RunStatus = "Success" if run.status == "Finished" and run.return_code == 0 else "Failed"
    return RunCodeResponse(status=status, message=result.message, run_result=run, files=fetched_files(result))


def fetched_files(result: ExecResult) -> dict[str, str]:
    """The files a run fetched (path -> base64), without those that were missing or too large."""
    return {k: v for k, v in result.files.items() if isinstance(k, str) and isinstance(v, str)}


def exec_result_from_run(resp: RunCodeResponse) -> ExecResult:
    """A ``/run_code`` answer (ours or real SandboxFusion's) as an :class:`ExecResult`. The status and the
    truncation come from the answer's fields, never from the printed output (which the code controls): from
    ``exec_status``/``truncated`` where present (our server), else from the run status and return code only."""
    if resp.status == "SandboxError":
        return ExecResult("", "", None, "sandbox_error", 0.0, message=resp.message or "sandbox error")
    run = resp.run_result or resp.compile_result
    if run is None:
        return ExecResult(
            "", "", None, "sandbox_error", 0.0, message=f"no run result in the answer: {resp.message}"
        )
    code = run.return_code
    if run.exec_status is not None:
        status: str = run.exec_status
    elif run.status == "TimeLimitExceeded":
        status = "timeout"
    elif run.status == "Error":
        status = "sandbox_error"
    elif code == 0:
        status = "ok"
    elif code is not None and code < 0:
        status = "killed"
    else:
        status = "error"
    return ExecResult(
        stdout=run.stdout or "",
        stderr=run.stderr or "",
        exit_code=code,
        status=status,
        duration_s=run.execution_time or 0.0,
        truncated=bool(run.truncated),
        message=resp.message,
    )


def output_bytes(result: ExecResult) -> int:
    """How much output an execution adds to an answer, bytes: the length of its text as the answer's JSON
    carries it (a control character takes six bytes there, ``\\u0001``), so that a budget counts what is
    sent; a traceback counts twice, as SandboxFusion repeats it in a cell's error."""
    texts = (
        result.stdout,
        result.stderr,
        result.stderr,
        result.display or "",
        *(result.error or {}).values(),
    )
    return sum(len(json.dumps(str(t), ensure_ascii=False).encode("utf-8", "replace")) - 2 for t in texts)


def cell_result(result: ExecResult) -> CellRunResult:
    """One stateful execution as a Jupyter cell result (display as a text/plain bundle, error as ename/evalue from
    the sandbox's own record of the exception, never from the printed text)."""
    display = [{"text/plain": result.display}] if result.display is not None else []
    error: list[dict[str, Any]] = []
    if result.error is not None:
        error.append({**result.error, "traceback": result.stderr.splitlines()})
    return CellRunResult(
        stdout=result.stdout,
        stderr=result.stderr,
        display=display,
        error=error,
        exec_status=result.status,
        truncated=result.truncated,
    )
