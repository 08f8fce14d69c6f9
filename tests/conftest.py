"""Session-wide test setup.

On machines without an NVIDIA GPU, the Triton kernels of ``agentrl.kernels`` are tested under
Triton's CPU interpreter. ``TRITON_INTERPRET=1`` only takes effect if it is set before the process
first imports triton (triton decorates its own library at import time), and other test modules
import triton indirectly (verl, transformers' GPT-OSS), so it is set here, before collection.
It changes nothing for code that does not launch Triton kernels. torch is not imported here.
"""

import os

if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
