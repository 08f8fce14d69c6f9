"""Code sandboxes for running model-written code: a protocol (:mod:`.base`) and backends.

``make_backend("local")`` gives the isolated local worker pool (bubblewrap, Linux); ``"sandboxfusion"`` a
client of a SandboxFusion-compatible HTTP server (including ``agentrl serve sandbox``); ``"e2b"`` E2B cloud
sandboxes. Importing this package is cheap: backends are registered by name and load only when built.
"""

from agentrl.envs.sandbox.base import (
    STATUSES,
    ExecResult,
    SandboxBackend,
    SandboxError,
    SandboxMessages,
    SandboxUnavailable,
    SyncSandbox,
    make_backend,
    register_backend,
    registered_backends,
)

register_backend("local", "agentrl.envs.sandbox.local:LocalSandbox")
register_backend("unsafe_local", "agentrl.envs.sandbox.local:unsafe_local")
register_backend("sandboxfusion", "agentrl.envs.sandbox.fusion:SandboxFusionBackend")
register_backend("e2b", "agentrl.envs.sandbox.e2b_backend:E2BSandbox")

__all__ = [
    "STATUSES",
    "ExecResult",
    "SandboxBackend",
    "SandboxError",
    "SandboxMessages",
    "SandboxUnavailable",
    "SyncSandbox",
    "make_backend",
    "register_backend",
    "registered_backends",
]
