"""Roofline regimes of the compute ops."""
from __future__ import annotations

import pytest

from harness.costmodel import ADAM_BYTES_PER_PARAM, OpCost, Roofline, num_params
from harness.costmodel.llama import activation_io_elems_per_token_layer, embedding_params

from costmodel_testdata import LLAMA, load_cluster

H100 = load_cluster("rlhfuse_testbed").gpu
HBM_BYTES_PER_S = 3350e9 * 0.85  # datasheet bandwidth x memory_efficiency_frac of the YAML
FLOPS_PER_S = 989e12 * 0.5


@pytest.fixture
def roof():
    return Roofline(H100)


def test_efficiencies_are_read_from_the_config(roof):
    assert roof.bytes_per_s == pytest.approx(HBM_BYTES_PER_S)
    assert roof.flops_per_s == pytest.approx(FLOPS_PER_S)
    assert roof.seconds(OpCost(FLOPS_PER_S, 0.0, 0.5)) == pytest.approx(1.5)


def test_decode_13b_batch1_one_gpu_is_memory_bound_on_weights(roof):
    m = LLAMA["13b"]
    cost = roof.decode_step_cost(m, batch_size=1, context_tokens_total=512)
    assert roof.is_memory_bound(cost)
    assert roof.decode_step_s(m, 1, 512) == pytest.approx(roof.memory_s(cost), rel=1e-12)
    # 25.7 GB of bf16 weights (all but the embedding table, of which one row is read) +
    # 0.42 GB of KV for 512 cached tokens: ~26 GB streamed per step
    weight_bytes = 2 * (num_params(m) - embedding_params(m))
    assert weight_bytes == pytest.approx(25.70e9, rel=1e-3)
    expected = (weight_bytes + 512 * 819_200) / HBM_BYTES_PER_S
    assert roof.decode_step_s(m, 1, 512) == pytest.approx(expected, rel=1e-3)
    assert roof.decode_step_s(m, 1, 512) == pytest.approx(26e9 / HBM_BYTES_PER_S, rel=0.01)


def test_large_batch_forward_is_compute_bound(roof):
    m = LLAMA["13b"]
    cost = roof.forward_cost(m, num_tokens=16 * 1024, context_len=512)
    assert not roof.is_memory_bound(cost)
    assert roof.forward_s(m, 16 * 1024, 512) == pytest.approx(roof.compute_s(cost), rel=1e-12)


def test_large_decode_batch_crosses_into_compute_bound(roof):
    m = LLAMA["7b"]
    assert roof.is_memory_bound(roof.decode_step_cost(m, 8, 8 * 100))
    assert not roof.is_memory_bound(roof.decode_step_cost(m, 4096, 4096 * 10))


def test_backward_recompute_modes(roof):
    m, n, ctx = LLAMA["7b"], 8192, 1024
    fwd = roof.forward_s(m, n, ctx)
    assert roof.backward_s(m, n, ctx, recompute="none") == pytest.approx(2 * fwd)
    assert roof.backward_s(m, n, ctx, recompute="full") == pytest.approx(3 * fwd)
    core = 4 * 4096 * ctx * n * 32 / FLOPS_PER_S
    assert roof.backward_s(m, n, ctx, recompute="selective") == pytest.approx(2 * fwd + core)
    with pytest.raises(ValueError):
        roof.backward_s(m, n, ctx, recompute="partial")


def test_tensor_parallel_adds_two_allreduces_per_layer():
    calls = []

    def allreduce(num_bytes, n):
        calls.append((num_bytes, n))
        return 1e-3

    roof = Roofline(H100, allreduce_s=allreduce)
    m = LLAMA["13b"]
    cost = roof.forward_cost(m, 1000, 500, tp=8)
    assert cost.comm_s == pytest.approx(2 * 40 * 1e-3)
    assert calls[0] == (1000 * 5120 * 2, 8)
    plain = Roofline(H100).forward_cost(m, 1000, 500, tp=1)
    assert cost.flops == pytest.approx(plain.flops / 8)


def test_decode_pipeline_streams_all_weights_per_step(roof):
    m = LLAMA["13b"]
    one = roof.decode_step_cost(m, 64, 64 * 1000, tp=1, pp=1)
    two = roof.decode_step_cost(m, 64, 64 * 1000, tp=1, pp=2)
    weight_bytes = 2 * (num_params(m) - embedding_params(m))
    kv_bytes = 64 * 1000 * 819_200
    activation_bytes = 2 * activation_io_elems_per_token_layer(m) * 64 * 40
    # per device: all weights still stream once per step; KV and activations halve
    assert one.num_bytes - two.num_bytes == pytest.approx((kv_bytes + activation_bytes) / 2)
    assert two.num_bytes > weight_bytes
    assert two.flops == pytest.approx(one.flops / 2)
    # a batch too small to fill the pipeline leaves stages idle: no speed-up at all
    assert roof.decode_step_s(m, 1, 100, pp=4) == pytest.approx(roof.decode_step_s(m, 1, 100))


def test_prefill_is_compute_bound_and_writes_kv_once(roof):
    m = LLAMA["13b"]
    cost = roof.prefill_cost(m, 64 * 512, tp=1, seq_len=512)
    assert not roof.is_memory_bound(cost)
    assert roof.prefill_s(m, 0) == 0.0
    assert roof.decode_step_s(m, 0, 0) == 0.0


def test_optimizer_step_is_memory_bound(roof):
    assert roof.optimizer_step_s(1e9) == pytest.approx(ADAM_BYTES_PER_PARAM * 1e9 / HBM_BYTES_PER_S)
