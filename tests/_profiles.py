"""Hypothesis profiles for the whole suite, loaded by ``tests/conftest.py``.

- ``ci`` (the default): 50 examples per property, derandomized, no deadline, no example database, so a run
  draws the same examples on every machine and never fails on a slow one;
- ``nightly``: ``NIGHTLY_FACTOR`` times the examples, drawn at random (``HYPOTHESIS_PROFILE=nightly``).

A property whose examples are costly (a model update each, a GGUF tokenizer) states its count on the 2-core CI
box with ``@settings(max_examples=examples(n))``; the nightly profile scales that count like the default one.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

NIGHTLY_FACTOR = 40
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def load() -> None:
    """Register both profiles and load the one ``HYPOTHESIS_PROFILE`` names (``ci`` when unset)."""
    common = {"deadline": None, "database": None, "suppress_health_check": _HEALTH}
    settings.register_profile("ci", max_examples=50, derandomize=True, **common)
    settings.register_profile("nightly", max_examples=50 * NIGHTLY_FACTOR, derandomize=False, **common)
    settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile, ``NIGHTLY_FACTOR * n`` under ``nightly``."""
    return n * NIGHTLY_FACTOR if PROFILE == "nightly" else n
