"""rollout_bench's decode limit (benchmarks/decode_limit.py, issue 31): the byte counts of a decode step, the
tokens/s limit, the slot cache it plans, the full-size ``gptoss20b`` config on the meta device, the
``rollout_20b:`` summary line, and the GPU driver's shell syntax. Fast; no GPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from _fixtures import BENCH, load_benchmark

torch = pytest.importorskip("torch")

LAYER_PARAMS_EXPERTS = 32 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880)  # gate_up, its bias, down, its bias
KV_PER_KEY = 2 * 8 * 64 * 2  # K and V, 8 heads of 64, bf16


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # rollout_bench imports decode_limit as the script does
    return load_benchmark("rollout_bench")


@pytest.fixture(scope="module")
def big():
    """GPT-OSS-20B as rollout_bench builds it, on the meta device."""
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        return load_benchmark("rollout_bench").build_model("gptoss20b", "meta", torch.bfloat16, None)
    finally:
        sys.path.remove(str(BENCH))


def test_expected_experts_and_keys_the_kernel_reads():
    lim = load_benchmark("decode_limit")
    assert lim.expected_experts(32, 4, 1) == pytest.approx(4.0)
    assert lim.expected_experts(32, 4, 8) == pytest.approx(32 * (1 - (28 / 32) ** 8))  # about 21.0
    assert lim.expected_experts(32, 4, 64) == pytest.approx(32, abs=0.01)
    assert lim.keys_read(100, None) == 100 and lim.keys_read(100, 128) == 100
    # sliding window 128: from the window's first key rounded down to a 64-key block
    assert lim.keys_read(2176, 128) == 128 and lim.keys_read(2200, 128) == 152 and lim.keys_read(191, 128) == 191
    assert lim.keys_read(192, 128) == 128


def test_kv_bytes_average_over_the_decode_steps():
    lim = load_benchmark("decode_limit")
    # two 200-token prompts, 3 new tokens: decode steps see 201 and 202 keys
    full, sliding = 201 + 202, (201 - 64) + (202 - 64)
    got = lim.kv_bytes_per_step([200, 200], 3, [None, 128], kv_heads=8, head_dim=64, elem_bytes=2)
    assert got == pytest.approx(2 * (full + sliding) * KV_PER_KEY / 2)
    assert lim.tok_s_limit(64, 2e9, 4e12) == pytest.approx(128_000)


def test_gptoss20b_builds_on_meta_with_its_parameter_count_and_limits(big):
    lim = load_benchmark("decode_limit")
    assert sum(p.numel() for p in big.parameters()) == 20_914_757_184
    assert lim.layer_windows(big) == [128, None] * 12
    w = lim.weight_bytes(big)
    assert w["experts"] == 24 * LAYER_PARAMS_EXPERTS * 2 and w["embed"] == 201088 * 2880 * 2
    assert w["dense"] + w["embed"] + w["experts"] == 20_914_757_184 * 2
    b64 = lim.step_bytes(big, 64, [2048] * 64, 256)
    mean_keys = 2048 + 128  # positions 2049 .. 2303 seen over the 255 decode steps
    sliding = sum(lim.keys_read(2049 + s, 128) for s in range(255)) / 255
    assert b64["kv"] == pytest.approx(64 * 12 * (mean_keys + sliding) * KV_PER_KEY)
    # the figures: about 6.2k tok/s at B=64 and 20k at B=256 at 4.3 TB/s, 2k context
    assert lim.tok_s_limit(64, b64["total"], 4.3e12) == pytest.approx(6200, rel=0.02)
    b256 = lim.step_bytes(big, 256, [2048] * 256, 256)
    assert lim.tok_s_limit(256, b256["total"], 4.3e12) == pytest.approx(19_900, rel=0.02)
    b8 = lim.step_bytes(big, 8, [2048] * 8, 256)
    assert b8["experts_touched"] == pytest.approx(21.0, abs=0.05)
    assert b8["engine_total"] - b8["total"] == pytest.approx(w["experts"] * (1 - b8["experts_touched"] / 32))
    # the slot cache the engine allocates at B=256: 256 slots of round_up(2048 + 256 + 1, 64) = 2368 positions
    assert lim.planned_cache_bytes(big, 256, 2048, 256) == 24 * 256 * 2368 * KV_PER_KEY
    assert lim.planned_cache_bytes(big, 8, 2048, 256) == 24 * 8 * 2368 * KV_PER_KEY


def test_lora_r16_bytes_on_the_20b_shape(bench):
    from agentrl.models.lora import LoraSpec, apply_lora

    lim = load_benchmark("decode_limit")
    model = bench.build_model("gptoss20b", "meta", torch.bfloat16, 2)  # two layers of the full shape
    apply_lora(model, LoraSpec(rank=16), seed=0)
    w = lim.weight_bytes(model)
    attention = 16 * ((2880 + 4096) * 2 + (2880 + 512) * 2)  # q, o; k, v
    experts = 32 * 16 * ((2880 + 5760) + (2880 + 2880))  # gate_up, down
    assert (w["lora_dense"], w["lora_experts"]) == (2 * attention * 2, 2 * experts * 2)  # 0.37 GB at 24 layers
    step = lim.step_bytes(model, 8, [100] * 8, 4)
    assert step["lora"] == pytest.approx(w["lora_dense"] + w["lora_experts"] * step["experts_touched"] / 32)


def test_rollout_20b_line_is_last_and_takes_decode_rates(bench):
    row = {"tok_s": 100.0, "decode_tok_s": 1500.4, "limit_tok_s": 6206.9}
    runs = {"gptoss20b_b8_ours": {**row, "decode_tok_s": 300.0},
            "gptoss20b_b64_ours": row,
            "gptoss20b_b64_ours_lora": {**row, "decode_tok_s": 1400.0},
            "gptoss20b_b256_ours": {"skipped": "slot cache 29.8 GB ...", "limit_tok_s": 19881.8}}
    text = bench.summary({"runs": runs}, float("nan"))
    assert text.splitlines()[-1] == ("rollout_20b: b8=300 b64=1500 b256=nan b64_lora=1400 b256_lora=nan "
                                     "limit_b64=6207 limit_b256=19882")
    assert not any(line.startswith("rollout_vs_hf") for line in text.splitlines())
    mixed = bench.summary({"runs": {**runs, "smollm_b64_ours": row}}, float("nan")).splitlines()
    assert mixed[-2].startswith("rollout_vs_hf:") and mixed[-1].startswith("rollout_20b:")


def test_prompt_lengths_flag(bench):
    assert bench.prompt_range("2048") == (2048, 2048) and bench.prompt_range("200-300") == (200, 300)
    with pytest.raises(ValueError):
        bench.prompt_range("300-200")
    prompts = bench.prompts_for(3, 1000, seed=0, lengths=(2048, 2048))
    assert [len(p) for p in prompts] == [2048] * 3


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_driver_parses():
    assert subprocess.run(["bash", "-n", str(BENCH / "rollout_20b_gpu.sh")]).returncode == 0
