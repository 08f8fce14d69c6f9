"""Activation checkpointing for one forward/backward, switched on and off around it.

A decoder layer of a transformers model keeps about 50 KB of activations per token for the backward (SmolLM2:
hidden 576, MLP 1536, fp32), so one long trajectory of a few thousand tokens holds gigabytes. With
checkpointing each layer keeps only its input (2.3 KB per token) and recomputes the rest during the
backward (about a third more compute). :func:`activation_checkpointing` turns it on for the layers that
support it (transformers' ``GradientCheckpointingLayer`` protocol: modules with a ``gradient_checkpointing``
attribute) with PyTorch's non-reentrant checkpoint, and restores their previous state afterwards, so the
caller decides per forward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.utils.checkpoint


@contextmanager
def activation_checkpointing(model: Any, enabled: bool = True) -> Iterator[bool]:
    """Within the block, ``model``'s checkpointable layers recompute their activations in the backward (run
    the forward *and* the backward inside the block). Yields whether checkpointing is on (False when not
    ``enabled`` or when the model has no such layers). The model must be in train mode for it to apply."""
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")] if enabled else []
    saved = [(m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None)) for m in layers]
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for m in layers:
        m._gradient_checkpointing_func = checkpoint
        m.gradient_checkpointing = True
    try:
        yield bool(layers)
    finally:
        for m, flag, func in saved:
            m.gradient_checkpointing = flag
            if func is None:
                del m._gradient_checkpointing_func
            else:
                m._gradient_checkpointing_func = func
