"""StatefulTool derives its JSON schema, description and name from a typed ``run`` method, as ``@tool`` does from
a function, and keeps per-episode state where a sync ``@tool``'s module-level state does not."""

from __future__ import annotations

import asyncio
from typing import Literal

from agentrl.envs import AgentEnv, StatefulTool, tool
from agentrl.envs.tools import ToolBox
from agentrl.envs.tools.dispatch import Sessions
from agentrl.harmony import HarmonyFormat
from agentrl.harmony.types import ToolCall

FMT = HarmonyFormat()


class ShoppingCart(StatefulTool):
    """A cart per episode."""

    def __init__(self) -> None:
        self.released = 0

    async def create_session(self):
        return []

    async def release_session(self, session):
        self.released += 1

    def run(self, session: list, item: str, quantity: int = 1, unit: Literal["piece", "kg"] = "piece") -> list[str]:
        """Add an item to this episode's cart; returns the cart.

        Args:
            item: what to add
            quantity: how many
            unit: how it is counted
        """
        session.extend([item] * quantity)
        return session


@tool
def add_to_cart(item: str, quantity: int = 1, unit: Literal["piece", "kg"] = "piece") -> list[str]:
    """Add an item to this episode's cart; returns the cart.

    Args:
        item: what to add
        quantity: how many
        unit: how it is counted
    """
    return [item] * quantity


class AsyncCounter(StatefulTool):
    """Count calls in this episode."""

    name = "count"
    description = "Increment the counter."

    async def create_session(self):
        return {"n": 0}

    async def release_session(self, session):
        pass

    async def run(self, session: dict, by: int = 1) -> int:
        await asyncio.sleep(0)
        session["n"] += by
        return session["n"]


class HandWritten(StatefulTool):
    name = "hand"
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}

    async def create_session(self):
        return None

    async def release_session(self, session):
        pass

    def run(self, session, x):
        return x.upper()


class Incomplete(StatefulTool):
    name = "incomplete"

    async def create_session(self):
        return None

    async def release_session(self, session):
        pass


def test_schema_description_and_name_come_from_run_like_a_tool_function():
    cart = ShoppingCart()
    assert cart.name == "shopping_cart"
    assert cart.parameters == add_to_cart.parameters  # the same schema @tool derives from the same signature
    assert cart.description == add_to_cart.description == "Add an item to this episode's cart; returns the cart."
    assert cart.parameters["required"] == ["item"] and "session" not in cart.parameters["properties"]
    counter = AsyncCounter()
    assert counter.name == "count" and counter.description == "Increment the counter."
    assert counter.parameters["properties"]["by"] == {"type": "integer", "default": 1}
    assert HandWritten.parameters["required"] == ["x"]  # set by the class: kept


def _call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(f"functions.{name}", name, arguments, "")


async def test_calls_are_validated_and_share_the_episode_session():
    cart, counter = ShoppingCart(), AsyncCounter()
    box = ToolBox([cart, counter, HandWritten(), Incomplete()])
    sessions = Sessions()
    first = await box.call(_call("shopping_cart", {"item": "tea"}), sessions)
    second = await box.call(_call("shopping_cart", {"item": "milk", "quantity": 2}), sessions)
    assert first.error is None and first.result == '["tea"]'
    assert second.result == '["tea", "milk", "milk"]'  # the session kept the first call's item
    bad = await box.call(_call("shopping_cart", {"item": "x", "unit": "litre"}), sessions)
    assert bad.error == "bad_arguments" and "unit" in bad.result
    assert (await box.call(_call("count", {"by": 2}), sessions)).result == "2"
    assert (await box.call(_call("count", {}), sessions)).result == "3"
    assert (await box.call(_call("hand", {"x": "a"}), sessions)).result == "A"
    missing = await box.call(_call("incomplete", {}), sessions)
    assert missing.error == "tool_exception" and "defines neither run(self, session, ...) nor call" in missing.result
    await sessions.release_all()
    assert cart.released == 1


COUNT = {"n": 0}


@tool
def bump() -> int:
    """Increment a module-level counter (a sync @tool: each call runs in a forked process)."""
    COUNT["n"] += 1
    return COUNT["n"]


class BumpEnv(AgentEnv):
    def make_tools(self):
        return [bump, AsyncCounter()]


def test_module_level_state_of_a_sync_tool_stays_in_its_process_but_a_session_persists():
    """The documented behaviour (docs/envs.md, "State"): use a StatefulTool for state across calls."""
    env = BumpEnv(format=FMT)
    env.reset(seed=0, options={"task": {"prompt": "go"}})
    call = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{{}}<|call|>"
    results = []
    for name in ("bump", "bump", "count", "count"):
        obs, *_ = env.step(call.format(name))
        results.append(obs["messages"][0].content)
    assert results == ["1", "1", "1", "2"] and COUNT["n"] == 0
    env.close()
