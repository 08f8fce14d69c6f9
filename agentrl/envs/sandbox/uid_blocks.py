"""Host-wide reservation of the uid ranges sandbox pools run code as, so that two pools on one host never share
a uid (root mode).

A pool takes a run of consecutive uid blocks of a high range. Each block is reserved by an exclusive ``flock`` on a
file of its own in a root-only directory (:data:`LOCK_DIR`): a lock lives as long as its open file, so a pool
that closes, exits or crashes gives its range back, and no two live pools, whatever their sizes, hold one block.
Pools in separate mount namespaces that do not share :data:`LOCK_DIR` are not covered.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

from agentrl.envs.sandbox.base import SandboxError

LOCK_DIR = Path("/run/agentrl-sandbox-uids")


class UidRange:
    """``count`` uid blocks of ``block`` uids from ``base``, held by this pool until :meth:`release`."""

    def __init__(self, base: int, count: int, fds: list[int]) -> None:
        self.base, self.count, self._fds = base, count, fds

    def release(self) -> None:
        """Give the blocks back (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        self.release()


def _lock_blocks(base: int, count: int, block: int, lock_dir: Path) -> list[int] | None:
    """Exclusive locks on blocks ``base``, ``base + block``, ...; None (and nothing held) if any is taken."""
    fds: list[int] = []
    for i in range(count):
        fd = os.open(lock_dir / f"{base + i * block}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            for held in fds:
                os.close(held)
            return None
        fds.append(fd)
    return fds


def reserve(
    first: int, size: int, count: int, block: int, base: int | None = None, lock_dir: Path = LOCK_DIR
) -> UidRange:
    """Reserve ``count`` consecutive blocks of ``block`` uids inside ``[first, first + size)``.

    ``base``: exactly this range (SandboxError if another pool holds part of it). Otherwise the first free
    slot from a random one on (slots are ``count`` blocks wide, aligned from ``first``); SandboxError if none is.
    """
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    if base is not None:
        fds = _lock_blocks(base, count, block, lock_dir)
        if fds is None:
            raise SandboxError(
                f"uid_base {base}: another sandbox pool on this host holds part of that uid range"
            )
        return UidRange(base, count, fds)
    span = count * block
    slots = size // span
    if slots < 1:
        raise SandboxError(f"a pool of {count} uid blocks does not fit the sandbox uid range")
    start = secrets.randbelow(slots)
    for i in range(slots):
        candidate = first + (start + i) % slots * span
        fds = _lock_blocks(candidate, count, block, lock_dir)
        if fds is not None:
            return UidRange(candidate, count, fds)
    raise SandboxError("every sandbox uid range of this host is held by another pool")
