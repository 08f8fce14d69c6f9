"""Real-client check on a real model: ``agentrl serve model``'s app over the transformers engine with a
tiny random GPT-OSS (Harmony, 201,088-token vocabulary), called over HTTP by our client and by the
official openai SDK. The log-probs that come back are checked against a teacher-forced forward pass."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentrl.engines.base import SamplingParams  # noqa: E402
from agentrl.engines.client import OpenAIEngine  # noqa: E402
from agentrl.engines.server import BackgroundServer, create_app, load_local_engine  # noqa: E402
from agentrl.engines.server.serve_cli import main  # noqa: E402
from agentrl.harmony import Message  # noqa: E402


@pytest.fixture(scope="module")
def served():
    engine, fmt, name = load_local_engine("tiny-gpt-oss", seed=0)
    with BackgroundServer(create_app(engine, fmt, model_name=name)) as srv:
        yield srv, engine, fmt


async def test_completions_token_ids_and_logprobs_match_the_model(served):
    srv, engine, fmt = served
    prompt = fmt.render_prompt([Message("user", "Say hi.")])
    async with OpenAIEngine(base_url=srv.base_url) as client:
        (c,) = await client.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7))
        (again,) = await client.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7))
    assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= 6
    assert c.finish_reason in ("stop", "length")
    assert again.token_ids == c.token_ids  # same seed, same sample
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (c.logprobs, expected.tolist())


def test_official_sdk_chat_with_tools_on_the_model(served):
    openai = pytest.importorskip("openai")
    srv, _, _ = served
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused")
    try:
        out = client.chat.completions.create(
            model="tiny-gpt-oss",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather",
                        "parameters": {"type": "object", "properties": {}},
                    },
                }
            ],
            max_tokens=5,
            seed=1,
        )
    finally:
        client.close()
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.completion_tokens <= 5 and out.usage.prompt_tokens > 50  # tools rendered into the prompt
    assert choice.message.role == "assistant"


def test_serve_model_cli_needs_a_model(capsys):
    assert main(["--help"]) == 0 and "agentrl serve model" in capsys.readouterr().out
    assert main(["port=1"]) == 2 and "model is required" in capsys.readouterr().err
