"""A new tool and a new env in a few lines, run for one episode with a scripted Harmony policy."""

import json

from agentrl.envs import AgentEnv, Rubric, tool
from agentrl.envs.rewards import ExactMatch
from agentrl.harmony.types import Message


@tool
def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


class WordCountEnv(AgentEnv):
    instructions = "Use word_count, then answer with the number only."
    rubric = Rubric([ExactMatch()])

    def make_tools(self):
        return [word_count]

    @classmethod
    def generate_task(cls, rng, split="train"):
        words = " ".join(rng.choice(["red", "green", "blue", "cyan"], size=int(rng.integers(3, 9))))
        return {"prompt": f"How many words are in: {words}", "answer": str(len(words.split())), "text": words}


env = WordCountEnv()
obs, info = env.reset(seed=0)
say = env.format.render_completion  # the scripted policy emits real Harmony tokens
args = json.dumps({"text": info["task"]["text"]})
obs, *_ = env.step(say([Message("assistant", args, channel="commentary", recipient="functions.word_count")]))
answer = Message("assistant", obs["messages"][0].content, channel="final")
obs, reward, terminated, truncated, info = env.step(say([answer]))
print(f"reward={reward} terminated={terminated} turns={info['trajectory'].num_turns}")
env.close()
