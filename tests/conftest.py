"""Session-wide test setup: the Triton interpreter, hypothesis profiles, the test tiers and budget guard.

On machines without an NVIDIA GPU, the Triton kernels of ``agentrl.kernels`` are tested under
Triton's CPU interpreter. ``TRITON_INTERPRET=1`` only takes effect if it is set before the process
first imports triton (triton decorates its own library at import time), and other test modules
import triton indirectly (verl, transformers' GPT-OSS), so it is set here, before collection.
It changes nothing for code that does not launch Triton kernels. torch is not imported here.

Tiers and the budget guard: ``tests/_tiers.py``, loaded here as a plugin.

Hypothesis profiles (``ci``, the default, and ``nightly``): ``tests/_profiles.py``, loaded here.
"""

import os

import _profiles

pytest_plugins = ["_tiers"]

if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

_profiles.load()
