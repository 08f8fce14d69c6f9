"""What ``backend="auto"`` does when a kernel fails to compile or launch: fall back, warn once, remember.

A Triton kernel compiles per *shape class* (dtype, head geometry, mask flags, tile configuration, and
which integer arguments are multiples of 16), so a run can meet a new class, and a compiler failure,
long after it started. Under ``auto`` such a failure must not end the run: the caller computes the call
with the next backend instead, :func:`fall_back` emits one :class:`KernelFallbackWarning` naming the
kernel, the shape class and the exception, and remembers the pair in :data:`FAILED`, so later calls of
that class go straight to the fallback (:func:`failed`) instead of compiling again.

What counts (:func:`is_compile_failure`): Triton's own errors (``triton.errors.TritonError``:
``CompilationError``, ``OutOfResources``, ``PTXASError``, ... in Triton 3.x), CUTLASS DSL errors (FA4),
and ``RuntimeError`` from compiler passes (``PassManager::run failed``) and the launcher. Not a CUDA
out-of-memory error (``torch.cuda.OutOfMemoryError``, a ``RuntimeError``), nor a :class:`KernelSetupError`,
nor ``ValueError``/``TypeError`` from checking the inputs: those still raise. An explicitly named backend
always raises.
"""

from __future__ import annotations

import warnings

import torch


class KernelSetupError(RuntimeError):
    """The kernels cannot run in this process at all (Triton missing, ``TRITON_INTERPRET`` set too late): a
    setup problem to fix, raised under ``auto`` too, not a compile failure to fall back from."""


class KernelFallbackWarning(RuntimeWarning):
    """A kernel failed to compile or launch for a shape class; another backend computes it from now on."""


#: ``(kernel, shape class)`` -> the fallback that computes it, for every failure seen in this process.
FAILED: dict[tuple, str] = {}


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a kernel compile/launch failure that ``auto`` may fall back from."""
    if isinstance(exc, (torch.cuda.OutOfMemoryError, KernelSetupError)):
        return False
    if isinstance(exc, RuntimeError):
        return True
    return (type(exc).__module__ or "").split(".")[0] in ("triton", "cutlass")


def failed(kernel: str, shape_class: tuple) -> bool:
    """Whether ``kernel`` already failed for ``shape_class`` (then skip it)."""
    return (kernel, shape_class) in FAILED


def fall_back(kernel: str, shape_class: tuple, exc: BaseException, fallback: str) -> None:
    """Record that ``kernel`` failed for ``shape_class`` with ``exc`` and that ``fallback`` computes it
    from now on; warns the first time per ``(kernel, shape_class)``."""
    if (kernel, shape_class) in FAILED:
        return
    FAILED[(kernel, shape_class)] = fallback
    lines = str(exc).strip().splitlines()
    first = lines[0][:300] if lines else ""
    warnings.warn(
        f"{kernel} failed to compile or launch for shape class {shape_class} ({type(exc).__name__}: {first}); "
        f"computing it with {fallback} from now on (slower, same function)",
        KernelFallbackWarning, stacklevel=3)
