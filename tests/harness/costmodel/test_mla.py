"""Multi-head latent attention in the cost model (harness/costmodel/llama.py's module docstring;
DeepSeek-V2 section 2.1, DeepSeek-V3): parameters against closed forms and the report's totals, a KV
cache of one latent per token that tensor parallelism cannot shard, decode steps that read it, the
config checks, and standard attention left exactly as it was."""
from __future__ import annotations

import dataclasses

import pytest

from harness.core.config import LlamaConfig
from harness.costmodel import CostModel, memory
from harness.costmodel import llama as L
from harness.errors import ConfigError
from harness.real.model import check_architecture, load_llama_config

from costmodel_testdata import LLAMA, load_cluster, workload

# A small latent-attention decoder: 4 heads, query latent 24, KV latent 16, 8-wide rotary part,
# 12-wide per-head query/key (head_dim) and 10-wide values.
SMALL = L.ModelDims("small_mla", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                    vocab_size=100, head_size=12, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=10)


def dsv3() -> L.ModelDims:
    return L.ModelDims.of(load_llama_config("deepseek_v3"))


def test_small_latent_attention_counts_match_closed_forms():
    h = 64
    attention = (64 * 24 + 24 * 4 * (12 + 8)  # W_DQ, W_UQ (each head's query with its rotary part)
                 + 64 * (16 + 8)  # W_DKV with the rotary key
                 + 16 * 4 * (12 + 10)  # W_UK, W_UV
                 + 4 * 10 * 64)  # W_O
    layer = attention + 3 * 64 * 128 + 2 * h + 24 + 16  # SwiGLU MLP; four norms (two of the latents)
    assert L.params_per_layer(SMALL) == layer
    assert L.num_params(SMALL) == 3 * layer + 100 * h + h + 100 * h
    assert L.kv_bytes_per_token(SMALL) == 3 * (16 + 8) * 2  # the latent and the rotary key, bf16
    assert SMALL.q_dim == 4 * 20 and SMALL.kv_cache_heads == 1
    assert SMALL.attention_width == 4 * (20 + 10) / 2  # 2 x heads x (qk + v) FLOPs per (query, key) pair
    assert SMALL.decode_attention_width == 4 * (2 * 16 + 8) / 2  # over the latent: qk 16 + 8, v 16
    # a decode step's attention core runs on the latents (absorbed up-projections), prefill's on keys and values
    assert (L.forward_flops(SMALL, 5, 100.0, decode=True) - L.forward_flops(SMALL, 5, 100.0)
            == 4.0 * (SMALL.decode_attention_width - SMALL.attention_width) * 100.0 * 5 * 3)
    without_query_latent = dataclasses.replace(SMALL, q_lora_rank=0)
    assert L.params_per_layer(without_query_latent) == layer - (64 * 24 + 24 * 80 + 24) + 64 * 80


def test_deepseek_v3_counts_are_the_reports():
    """DeepSeek-V3 (arXiv 2412.19437, section 1 and the model card): 671B parameters, 37B activated
    per token (the multi-token-prediction module is not counted in either); its KV cache holds 512 +
    64 values per token per layer."""
    d = dsv3()
    assert d.is_mla and d.is_moe
    assert L.num_params(d) == pytest.approx(671e9, rel=0.002)
    assert L.num_active_params(d) == pytest.approx(37e9, rel=0.02)
    assert L.kv_bytes_per_token(d) == 61 * (512 + 64) * 2


def test_standard_attention_is_unchanged():
    for d in (LLAMA["13b"], LLAMA["70b"]):
        assert not d.is_mla
        assert d.q_dim == d.num_heads * d.head_dim and d.kv_dim == d.num_kv_heads * d.head_dim
        assert d.attention_width == d.decode_attention_width == d.q_dim
        assert d.kv_cache_heads == d.num_kv_heads
        for tp in (1, 2, 8, 16):
            assert d.kv_cache_width(tp) == 2 * max(1, d.num_kv_heads // tp) * d.head_dim
        assert L.kv_bytes_per_token(d) == 2 * d.num_layers * d.kv_dim * 2


def test_the_latent_cache_is_on_every_tensor_parallel_rank():
    """Grouped-query KV heads split over tp ranks; the latent, which every head reads, does not."""
    d = dsv3()
    assert memory.kv_cache_gb(d, 1e6, tp=8) == memory.kv_cache_gb(d, 1e6, tp=1)
    assert memory.kv_cache_gb(d, 1e6, tp=8, pp=2) == memory.kv_cache_gb(d, 1e6, tp=1) / 2
    assert memory.kv_cache_gb(LLAMA["70b"], 1e6, tp=8) == memory.kv_cache_gb(LLAMA["70b"], 1e6, tp=1) / 8


@pytest.mark.parametrize("kind", ["calibrated", "roofline"])
def test_a_long_context_decode_step_reads_the_latent_cache_not_the_heads(kind):
    """At long contexts a decode step of latent attention takes less than the same model with
    standard multi-head attention, whose cache holds keys and values of every head (32x more per
    token here); prefill, which works on up-projected keys and values, is not cheaper."""
    cluster = load_cluster("rlhfuse_testbed")
    cluster.cost_model = kind
    cm = CostModel(cluster, workload())
    mla = dsv3()
    mha = dataclasses.replace(mla, kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0, v_head_dim=0)
    assert L.kv_bytes_per_token(mha) / L.kv_bytes_per_token(mla) == pytest.approx(2 * 128 * 128 / 576)
    batch, context = 64, 32_000
    assert cm.decode_step_s(mla, batch, batch * context, 8, 1, 8) < 0.5 * cm.decode_step_s(mha, batch, batch * context, 8, 1, 8)
    assert cm.prefill_s(mla, 8192, 8, 1, ep=8) > 0.5 * cm.prefill_s(mha, 8192, 8, 1, ep=8)


def test_latent_attention_fields_are_checked():
    base = dict(name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=128)
    with pytest.raises(ConfigError, match=r"q_lora_rank=8 describe multi-head latent attention, but kv_lora_rank=0"):
        LlamaConfig(**base, q_lora_rank=8)
    with pytest.raises(ConfigError, match=r"kv_lora_rank=16 .* needs head_dim"):
        LlamaConfig(**base, kv_lora_rank=16, qk_rope_head_dim=8)
    with pytest.raises(ConfigError, match=r"kv_lora_rank=-1 must be an integer >= 0"):
        LlamaConfig(**base, kv_lora_rank=-1, head_dim=16)
    with pytest.raises(ValueError, match=r"qk_rope_head_dim=8 describe multi-head latent attention"):
        L.ModelDims.of({**base, "qk_rope_head_dim": 8})
    LlamaConfig(**base, kv_lora_rank=16, qk_rope_head_dim=8, head_dim=16)  # latent attention, complete


def test_backend_ray_refuses_latent_attention():
    dense_mla = LlamaConfig(name="dense_mla", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
                            ffn_hidden_size=128, head_dim=16, kv_lora_rank=16, qk_rope_head_dim=8)
    with pytest.raises(ConfigError, match=r"kv_lora_rank=16"):
        check_architecture(dense_mla)
