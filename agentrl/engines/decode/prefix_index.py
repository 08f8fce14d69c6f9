"""Which cache slots hold a given token prefix: the lookup behind prefix sharing and turn-to-turn reuse.

Token sequences are cut into blocks of :data:`BLOCK` tokens; block ``i`` of a sequence is keyed by a hash
chained over blocks ``0 .. i`` (so equal keys mean equal prefixes, up to hash collisions, which
:meth:`PrefixIndex.best` rules out by comparing the tokens). A slot is registered with the tokens its
cache holds; :meth:`PrefixIndex.best` finds, for a new prompt, the slot sharing the longest prefix with it
and the exact length of that prefix (which may end inside a block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BLOCK = 16


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """The chained hash of each full block of ``tokens``."""
    out: list[int] = []
    h = 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[start : start + BLOCK]))
        out.append(h)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixIndex:
    """Slots by the blocks of the tokens they hold (see the module docstring)."""

    def __init__(self) -> None:
        self._slots_by_hash: dict[int, set[int]] = {}
        self._hashes_by_slot: dict[int, list[int]] = {}

    def register(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot`` now holds ``tokens`` (replacing what it was registered with)."""
        self.remove(slot)
        hashes = block_hashes(tokens)
        self._hashes_by_slot[slot] = hashes
        for h in hashes:
            self._slots_by_hash.setdefault(h, set()).add(slot)

    def remove(self, slot: int) -> None:
        for h in self._hashes_by_slot.pop(slot, []):
            holders = self._slots_by_hash.get(h)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._slots_by_hash[h]

    def clear(self) -> None:
        self._slots_by_hash.clear()
        self._hashes_by_slot.clear()

    def best(self, tokens: Sequence[int], held: Callable[[int], Sequence[int]],
             prefer: Callable[[int], tuple] | None = None) -> tuple[int | None, int]:
        """``(slot, n)``: a registered slot whose held tokens (``held(slot)``) share the longest prefix
        ``n`` with ``tokens`` (at least one full block), or ``(None, 0)``. Among slots sharing the deepest
        block, the longest exact prefix wins, then the smallest ``prefer(slot)`` (default: slot index)."""
        deepest: set[int] = set()
        for h in block_hashes(tokens):
            holders = self._slots_by_hash.get(h)
            if not holders:
                break
            deepest = holders
        best_slot, best_n, best_rank = None, 0, None
        for slot in sorted(deepest):
            n = common_prefix(tokens, held(slot))
            rank = prefer(slot) if prefer is not None else (slot,)
            if n >= BLOCK and (n > best_n or n == best_n and rank < best_rank):
                best_slot, best_n, best_rank = slot, n, rank
        return best_slot, best_n
