"""Code sandboxes for running model-written code: a protocol (:mod:`.base`) and backends.

``make_backend("local")`` gives the isolated local worker pool (bubblewrap, Linux); ``"sandboxfusion"`` a
client of a SandboxFusion-compatible HTTP server (including ``agentrl serve sandbox``); ``"e2b"`` E2B cloud
sandboxes. Importing this package is cheap: backends load only when built.
"""

from agentrl.envs.sandbox.base import (
    STATUSES,
    ExecResult,
    SandboxBackend,
    SandboxError,
    SandboxUnavailable,
    SyncSandbox,
    make_backend,
)

__all__ = [
    "STATUSES",
    "ExecResult",
    "SandboxBackend",
    "SandboxError",
    "SandboxUnavailable",
    "SyncSandbox",
    "make_backend",
]
