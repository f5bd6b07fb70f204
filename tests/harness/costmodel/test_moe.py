"""Mixture-of-experts decoders in the cost model (harness/costmodel/llama.py's module docstring):
stored and active parameter counts against closed forms, FLOPs on active parameters, a decode
step streaming only the experts its tokens touch, memory split over expert parallelism, the
all-to-alls, and dense models left exactly as they were."""
from __future__ import annotations

import dataclasses
import math

import pytest

from harness.core.config import LlamaConfig
from harness.costmodel import CostModel, comm, memory
from harness.costmodel import llama as L
from harness.costmodel.calibrated import CalibratedCompute, Calibration
from harness.costmodel.compute import Roofline
from harness.errors import ConfigError, PlanError
from harness.real.model import load_llama_config

from costmodel_testdata import LLAMA, load_cluster, workload

# A small MoE decoder with every MoE feature: one leading dense layer, a shared expert, GQA.
SMALL = L.ModelDims("small_moe", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=256,
                    vocab_size=100, num_experts=8, num_experts_per_token=2, moe_ffn_hidden_size=32,
                    num_shared_experts=1, num_dense_layers=1)
QWEN3_MOE = {"qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}  # model cards: total, activated


def qwen(name: str) -> L.ModelDims:
    return L.ModelDims.of(load_llama_config(name))


def roofline_cm(recompute: str = "selective") -> CostModel:
    cluster = load_cluster("rlhfuse_testbed")
    cluster.cost_model = "roofline"
    return CostModel(cluster, workload(recompute))


def calibrated_cm() -> CostModel:
    return CostModel(load_cluster("rlhfuse_testbed"), workload())


# -- parameter counts --------------------------------------------------------------------------


def test_small_moe_counts_match_closed_forms():
    h, attention = 64, 2 * 64 * 64 + 2 * 64 * 32  # W_q, W_o: h x 4*16; W_k, W_v: h x 2*16
    expert, router = 3 * 64 * 32, 64 * 8  # SwiGLU expert of width 32; router h x E
    dense_layer = attention + 3 * 64 * 256
    moe_layer = attention + router + (1 + 8) * expert  # the shared expert and all 8 routed
    active_moe_layer = attention + router + (1 + 2) * expert  # the shared expert and the top 2
    assert (L.expert_params(SMALL), L.router_params(SMALL)) == (expert, router)
    assert L.matmul_params_per_layer(SMALL) == (dense_layer + 3 * moe_layer) / 4
    assert L.active_matmul_params_per_layer(SMALL) == (dense_layer + 3 * active_moe_layer) / 4
    assert L.params_per_layer(SMALL) == L.matmul_params_per_layer(SMALL) + 2 * h
    assert L.routed_expert_params_per_layer(SMALL) == 3 * 8 * expert / 4
    embed_head_norm = 100 * h + 100 * h + h
    assert L.num_params(SMALL) == dense_layer + 3 * moe_layer + 4 * 2 * h + embed_head_norm
    assert L.num_active_params(SMALL) == dense_layer + 3 * active_moe_layer + 4 * 2 * h + embed_head_norm
    assert L.streamed_matmul_params_per_layer(SMALL, 8) == L.matmul_params_per_layer(SMALL)
    assert L.streamed_matmul_params_per_layer(SMALL, 2) == L.active_matmul_params_per_layer(SMALL)


@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_qwen3_moe_total_and_active_parameters_match_the_model_cards(name):
    total, active = QWEN3_MOE[name]
    d = qwen(name)
    assert d.is_moe and d.num_moe_layers == d.num_layers
    assert L.num_params(d) == pytest.approx(total, rel=0.01)
    assert L.num_active_params(d) == pytest.approx(active, rel=0.02)
    assert L.num_active_params(d) < L.num_params(d) / 5
    assert L.active_matmul_params_per_layer(d) < L.matmul_params_per_layer(d)


def test_qwen3_moe_configs_are_the_released_config_json():
    expected = {"qwen3_30b_a3b": (48, 2048, 32, 4, 128, 128, 8, 768, 151936),
                "qwen3_235b_a22b": (94, 4096, 64, 4, 128, 128, 8, 1536, 151936)}
    for name, dims in expected.items():
        c = load_llama_config(name)
        assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts,
                c.num_experts_per_token, c.moe_ffn_hidden_size, c.vocab_size) == dims
        assert (c.num_shared_experts, c.num_dense_layers, c.tied_embeddings) == (0, 0, False)


