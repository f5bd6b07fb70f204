"""Parameter, FLOP and KV arithmetic against published LLaMA sizes."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from harness.core.config import LlamaConfig
from harness.costmodel import (
    ModelDims,
    embedding_params,
    forward_flops,
    head_params,
    kv_bytes_per_token,
    matmul_params_per_layer,
    num_params,
    params_per_layer,
)

from costmodel_testdata import LLAMA

# Published sizes: LLaMA (Touvron et al. 2023) 6.7B / 13.0B / 32.5B / 65.2B; Llama-2-70B 69.0B
# (from the released checkpoint).
PUBLISHED_B = {"7b": 6.74, "13b": 13.0, "33b": 32.5, "65b": 65.2, "70b": 69.0}


@pytest.mark.parametrize("size", sorted(PUBLISHED_B))
def test_param_counts_match_published_within_one_percent(size):
    assert num_params(LLAMA[size]) / 1e9 == pytest.approx(PUBLISHED_B[size], rel=0.01)


def test_13b_param_count_exactly():
    # per layer: 4 h^2 = 104,857,600 + 3 h ffn = 212,336,640 + 2 h = 10,240 -> 317,204,480
    # 40 layers 12,688,179,200 + embedding + head 2 * 163,840,000 + final norm 5,120
    m = LLAMA["13b"]
    assert params_per_layer(m) == 317_204_480
    assert num_params(m) == 13_015_864_320


def test_gqa_shrinks_k_and_v_only():
    m = LLAMA["70b"]
    h, kv = 8192, 8 * 128
    assert m.kv_dim == kv
    assert matmul_params_per_layer(m) == 2 * h * h + 2 * h * kv + 3 * h * 28672


def test_value_head_replaces_lm_head():
    lm = LLAMA["13b"]
    critic = ModelDims(**{**lm.__dict__, "value_head": True})
    assert head_params(critic) == lm.hidden_size
    assert num_params(lm) - num_params(critic) == lm.vocab_size * lm.hidden_size - lm.hidden_size
    assert embedding_params(critic) == embedding_params(lm)


def test_forward_flops_without_attention_is_two_per_matmul_weight():
    m = LLAMA["7b"]
    matmul_weights = num_params(m) - embedding_params(m) - m.hidden_size * (2 * m.num_layers + 1)
    assert forward_flops(m, 100, context_len=0) == 2 * matmul_weights * 100


def test_forward_flops_attention_term_and_stage_subset():
    m = LLAMA["13b"]
    attention = forward_flops(m, 10, 512) - forward_flops(m, 10, 0)
    assert attention == 4 * m.hidden_size * 512 * 10 * m.num_layers
    stage = forward_flops(m, 10, 512, num_layers=10, include_head=False)
    assert stage == pytest.approx((2 * matmul_params_per_layer(m) + 4 * 5120 * 512) * 10 * 10)


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(LLAMA["13b"]) == 2 * 40 * 5120 * 2 == 819_200
    assert kv_bytes_per_token(LLAMA["70b"]) == 2 * 80 * 1024 * 2


def test_model_dims_from_dataclass_dictconfig_and_mapping():
    fields = dict(name="13b", num_layers=40, hidden_size=5120, num_heads=40,
                  num_kv_heads=40, ffn_hidden_size=13824)
    dc = LlamaConfig(**fields)
    node = OmegaConf.structured(dc)
    assert ModelDims.of(dc) == ModelDims.of(node) == ModelDims.of(fields) == LLAMA["13b"]
    assert ModelDims.of(node) is ModelDims.of(node)  # identity-cached
    assert ModelDims.of(LLAMA["13b"]) is LLAMA["13b"]


def test_model_dims_rejects_missing_and_inconsistent_fields():
    with pytest.raises(ValueError, match="num_layers"):
        ModelDims.of(dict(name="x", hidden_size=64, num_heads=4, num_kv_heads=4,
                          ffn_hidden_size=128))
    with pytest.raises(ValueError, match="heads"):
        ModelDims.of(dict(name="x", num_layers=2, hidden_size=64, num_heads=4,
                          num_kv_heads=3, ffn_hidden_size=128))
