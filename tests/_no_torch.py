"""The one import-without-torch check: the core SDK (``agentrl.harmony``, ``agentrl.envs`` and what product agents
use) must import, and work, in a process where torch and the other training packages cannot be imported.

``check_imports_without_torch(modules, code)`` runs one child Python that makes ``HEAVY`` (and ``also_blocked``)
unimportable, imports ``modules``, runs ``code``, and fails the calling test, with the child's traceback, if any
of it fails or anything even tried to import a ``HEAVY`` package (code that catches the ImportError and goes on
still counts: it would have imported torch where torch is installed).
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "triton", "verl")

_CHILD = """
import importlib.abc, sys
HEAVY, ALSO = {heavy!r}, {also!r}
tried = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split('.')[0]
        if top in HEAVY or top in ALSO:
            if top in HEAVY:
                tried.append(name)
            raise ImportError(f'{{name}} is blocked in this test')
        return None
sys.meta_path.insert(0, Block())
{imports}
{code}
assert not tried, f'tried to import {{sorted(set(tried))}}'
print('ok')
"""


def check_imports_without_torch(modules: list[str], code: str = "", also_blocked: tuple[str, ...] = (),
                                cwd: str | None = None) -> None:
    """Import ``modules`` and run ``code`` in a child process without ``HEAVY`` (see the module docstring)."""
    imports = "".join(f"import {m}\n" for m in modules)
    child = _CHILD.format(heavy=HEAVY, also=also_blocked, imports=imports, code=code)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]
