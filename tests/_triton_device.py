"""Import first in a Triton-kernel test module: skips the module without torch or triton, and without CUDA sets
``TRITON_INTERPRET=1`` before triton is first imported (triton decorates its own library at import time; a CI that
imports triton earlier in the session should export ``TRITON_INTERPRET=1`` itself). ``CUDA``: a GPU is present;
``DEV``: the device the tests put their tensors on."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
DEV = "cuda" if CUDA else "cpu"
