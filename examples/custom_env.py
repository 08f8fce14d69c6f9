"""A new tool and a new env in a few lines, with a scripted teacher for its SFT cold start.

    .venv/bin/python examples/custom_env.py                      # one episode driven by the scripted teacher
    .venv/bin/agentrl sft env=examples/custom_env.py:WordCountEnv steps=4 num_demos=8   # SFT on its demonstrations
    .venv/bin/agentrl train env=examples/custom_env.py:WordCountEnv                     # SFT cold start, then RL

A small model rarely calls a tool it has never seen called, so RL alone gets no reward to learn from. A
scripted teacher (``AgentEnv.scripted_teacher``) writes demonstrations through the env, token-exact in the
student's own format; ``agentrl sft`` and the SFT stage of ``agentrl train`` learn from the correct ones.
"""

import asyncio
import json

from agentrl.envs import AgentEnv, Rubric, TeacherError, tool
from agentrl.envs.rewards import ExactMatch
from agentrl.harmony.types import Message


@tool
def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


class WordCountTeacher:
    """The scripted policy (an ``agentrl.episodes.Policy``): call word_count on the task's text, then answer
    with the tool's output. Stateless, so one instance serves concurrent episodes."""

    name = "scripted"

    async def act(self, episode):
        env, task = episode.env, episode.task
        results = [record.result for step in episode.steps for record in step.turn.tools]
        if not results:  # turn 1: the tool call, written the way the student's format writes one
            if "text" not in task:
                raise TeacherError(f"task {task.get('id')!r} has no 'text'; the scripted teacher needs generated tasks")
            message = Message("assistant", json.dumps({"text": task["text"]}), channel="commentary",
                              recipient="functions.word_count", content_type="json")
        else:  # turn 2: the final answer, read from the env's record of the tool's result
            message = Message("assistant", results[-1].strip(), channel="final")
        return [list(env.format.render_completion([message]))]


class WordCountEnv(AgentEnv):
    instructions = "Use word_count, then answer with the number only."
    rubric = Rubric([ExactMatch()])

    def make_tools(self):
        return [word_count]

    @classmethod
    def generate_task(cls, rng, split="train"):
        words = " ".join(rng.choice(["red", "green", "blue", "cyan"], size=int(rng.integers(3, 9))))
        return {"prompt": f"How many words are in: {words}", "answer": str(len(words.split())), "text": words}

    @classmethod
    def scripted_teacher(cls):
        return WordCountTeacher()


async def _demo() -> None:
    from agentrl.episodes import run_episode

    env = WordCountEnv()
    result = await run_episode(env, WordCountTeacher(), seed=0)
    traj = result.trajectory
    print(f"reward={traj.reward} stop={result.stop_reason} turns={traj.num_turns}")
    await env.aclose()


if __name__ == "__main__":
    asyncio.run(_demo())