def test_flops_count_active_parameters():
    for d in (SMALL, qwen("qwen3_30b_a3b")):
        tokens = 1000.0
        got = L.forward_flops(d, tokens, 0.0, include_head=False)
        assert got == pytest.approx(2.0 * L.active_matmul_params_per_layer(d) * tokens * d.num_layers)
        assert got < 2.0 * L.matmul_params_per_layer(d) * tokens * d.num_layers


# -- dense models unchanged ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["13b", "70b"])
def test_a_dense_model_is_unchanged_through_every_function(name):
    """Each function on a dense model gives what the dense formulas give (the pre-MoE code's
    arithmetic), and the same as with the MoE fields spelled out at their defaults."""
    d = LLAMA[name]
    spelled = dataclasses.replace(d, num_experts=0, num_experts_per_token=0, moe_ffn_hidden_size=0,
                                  num_shared_experts=0, num_dense_layers=0)
    assert spelled == d and not d.is_moe and d.num_moe_layers == 0
    h = d.hidden_size
    matmul = 2 * h * d.q_dim + 2 * h * d.kv_dim + 3 * h * d.ffn_hidden_size
    assert L.matmul_params_per_layer(d) == L.active_matmul_params_per_layer(d) == matmul
    assert L.streamed_matmul_params_per_layer(d, 5) == matmul
    assert L.params_per_layer(d) == matmul + 2 * h and isinstance(L.params_per_layer(d), int)
    assert L.num_params(d) == L.num_active_params(d) == d.num_layers * (matmul + 2 * h) + 2 * 32000 * h + h
    assert L.routed_expert_params_per_layer(d) == 0 == L.expert_params(d) == L.router_params(d)
    assert L.forward_flops(d, 10.0, 3.0) == (2.0 * matmul + 4.0 * d.q_dim * 3.0) * 10.0 * d.num_layers \
        + 2.0 * 32000 * h * 10.0
    assert L.local_experts_streamed(d, 4, decode=True) == 0.0 and L.moe_dispatch_bytes(d, 10) == 0.0
    for pp in (1, 4):
        assert memory.max_stage_params(d, pp, ep=1) == memory.max_stage_params(d, pp)
        assert memory.stage_expert_params(d, pp) == 0.0
        assert memory.weights_gb(d, 2, pp, ep=1) == memory.weights_gb(d, 2, pp)
        for zero in (0, 1, 3):
            assert memory.training_state_gb(d, 8, 2, pp, zero, ep=1) == memory.training_state_gb(d, 8, 2, pp, zero)
            assert memory.updated_params_per_device(d, 8, 2, pp, zero) == \
                memory.max_stage_params(d, pp) / 2 / (8 if zero else 1)
    for cm in (roofline_cm(), calibrated_cm()):
        assert cm.forward_s(d, 2048, 1024, 2, 10, ep=1, ep_span=16) == cm.forward_s(d, 2048, 1024, 2, 10)
        assert cm.backward_s(d, 2048, 1024, 2, 10, ep=1, ep_span=16) == cm.backward_s(d, 2048, 1024, 2, 10)
        assert cm.decode_step_s(d, 16, 16 * 300, 2, 1, 1) == cm.decode_step_s(d, 16, 16 * 300, 2, 1)
        assert cm.decode_span_s(d, 16, 4800, 20, 2, 1, 1) == cm.decode_span_s(d, 16, 4800, 20, 2, 1)
        assert cm.prefill_s(d, 4096, 2, 2, 512, ep=1) == cm.prefill_s(d, 4096, 2, 2, 512)
        assert cm.optimizer_step_s(d, 8, 2, 1, 1, ep=1) == cm.optimizer_step_s(d, 8, 2, 1, 1)


