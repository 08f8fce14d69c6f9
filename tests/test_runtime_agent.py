"""Product runtime: an Agent drives the retool env's real python tool (local sandbox) against a real
OpenAI-compatible chat endpoint (our server over uvicorn, scripted model behind it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _no_torch import check_imports_without_torch
from _scripted_engine import ScriptedEngine

import agentrl.envs as envs
from agentrl.engines.base import SamplingParams
from agentrl.engines.server import BackgroundServer, create_app
from agentrl.harmony import HarmonyFormat, Message
from agentrl.runtime import Agent, Done, TextDelta, ToolEvent

FMT = HarmonyFormat()
TOOL_RESULT = re.compile(
    r"<\|start\|>functions\.(\w+) to=assistant<\|channel\|>commentary<\|message\|>(.*?)<\|end\|>", re.S
)


def calculator_policy(prompt: str, sampling: SamplingParams) -> list[Message]:
    """Run the product of the two numbers in the request with python, then box the printed result.
    Requests mentioning 'loop' call python forever; 'ghost' calls a tool that does not exist."""
    results = TOOL_RESULT.findall(prompt)
    request = prompt.rsplit("<|start|>user<|message|>", 1)[1]
    if "ghost" in request and not results:
        return [
            Message("assistant", "{}", channel="commentary", recipient="functions.ghost", content_type="json")
        ]
    if results and "loop" not in request:
        return [Message("assistant", f"The result is \\boxed{{{results[-1][1].strip()}}}.", channel="final")]
    a, b = re.findall(r"\d+", request)[:2]
    code = json.dumps({"code": f"print({a} * {b})"})
    return [
        Message("assistant", "I will compute it.", channel="analysis"),
        Message("assistant", code, channel="commentary", recipient="functions.python", content_type="json"),
    ]


@pytest.fixture(scope="module")
def endpoint():
    with BackgroundServer(create_app(ScriptedEngine(FMT, calculator_policy), FMT, model_name="calc")) as srv:
        yield srv.base_url


async def test_agent_answers_with_the_real_python_tool(endpoint):
    async with Agent(envs.make("retool"), base_url=endpoint) as agent:
        streamed: list[str] = []
        result = await agent.run("What is 123 times 456?", on_text=streamed.append)
    assert result.stop_reason == "answer"
    assert result.answer == "The result is \\boxed{56088}."
    assert [(r.name, r.arguments, r.result, r.error) for r in result.tool_calls] == [
        ("python", {"code": "print(123 * 456)"}, "56088", None)
    ]
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert result.messages[2]["tool_calls"][0]["function"]["name"] == "python"
    assert result.messages[3]["content"] == "56088"
    assert "".join(streamed) == result.answer and len(streamed) > 3
    assert result.requests == 2 and result.usage["completion_tokens"] > 0
    traj = result.trajectory
    traj.validate()
    assert traj.terminated and traj.api == "chat" and result.reward is None


async def test_agent_stream_events_and_scored_task(endpoint):
    async with Agent(envs.make("retool"), base_url=endpoint) as agent:
        events = [e async for e in agent.stream("Compute 7 times 6 please")]
        assert isinstance(events[0], ToolEvent) and events[0].record.result == "42"
        assert isinstance(events[-1], Done) and events[-1].result.answer.endswith("\\boxed{42}.")
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == events[-1].result.answer
        scored = await agent.run_task({"id": 1, "prompt": "What is 7 times 6?", "answer": "42"})
        wrong = await agent.run_task({"id": 2, "prompt": "What is 7 times 6?", "answer": "41"})
    assert (scored.reward, wrong.reward) == (1.0, 0.0)


async def test_agent_limits_and_error_taxonomy(endpoint):
    async with Agent(envs.make("retool"), base_url=endpoint, max_tool_calls=2) as agent:
        looped = await agent.run("Keep going in a loop: 2 times 3")
        ghost = await agent.run("Ask the ghost about 1 and 2")
    assert looped.stop_reason == "tool_limit" and len(looped.tool_calls) == 2
    assert looped.answer is None
    assert ghost.tool_calls[0].error == "unknown_tool" and "no tool named" in ghost.tool_calls[0].result
    assert ghost.messages[3]["role"] == "tool"  # the rejected call is still answered


async def test_agent_time_limit():
    slow = ScriptedEngine(FMT, calculator_policy, delay_s=2.0)
    with BackgroundServer(create_app(slow, FMT)) as srv:
        async with Agent(envs.make("retool"), base_url=srv.base_url, time_limit_s=0.3) as agent:
            result = await agent.run("What is 3 times 3?")
    assert result.stop_reason == "time_limit" and result.answer is None and result.requests == 0


def test_runtime_eval_viewer_import_without_torch():
    check_imports_without_torch(["agentrl.runtime", "agentrl.evaluation", "agentrl.evaluation.cli", "agentrl.viewer",
                                 "agentrl.engines.client", "agentrl.engines.server"])


def test_product_agent_example_runs_against_an_endpoint(endpoint):
    """examples/product_agent.py as a user runs it: a subprocess configured by OPENAI_BASE_URL."""
    import os
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "product_agent.py"
    env = {**os.environ, "OPENAI_BASE_URL": endpoint}
    out = subprocess.run(
        [sys.executable, str(example), "What is 12 times 12?"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "The result is \\boxed{144}."
    assert lines[1] == "[tool python] {'code': 'print(12 * 12)'} -> '144' (ok)"
    assert lines[2].startswith("[answer: 2 model requests")


async def test_parallel_tool_calls_from_a_chat_api():
    """A chat API that returns two tool calls in one reply (as OpenAI models do): each becomes an env step,
    both are answered by id in order, and the next request carries both results."""
    from fastapi import FastAPI

    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        seen.append(body["messages"])
        if len(seen) == 1:
            calls = [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "python", "arguments": json.dumps({"code": f"print({i} * 10)"})},
                }
                for i in (1, 2)
            ]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            return {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}], "usage": {}}
        results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        message = {"role": "assistant", "content": f"\\boxed{{{'+'.join(results)}}}"}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": {}}

    with BackgroundServer(app) as srv:
        async with Agent(envs.make("retool"), base_url=srv.base_url, model="m") as agent:
            result = await agent.run("Add up some numbers.")
    assert [r.result for r in result.tool_calls] == ["10", "20"]
    tool_msgs = [m for m in seen[1] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_msgs] == [("c1", "10"), ("c2", "20")]
    assert result.answer == "\\boxed{10+20}" and result.stop_reason == "answer"
    assert result.trajectory.num_turns == 3  # one env step per call, then the answer


async def test_reply_cut_by_length_is_recorded_as_truncation():
    from fastapi import FastAPI

    from agentrl.evaluation.metrics import episode_stats

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        message = {"role": "assistant", "content": "The answer is \\boxed{4"}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "length"}], "usage": {}}

    with BackgroundServer(app) as srv:
        async with Agent(envs.make("gsm8k"), base_url=srv.base_url, model="m") as agent:
            result = await agent.run_task({"id": 0, "prompt": "2 + 2?", "answer": "4"})
    assert result.stop_reason == "token_limit" and result.answer is None and result.reward == 0.0
    assert result.trajectory.truncated and not result.trajectory.terminated
    assert episode_stats(result.trajectory)["errors"] == {"truncation": 1}  # counted once
