"""A product agent in a few lines: the retool env's python tool (the same code the model trained with)
answering one user request against any served chat model, with streaming and limits.

    agentrl serve model model=PATH port=8000 &        # or vLLM / SGLang / a hosted API
    export OPENAI_BASE_URL=http://127.0.0.1:8000/v1   # and OPENAI_API_KEY / OPENAI_MODEL if needed
    python examples/product_agent.py "What is the sum of the primes below 1000?"
"""

from __future__ import annotations

import asyncio
import sys

import agentrl
from agentrl.runtime import Agent


async def answer(question: str) -> int:
    async with Agent(agentrl.make("retool"), max_tool_calls=6, time_limit_s=60) as agent:
        result = await agent.run(question, on_text=lambda text: print(text, end="", flush=True))
    print()
    for call in result.tool_calls:
        print(f"[tool {call.name}] {call.arguments} -> {call.result[:80]!r} ({call.error or 'ok'})")
    print(f"[{result.stop_reason}: {result.requests} model requests, {result.latency_s:.2f} s]")
    return 0 if result.stop_reason == "answer" else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(answer(" ".join(sys.argv[1:]) or "What is 2**100 mod 7?")))