def test_dense_roofline_bytes_and_calibrated_layer_are_the_dense_formulas():
    d = LLAMA["13b"]
    gpu = load_cluster("rlhfuse_testbed").gpu
    cost = Roofline(gpu).decode_step_cost(d, 8, 0.0, tp=1)
    weights = d.num_layers * L.params_per_layer(d) + d.hidden_size + L.head_params(d)
    act = L.activation_io_elems_per_token_layer(d) * 8 * d.num_layers
    assert cost.num_bytes == pytest.approx((weights + act) * 2)
    cc = CalibratedCompute(Calibration.load("h100"), 989.0)
    assert cc.linear_layer_s(d, 2, 64.0, ep=1, decode=True) == cc.linear_layer_s(d, 2, 64.0)


# -- decode weight streaming -----------------------------------------------------------------------


def test_experts_touched_under_uniform_routing():
    assert L.expected_experts_touched(128, 8, 1) == pytest.approx(8.0)
    assert L.expected_experts_touched(128, 8, 4) == pytest.approx(128 * (1 - (120 / 128) ** 4))
    assert L.expected_experts_touched(128, 8, 10_000) == pytest.approx(128.0)
    touched = [L.expected_experts_touched(128, 8, b) for b in (1, 2, 8, 32, 128, 512)]
    assert touched == sorted(touched) and touched[-1] <= 128
    assert L.expected_experts_touched(128, 8, 0) == 0.0


def test_decode_streams_the_experts_the_batch_touches_and_prefill_all():
    d = qwen("qwen3_30b_a3b")
    gpu = load_cluster("rlhfuse_testbed").gpu
    roof = Roofline(gpu)
    h, layers = d.hidden_size, d.num_layers

    def weight_bytes(cost, tokens):  # the op's bytes less its activations (no KV: context 0)
        return cost.num_bytes - L.activation_io_elems_per_token_layer(d) * tokens * layers * 2

    def expected(experts):
        return (layers * (L.streamed_matmul_params_per_layer(d, experts) + 2 * h) + h + L.head_params(d)) * 2

    assert weight_bytes(roof.decode_step_cost(d, 1, 0.0), 1) == pytest.approx(expected(8))  # B = 1: top-k
    b = 16
    touched = 128 * (1 - (1 - 8 / 128) ** b)
    assert weight_bytes(roof.decode_step_cost(d, b, 0.0), b) == pytest.approx(expected(touched))
    big = roof.decode_step_cost(d, 4096, 0.0)
    assert weight_bytes(big, 4096) == pytest.approx(expected(128))  # large B: every expert
    # prefill (and training) stream all of them, however few the tokens
    prefill = roof.prefill_cost(d, 1)  # its one token's K and V are written to the cache
    assert weight_bytes(prefill, 1) - L.kv_bytes_per_token(d) == pytest.approx(expected(128))
    # the decode step of a small batch is far cheaper than streaming the whole model
    assert roof.decode_step_s(d, 1, 100) < 0.3 * roof.prefill_s(d, 1)
    # calibrated: a decode step's layer reads fewer expert weights than a prefill over as many tokens
    cc = CalibratedCompute(Calibration.load("h100"), 989.0)
    for tp in (1, 4):
        assert cc.linear_layer_s(d, tp, 1.0, decode=True) < cc.linear_layer_s(d, tp, 1.0)
        assert cc.linear_layer_s(d, tp, 4096.0, decode=True) == pytest.approx(cc.linear_layer_s(d, tp, 4096.0))
    steps = [cc.decode_step_s(d, b, b * 500, tp=2) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps)


def test_decode_with_ep_streams_the_local_share_of_the_groups_experts():
    d = qwen("qwen3_30b_a3b")
    assert L.local_experts_streamed(d, 3, ep=4, decode=True) == pytest.approx(
        L.expected_experts_touched(128, 8, 12) / 4)
    assert L.local_experts_streamed(d, 3, ep=4) == 32.0  # prefill / training: all local experts


# -- memory and expert parallelism ------------------------------------------------------------------


