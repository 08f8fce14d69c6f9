"""Real-client check: our OpenAI-compatible server (uvicorn, real HTTP) and two real clients of it,
ours (httpx) and the official ``openai`` SDK. The model behind the server is a deterministic scripted
engine, so every token id that comes back is known exactly."""

from __future__ import annotations

import asyncio
import json

import pytest
from _scripted_engine import ScriptedEngine

from agentrl.engines.base import SamplingParams
from agentrl.engines.client import ChatClient, ChatResult, Endpoint, EndpointError, OpenAIEngine
from agentrl.engines.server import BackgroundServer, create_app
from agentrl.harmony import HarmonyFormat, Message

FMT = HarmonyFormat()


def weather_policy(prompt: str, sampling: SamplingParams) -> list[Message]:
    """Call the weather tool once, then answer with what it returned."""
    if "functions.get_weather to=assistant" in prompt:
        result = (
            prompt.rsplit("functions.get_weather to=assistant", 1)[1]
            .split("<|message|>", 1)[1]
            .split("<|end|>")[0]
        )
        return [Message("assistant", f"Weather report: {result}", channel="final")]
    return [
        Message("assistant", "I should call the tool.", channel="analysis"),
        Message("assistant", '{"city": "Paris"}', channel="commentary", recipient="functions.get_weather",
                content_type="json"),
    ]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server():
    engine = ScriptedEngine(FMT, weather_policy)
    with BackgroundServer(create_app(engine, FMT, model_name="scripted-weather")) as srv:
        yield srv


async def test_completions_token_ids_and_logprobs(server):
    prompts = [FMT.render_prompt([Message("user", f"Weather in city {i}?")]) for i in range(3)]
    expected = FMT.render_completion(weather_policy("", SamplingParams()))
    async with OpenAIEngine(base_url=server.base_url) as engine:
        comps = await engine.generate(
            prompts, SamplingParams(max_new_tokens=256, stop_token_ids=FMT.stop_token_ids)
        )
        assert await engine.endpoint.model() == "scripted-weather"
        assert [c.token_ids for c in comps] == [expected] * 3
        assert all(c.logprobs == [0.0] * len(expected) and c.finish_reason == "stop" for c in comps)
        short = await engine.generate(prompts[:1], SamplingParams(max_new_tokens=5))
        assert short[0].token_ids == expected[:5] and short[0].finish_reason == "length"


def test_official_openai_sdk_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    try:
        prompt = FMT.render_prompt([Message("user", "Weather?")])
        out = client.completions.create(
            model="scripted-weather",
            prompt=prompt,
            max_tokens=64,
            logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        )
        choice = out.choices[0]
        ids = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
        assert ids == FMT.render_completion(weather_policy("", SamplingParams()))
        assert choice.text == FMT.decode(ids)
        chat = client.chat.completions.create(
            model="scripted-weather", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS
        )
        call = chat.choices[0].message.tool_calls[0]
        assert chat.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
    finally:
        client.close()


async def test_chat_tool_round_trip_and_streaming(server):
    async with ChatClient(base_url=server.base_url) as chat:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = await chat.chat(messages, TOOLS, max_tokens=256)
        assert first.finish_reason == "tool_calls"
        assert first.message["reasoning_content"] == "I should call the tool."
        (call,) = first.tool_calls
        assert call["function"]["name"] == "get_weather"
        messages += [first.message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
        second = await chat.chat(messages, TOOLS)
        assert second.finish_reason == "stop" and second.content == "Weather report: sunny, 21 C"
        pieces = [p async for p in chat.stream_chat(messages, TOOLS)]
        deltas, final = pieces[:-1], pieces[-1]
        assert isinstance(final, ChatResult) and final.content == "Weather report: sunny, 21 C"
        assert len(deltas) > 2 and "".join(deltas) == final.content
        assert final.usage["completion_tokens"] > 0


async def test_bad_requests_are_clear_errors_and_not_retried(server):
    async with Endpoint(server.base_url, max_retries=3, backoff_s=0.01) as ep:
        with pytest.raises(EndpointError, match="outside the vocabulary") as info:
            await ep.request("POST", "completions", {"model": "m", "prompt": [10**9]})
        assert info.value.status == 400 and ep.retries_done == 0
        with pytest.raises(EndpointError, match="unknown tool_call_id"):
            await ep.request(
                "POST",
                "chat/completions",
                {"messages": [{"role": "tool", "tool_call_id": "x", "content": "?"}]},
            )


async def test_retries_with_backoff_then_success():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), {"n": 0}

    @app.post("/v1/completions")
    async def flaky():
        calls["n"] += 1
        if calls["n"] <= 2:
            return JSONResponse(
                {"error": {"message": "overloaded"}}, status_code=503, headers={"retry-after": "0"}
            )
        return {
            "choices": [
                {
                    "text": "",
                    "token_ids": [5, 6],
                    "logprobs": {"token_logprobs": [-0.5, -1.0]},
                    "finish_reason": "length",
                }
            ]
        }

    with BackgroundServer(app) as srv:
        async with OpenAIEngine(base_url=srv.base_url, model="m", max_retries=3, backoff_s=0.01) as engine:
            (c,) = await engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 6], [-0.5, -1.0], "length")
            assert engine.endpoint.retries_done == 2
        calls["n"] = -10
        async with OpenAIEngine(base_url=srv.base_url, model="m", max_retries=1, backoff_s=0.01) as engine:
            with pytest.raises(EndpointError, match="after 2 attempts: HTTP 503: overloaded"):
                await engine.generate([[1]], SamplingParams())


async def test_api_key_is_enforced():
    engine = ScriptedEngine(FMT, weather_policy)
    with BackgroundServer(create_app(engine, FMT, api_key="s3cret")) as srv:
        async with Endpoint(srv.base_url, api_key="wrong", max_retries=0) as ep:
            with pytest.raises(EndpointError) as info:
                await ep.request("GET", "models")
            assert info.value.status == 401
        async with Endpoint(srv.base_url, api_key="s3cret") as ep:
            assert (await ep.request("GET", "models"))["data"][0]["id"] == "agentrl"


async def test_concurrent_requests_overlap():
    """The client sends and the server serves requests concurrently: the engine holds every request until
    all 32 are inside it at once (it would wait forever, up to the timeout, if they were serialised)."""
    from agentrl.engines.base import Completion

    state = {"now": 0, "max": 0}
    all_in = asyncio.Event()

    class Gate:
        async def generate(self, prompts, sampling):
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            if state["now"] == 32:
                all_in.set()
            await asyncio.wait_for(all_in.wait(), 60)
            state["now"] -= 1
            return [Completion([p[0]], [-0.1], "stop") for p in prompts]

    with BackgroundServer(create_app(Gate(), FMT)) as srv:
        async with OpenAIEngine(base_url=srv.base_url, max_concurrency=32, max_retries=0) as engine:
            comps = await engine.generate([[i + 1] for i in range(32)], SamplingParams(max_new_tokens=1))
    assert [c.token_ids for c in comps] == [[i + 1] for i in range(32)]
    assert state["max"] == 32
