"""Sink attention under verl's Ulysses sequence parallelism: sinks sliced with the heads (CPU, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _torchrun import torchrun

pytest.importorskip("verl")

from agentrl.train.verl_backend.ulysses import local_heads  # noqa: E402

HERE = Path(__file__).parent


def test_local_heads_slices_in_verl_head_order():
    sinks = torch.arange(8.0, requires_grad=True)
    assert local_heads(sinks, 0, 4).tolist() == [0.0, 1.0]
    assert local_heads(sinks, 3, 4).tolist() == [6.0, 7.0]
    local_heads(sinks, 1, 2).sum().backward()  # a view: the gradient lands on this rank's heads only
    assert sinks.grad.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot be split over a Ulysses group of 3"):
        local_heads(sinks, 0, 3)


@pytest.mark.distributed
def test_ulysses_sink_attention_equals_full_sequence(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "ulysses.json"
    # KV heads 2, and 1 (fewer than ranks: repeated before the all-to-all)
    torchrun([str(HERE / "_ulysses_worker.py"), str(out), "2", "1"], cwd=HERE, timeout=240,
             env={"VERL_USE_EXTERNAL_PLUGINS": "none", "TRITON_INTERPRET": "1"})
    results = json.loads(out.read_text())
    assert sorted(results) == ["1", "2", "model"]
    # a tiny GPT-OSS on the registered kernel, inputs sliced by verl: same logits and d(sink) as without SP
    model = results.pop("model")
    assert model["logits_err"] < 1e-5
    assert model["dsink_norm"] > 0.1 and model["dsink_err"] < 1e-5
    for r in results.values():
        assert r["out_err"] < 1e-6  # each rank's sequence chunk of the full-sequence output
        assert r["dsink_norm"] > 0.1 and r["dsink_err"] < 1e-6  # per-rank d(sink) slices sum to the full one
        assert r["local_dsink_nonzero"] == 2  # rank 0 only touched its own 2 of 4 heads