def test_memory_per_gpu_shrinks_with_ep():
    d = qwen("qwen3_30b_a3b")
    experts = memory.stage_expert_params(d, 2)
    assert experts == d.num_layers / 2 * 128 * L.expert_params(d)
    weights = [memory.weights_gb(d, 2, 2, ep=ep) for ep in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True)
    for ep in (2, 4, 8):
        saved = memory.weights_gb(d, 2, 2) - memory.weights_gb(d, 2, 2, ep=ep)
        assert saved == pytest.approx(experts * (1 - 1 / ep) / 2 * 2 / 1e9)
        assert memory.expert_weights_gb(d, 2, 2, ep) == pytest.approx(experts / (ep * 2) * 2 / 1e9)
    # without ZeRO the whole state shrinks with ep; under ZeRO-3 every state is sharded over dp
    # (experts over the dp / ep ranks holding the same ones) and per device it is the same as at ep = 1
    states = [memory.training_state_gb(d, 16, 2, 1, 0, ep=ep) for ep in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[-1] < 0.5 * states[0]
    for zero in (1, 2):  # what ZeRO leaves whole (weights; gradients at 1) shrinks
        assert memory.training_state_gb(d, 16, 2, 1, zero, ep=8) < memory.training_state_gb(d, 16, 2, 1, zero)
    assert memory.training_state_gb(d, 16, 2, 1, 3, ep=8) == pytest.approx(memory.training_state_gb(d, 16, 2, 1, 3))
    assert memory.updated_params_per_device(d, 16, 2, 1, 0, ep=4) < memory.updated_params_per_device(d, 16, 2, 1, 0)
    assert memory.updated_params_per_device(d, 16, 2, 1, 1, ep=4) == pytest.approx(
        memory.updated_params_per_device(d, 16, 2, 1, 1))
    cm = roofline_cm()
    assert cm.weights_gb(d, 2, 2, ep=4) == memory.weights_gb(d, 2, 2, ep=4)
    assert cm.training_state_gb(d, 16, 2, 1, 0, ep=4) == memory.training_state_gb(d, 16, 2, 1, 0, ep=4)


# -- all-to-all ------------------------------------------------------------------------------------


def test_alltoall_formula_and_tier():
    link = comm.plain_link(load_cluster("rlhfuse_testbed").intra_node)
    assert comm.alltoall_s(1e6, 1, link) == 0.0
    per_byte = 1 / (link.bandwidth_gbps * 1e9 * link.efficiency_frac)
    assert comm.alltoall_s(1e6, 4, link) == pytest.approx(3 * link.latency_us * 1e-6 + 0.75 * 1e6 * per_byte)
    cm = roofline_cm()
    assert cm.alltoall_s(1e6, 1, 8) == 0.0
    assert cm.alltoall_s(1e6, 4, 8) == pytest.approx(comm.alltoall_s(1e6, 4, cm.intra_node))  # fits a node
    assert cm.alltoall_s(1e6, 4, 16) == pytest.approx(comm.alltoall_s(1e6, 4, cm.inter_node))  # spans nodes
    d = qwen("qwen3_30b_a3b")
    assert L.moe_dispatch_bytes(d, 1000) == 1000 * 8 * 2048 * 2


def test_alltoall_is_zero_at_ep1_and_counted_in_forward_backward_prefill_decode():
    d = qwen("qwen3_30b_a3b")
    calls = []

    def a2a(num_bytes, ep, span):
        calls.append((num_bytes, ep, span))
        return 1e-3 if ep > 1 else 0.0

    gpu = load_cluster("rlhfuse_testbed").gpu
    roof = Roofline(gpu, alltoall_s=a2a)
    assert roof.forward_cost(d, 4096, 512, tp=2, num_layers=12).comm_s == 0.0 and not calls
    fwd = roof.forward_cost(d, 4096, 512, tp=2, num_layers=12, ep=4)
    assert fwd.comm_s == pytest.approx(2 * 12 * 1e-3)  # dispatch and combine per MoE layer
    assert calls[-1] == (4096 * 8 * 2048 * 2, 4, 4 * 2)  # without a layout: the ep group's tp groups side by side
    fwd = roof.forward_cost(d, 4096, 512, tp=2, num_layers=12, ep=4, ep_span=26)
    assert calls[-1][2] == 26  # the span the layout gives (Allocation.ep_span)
    bwd = roof.backward_s(d, 4096, 512, tp=2, num_layers=12, ep=4, ep_span=26)
    assert bwd == pytest.approx(2.0 * (roof.seconds(fwd) - fwd.comm_s) + fwd.comm_s)  # two more
    assert roof.decode_step_cost(d, 8, 800, tp=2, ep=4).comm_s == pytest.approx(2 * 48 * 1e-3)
    assert roof.prefill_cost(d, 2048, tp=2, ep=4).comm_s == pytest.approx(2 * 48 * 1e-3)
    cc = CalibratedCompute(Calibration.load("h100"), 989.0, alltoall_s=a2a)
    with_ep, without = cc.forward_s(d, 4096, 512, 2, 12, ep=4), cc.forward_s(d, 4096, 512, 2, 12)
    assert with_ep - without == pytest.approx(2 * 12 * 1e-3 + 12 * (cc.linear_layer_s(d, 2, 4096.0, 4)
                                                                   - cc.linear_layer_s(d, 2, 4096.0)))
    decode_ep, decode = cc.decode_step_gpu_s(d, 8, 800, 2, 1, 4), cc.decode_step_gpu_s(d, 8, 800, 2, 1, 1)
    assert decode_ep - decode == pytest.approx(2 * 48 * 1e-3 + 48 * (cc.linear_layer_s(d, 2, 8.0, 4, decode=True)
                                                                   - cc.linear_layer_s(d, 2, 8.0, decode=True)))
    for cm in (roofline_cm(), calibrated_cm()):
        assert cm.prefill_s(d, 2048, 2, ep=4) > 0 and cm.decode_step_s(d, 8, 800, 2, 1, 4) > 0
        spans = cm.decode_span_s(d, 8, 800, 12, 2, 1, 4)  # a long span (timed at once) is its steps, bit for bit
        assert list(spans) == [cm.decode_step_s(d, 8, 800 + 8 * j, 2, 1, 4) for j in range(12)]


def test_moe_layers_average_with_leading_dense_layers():
    """A MoE model whose layers are all dense (num_dense_layers = num_layers) costs as the dense model."""
    all_dense = dataclasses.replace(SMALL, num_dense_layers=4)
    dense = dataclasses.replace(SMALL, num_experts=0, num_experts_per_token=0, moe_ffn_hidden_size=0,
                                num_shared_experts=0, num_dense_layers=0)
    assert not all_dense.is_moe
    assert L.num_params(all_dense) == L.num_params(dense)
    assert L.forward_flops(all_dense, 10, 5) == L.forward_flops(dense, 10, 5)


# -- refusals --------------------------------------------------------------------------------------


def test_expert_parallel_refusals():
    cm = roofline_cm()
    with pytest.raises(PlanError, match="ep=2 needs a mixture-of-experts model, and 13b is dense"):
        cm.weights_gb(LLAMA["13b"], 1, 1, ep=2)
    with pytest.raises(PlanError, match="mixture-of-experts"):
        cm.forward_s(LLAMA["13b"], 1024, 1024, ep=2)
    odd = dataclasses.replace(SMALL, num_experts=12)
    with pytest.raises(PlanError, match="ep=8 does not divide small_moe's num_experts=12"):
        cm.training_state_gb(odd, 16, 1, 1, 0, ep=8)
    assert L.expert_parallel_problem(odd, 4) is None and L.expert_parallel_problem(LLAMA["13b"], 1) is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_experts": 8, "num_experts_per_token": 2}, "needs moe_ffn_hidden_size"),
    ({"num_experts": 8, "moe_ffn_hidden_size": 32, "num_experts_per_token": 9}, r"top-k\) must be in 1..num_experts=8"),
    ({"num_experts": 8, "moe_ffn_hidden_size": 32}, r"num_experts_per_token=0 \(top-k\)"),
    ({"num_experts": 8, "moe_ffn_hidden_size": 32, "num_experts_per_token": 2, "num_dense_layers": 5},
     "num_dense_layers=5 exceeds num_layers=4"),
    ({"num_experts_per_token": 2}, "num_experts=0 \\(a dense model\\)"),
    ({"num_experts": -1}, "num_experts=-1 must be an integer >= 0"),
])
def test_moe_config_is_validated(fields, message):
    base = dict(name="m", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=256)
    with pytest.raises(ConfigError, match=message):
        LlamaConfig(**base, **fields)
    with pytest.raises(ValueError, match=message):
        L.ModelDims.of({**base, **fields})
    ok = LlamaConfig(**base, num_experts=8, num_experts_per_token=2, moe_ffn_hidden_size=32)
    assert L.ModelDims.of(ok).is_moe and math.isclose(L.ModelDims.of(ok).moe_ffn_hidden_size, 32)
