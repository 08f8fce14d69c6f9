"""Give the C allocator's free memory back to the operating system between the trainer's phases.

torch's CPU tensors come from glibc's malloc. A phase frees most of what it allocated (SFT and update
activations, the KV cache of a rollout or an evaluation), but malloc keeps freed chunks below its mmap threshold
(which grows to 32 MB as large tensors are freed) in its arenas, and each thread that allocates gets an arena of
its own (the engine samples on worker threads, SFT and the update run on the main one). So each phase's garbage
stays resident beside the next phase's live tensors: after the SFT stage of the retool main job malloc held
3.3 GB of which 0.7 GB were in use (``benchmarks/memory_phases.py``). :func:`release_free_memory` calls
``malloc_trim(0)``, which returns every arena's free pages to the kernel; it changes no tensor, so results are
unchanged. Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_free_memory() -> bool:
    """Return the allocator's free memory to the OS (glibc ``malloc_trim(0)``); False where unsupported."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
