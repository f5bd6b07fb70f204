"""Per-device memory: a hand calculation for LLaMA-13B.

Hand calculation (P = 13,015,864,320 parameters, see test_costmodel_llama):
* training state, 8 GPUs as tp=8, pp=1, dp=1, no ZeRO: (2 + 2 + 12) bytes * P / 8
  = 26,031,728,640 bytes = 26.03 GB;
* ZeRO-3 over dp=256 (tp=pp=1): 16 * P / 256 bytes = 0.8135 GB;
* activations, s=1536, b=1, t=8, selective recompute with sequence parallelism:
  40 layers * 1536 * 5120 * 34 / 8 bytes = 1,336,934,400 bytes = 1.3369 GB;
* KV per token: 2 (K and V) * 40 layers * 5120 * 2 bytes = 819,200 bytes.
"""
from __future__ import annotations

import pytest

from harness.costmodel import (
    activation_gb,
    kv_cache_gb,
    max_stage_params,
    training_state_gb,
    weights_gb,
)

from costmodel_testdata import LLAMA

P13 = 13_015_864_320
PER_LAYER_13 = 317_204_480
REL = 1e-6


def test_training_state_13b_tp8():
    assert training_state_gb(LLAMA["13b"], dp=1, tp=8, pp=1, zero_stage=0) == pytest.approx(
        16 * P13 / 8 / 1e9, rel=REL)
    assert 16 * P13 / 8 / 1e9 == pytest.approx(26.03, abs=0.01)


@pytest.mark.parametrize(
    "zero_stage, bytes_per_param",
    [(0, 16), (1, 2 + 2 + 12 / 256), (2, 2 + (2 + 12) / 256), (3, 16 / 256)],
)
def test_training_state_13b_zero_stages_dp256(zero_stage, bytes_per_param):
    got = training_state_gb(LLAMA["13b"], dp=256, tp=1, pp=1, zero_stage=zero_stage)
    assert got == pytest.approx(bytes_per_param * P13 / 1e9, rel=REL)


@pytest.mark.parametrize("dp, zero_stage, weight_bytes, grad_gb", [
    (1, 3, 2, 1.0),  # one GPU: all 26 GB of bf16 gradients would exceed one 5e8-element bucket
    (4, 2, 2, 1.0),  # ZeRO-2 over 4: 6.5 GB of gradient shard, still one bucket on the device
    (64, 3, 2 / 64, 2 * P13 / 64 / 1e9),  # a shard smaller than a bucket stays whole
])
def test_optimizer_offload_keeps_weights_and_one_gradient_bucket(dp, zero_stage, weight_bytes, grad_gb):
    """ZeRO-Offload (Ren et al. ATC'21, section 4): Adam states and gradients live on the host; the
    device keeps its bf16 weights (sharded under ZeRO-3) and at most one reduce bucket."""
    got = training_state_gb(LLAMA["13b"], dp=dp, tp=1, pp=1, zero_stage=zero_stage, optimizer_offload=True)
    assert got == pytest.approx(weight_bytes * P13 / 1e9 + grad_gb, rel=REL)
    assert got < training_state_gb(LLAMA["13b"], dp=dp, tp=1, pp=1, zero_stage=zero_stage)


def test_pipeline_stage_takes_the_heavier_end():
    m = LLAMA["13b"]
    # last stage: 20 layers + final norm + LM head (one h more than the embedding stage)
    last = 20 * PER_LAYER_13 + 5120 + 32000 * 5120
    assert max_stage_params(m, pp=2) == pytest.approx(last, rel=REL)
    assert weights_gb(m, tp=4, pp=2) == pytest.approx(2 * last / 4 / 1e9, rel=REL)
    assert weights_gb(m, tp=8) == pytest.approx(2 * P13 / 8 / 1e9, rel=REL)


def test_activations_13b_korthikanti():
    m = LLAMA["13b"]
    s, h = 1536, 5120
    assert activation_gb(m, 1, s, tp=8, recompute="selective") == pytest.approx(
        40 * s * h * 34 / 8 / 1e9, rel=REL)
    assert 40 * s * h * 34 / 8 == 1_336_934_400
    none = s * h * (10 + 24 / 8 + 5 * 40 * s / (h * 8))
    assert activation_gb(m, 1, s, tp=8, recompute="none") == pytest.approx(
        40 * none / 1e9, rel=REL)
    # a fused (FlashAttention-style) attention never holds the a s^2 scores (Dao et al. 2022)
    assert activation_gb(m, 1, s, tp=8, recompute="none", fused_attention=True) == pytest.approx(
        40 * s * h * (10 + 24 / 8) / 1e9, rel=REL)
    assert activation_gb(m, 1, s, tp=8, recompute="selective", fused_attention=True) == \
        activation_gb(m, 1, s, tp=8, recompute="selective")
    assert activation_gb(m, 2, s, tp=8, num_layers=10, recompute="full") == pytest.approx(
        10 * 2 * s * 2 * h / 1e9, rel=REL)
    with_logits = activation_gb(m, 1, s, tp=8, num_layers=0, include_logits=True)
    assert with_logits == pytest.approx(4 * s * 32000 / 8 / 1e9, rel=REL)
    with pytest.raises(ValueError, match="recompute"):
        activation_gb(m, 1, s, recompute="some")


def test_kv_cache():
    assert kv_cache_gb(LLAMA["13b"], 1000, tp=2, pp=2) == pytest.approx(
        819_200 * 1000 / 4 / 1e9, rel=REL)
    # 8 KV heads cannot be split over 16 ranks: each rank keeps at least one head
    assert kv_cache_gb(LLAMA["70b"], 1000, tp=16) == kv_cache_gb(LLAMA["70b"], 1000, tp=8)


def test_bad_zero_stage():
    with pytest.raises(ValueError, match="zero_stage"):
        training_state_gb(LLAMA["7b"], zero_stage=4)
