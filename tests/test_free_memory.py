"""agentrl.train.free_memory: freed heap memory that malloc keeps goes back to the OS."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from agentrl.train.free_memory import release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(platform.system() != "Linux" or "libc" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc's malloc_trim")
def test_freed_chunks_below_a_live_one_are_returned():
    chunks = [bytearray(100_000) for _ in range(3000)]  # 300 MB of heap chunks (below the mmap threshold)
    for chunk in chunks:
        chunk[::4096] = b"\x01" * len(chunk[::4096])  # touch every page
    keeper = bytearray(100_000)  # live above them: free() alone cannot shrink the heap
    del chunks
    before = _rss_mb()
    assert release_free_memory()
    after = _rss_mb()
    assert before - after > 150, (before, after)
    del keeper
