"""Gymnasium spaces for language-model envs: token ids, arbitrary unicode text, and parsed messages.

``gymnasium.spaces.Text`` only accepts its charset (alphanumerics by default), so it cannot hold model
text. These spaces accept any value of the right Python type and sample random but valid values, which is
what ``gymnasium.utils.env_checker.check_env`` needs.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np
from gymnasium import spaces

from agentrl.harmony.types import Message


def token_ids_space(vocab_size: int, seed: int | None = None) -> spaces.Sequence:
    """Variable-length token ids in ``[0, vocab_size)``, as a 1-D ``np.int64`` array."""
    return spaces.Sequence(spaces.Discrete(vocab_size), stack=True, seed=seed)


class CompletionSpace(spaces.Sequence):
    """The action space of an :class:`~agentrl.envs.AgentEnv`: completions as token ids
    (``Sequence(Discrete(vocab_size), stack=True)``). Any id sequence is a member; :meth:`sample` draws a
    *finished* completion (random ids, then one of ``stop_token_ids``), since one that stops without a
    stop token is a cut-off action that truncates the episode."""

    def __init__(self, vocab_size: int, stop_token_ids: SequenceABC[int], seed: int | None = None) -> None:
        super().__init__(spaces.Discrete(vocab_size), stack=True, seed=seed)
        self.stop_token_ids = [int(t) for t in stop_token_ids]

    def sample(self, mask: Any = None, probability: Any = None) -> np.ndarray:
        ids = super().sample(mask=mask, probability=probability)
        if not self.stop_token_ids:
            return ids
        stop = self.stop_token_ids[int(self.np_random.integers(len(self.stop_token_ids)))]
        return np.append(np.asarray(ids, dtype=np.int64), np.int64(stop))


class UnicodeText(spaces.Space[str]):
    """Any Python ``str`` of at most ``max_length`` characters (any unicode, including newlines)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None) -> None:
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(0, min(self.max_length, 32) + 1))
        # Printable code points from several scripts, avoiding surrogates.
        points = self.np_random.integers(0x20, 0xD7FF, size=n)
        return "".join(chr(int(p)) for p in points)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, UnicodeText) and other.max_length == self.max_length


class MessageTuple(spaces.Space[tuple]):
    """A tuple of :class:`~agentrl.harmony.types.Message` (the parsed messages of an observation)."""

    _ROLES = ("user", "tool")

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> tuple[Message, ...]:
        text = UnicodeText(64)
        text.np_random = self.np_random
        n = int(self.np_random.integers(0, 3))
        return tuple(
            Message(role=self._ROLES[int(self.np_random.integers(0, 2))], content=text.sample())
            for _ in range(n)
        )

    def contains(self, x: Any) -> bool:
        return isinstance(x, tuple) and all(isinstance(m, Message) for m in x)

    def __repr__(self) -> str:
        return "MessageTuple()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessageTuple)


def observation_space(vocab_size: int) -> spaces.Dict:
    """The observation space of every :class:`~agentrl.envs.AgentEnv`.

    ``{"tokens": int64 array of ids to append, "messages": tuple of the Messages those ids render}``.
    """
    return spaces.Dict({"tokens": token_ids_space(vocab_size), "messages": MessageTuple()})


def as_token_array(ids: SequenceABC[int]) -> np.ndarray:
    """A fresh 1-D ``np.int64`` array (never a view of env state)."""
    return np.array(list(ids), dtype=np.int64)
