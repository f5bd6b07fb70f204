"""CostModel: profile overrides, workload defaults, config inputs and call speed."""
from __future__ import annotations


import pytest
from omegaconf import OmegaConf

from harness.core.config import LlamaConfig
from harness.costmodel import CostModel, ProfileTable, training_state_gb
from harness.costmodel.llama import ModelDims

from costmodel_testdata import LLAMA, workload


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.csv"
    path.write_text(
        "op,model,tp,num_tokens,time_s\n"
        "forward,13b,8,4096,0.123\n"
        "forward,13b,8,8192,0.246\n"
        "decode_step,13b,8,32,0.0075\n"
        "decode_step,13b,8,64,0.0080\n"
        "optimizer_step,13b,8,0,0.04\n"
    )
    return ProfileTable.from_csv(path)


def test_profile_overrides_analytic_times(testbed, profile):
    analytic = CostModel(testbed, workload())
    measured = CostModel(testbed, workload(), profile)
    m = LLAMA["13b"]
    assert measured.forward_s(m, 4096, 1024, tp=8) == pytest.approx(0.123)
    assert analytic.forward_s(m, 4096, 1024, tp=8) != pytest.approx(0.123)
    assert measured.forward_s(m, 6144, 1024, tp=8) == pytest.approx(0.1845)
    assert measured.forward_s(m, 4096, 1024, tp=8, num_layers=10) == pytest.approx(0.123 / 4)
    assert measured.decode_step_s(m, 64, 64 * 500, tp=8) == pytest.approx(0.0080)
    assert measured.optimizer_step_s(m, dp=1, tp=8) == pytest.approx(0.04)
    assert measured.optimizer_step_s(m, dp=4, tp=8, zero_stage=1) == pytest.approx(0.01)
    # a pp=2 instance runs micro-batches of 32 and pays one pipeline hop
    hop = measured._packed_p2p_s(32 * 5120 * 2, 16)
    assert measured.decode_step_s(m, 64, 64 * 500, tp=8, pp=2) == pytest.approx(0.0075 + hop)
    # entries the table lacks fall back to the roofline
    for op_args in [("forward_s", (m, 4096, 1024, 4)), ("backward_s", (m, 4096, 1024, 8)),
                    ("decode_step_s", (LLAMA["7b"], 64, 6400, 8))]:
        name, args = op_args
        assert getattr(measured, name)(*args) == getattr(analytic, name)(*args)


def test_workload_recompute_is_the_default(testbed):
    m = LLAMA["7b"]
    full = CostModel(testbed, workload("full"))
    none = CostModel(testbed, workload("none"))
    assert full.backward_s(m, 4096, 2048) > none.backward_s(m, 4096, 2048)
    assert full.backward_s(m, 4096, 2048, recompute="none") == none.backward_s(m, 4096, 2048)
    assert full.activation_gb(m, 1, 2048) < none.activation_gb(m, 1, 2048)
    with pytest.raises(ValueError, match="activation_recompute"):
        CostModel(testbed, workload("sometimes"))


def test_memory_wrappers_and_capacity(cost_model):
    m = LLAMA["13b"]
    assert cost_model.hbm_capacity_gb == pytest.approx(80 * 0.9)
    assert cost_model.training_state_gb(m, 1, 8, 1, 0) == training_state_gb(m, 1, 8, 1, 0)
    assert cost_model.weights_gb(m, tp=8) < cost_model.hbm_capacity_gb
    assert cost_model.kv_cache_gb(m, 1000) == pytest.approx(0.8192)
    assert cost_model.num_devices == 256


def test_optimizer_step_shards_with_zero(cost_model):
    m = LLAMA["13b"]
    plain = cost_model.optimizer_step_s(m, dp=8, tp=1, pp=1, zero_stage=0)
    zero1 = cost_model.optimizer_step_s(m, dp=8, tp=1, pp=1, zero_stage=1)
    assert zero1 == pytest.approx(plain / 8)


def test_accepts_dictconfig_and_dataclass_models(cost_model):
    fields = dict(name="13b", num_layers=40, hidden_size=5120, num_heads=40,
                  num_kv_heads=40, ffn_hidden_size=13824)
    expected = cost_model.decode_step_s(LLAMA["13b"], 32, 32 * 700, 8, 1)
    assert cost_model.decode_step_s(LlamaConfig(**fields), 32, 32 * 700, 8, 1) == expected
    node = OmegaConf.structured(LlamaConfig(**fields))
    assert cost_model.decode_step_s(node, 32, 32 * 700, 8, 1) == expected


def test_memoised_decode_steps_are_keyed_by_every_argument(cost_model):
    """The memo (``CostModel``'s per-argument cache) never hands one call's time to another: the
    same call repeated gives the same time, a config node and the dataclass it holds give the same
    time, and a longer context never decodes faster. (How fast a call is: benchmarks/sim_speed.py.)"""
    fields = dict(name="13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
                  ffn_hidden_size=13824)
    node = OmegaConf.structured(LlamaConfig(**fields))
    contexts = [64 * 100 * k for k in range(1, 12)]
    first = [cost_model.decode_step_s(node, 64, c, 8, 2) for c in contexts]
    again = [cost_model.decode_step_s(node, 64, c, 8, 2) for c in reversed(contexts)][::-1]
    plain = [cost_model.decode_step_s(LlamaConfig(**fields), 64, c, 8, 2) for c in contexts]
    assert first == again == plain
    assert all(a <= b for a, b in zip(first, first[1:])) and first[0] < first[-1]


@pytest.mark.parametrize("kind", ["roofline", "calibrated"])
@pytest.mark.parametrize("batch,tp,pp", [(1, 1, 1), (64, 8, 2), (7, 2, 4), (300, 4, 1)])
@pytest.mark.parametrize("num_steps", [3, 57])  # step by step, and elementwise (SHORT_SPAN_STEPS)
def test_decode_span_is_its_steps_bit_for_bit(testbed, kind, batch, tp, pp, num_steps):
    """A span (the calibrated model's one-pass timing, or the roofline's per-step loop) is exactly
    the per-step times, step j at context c + j * batch, whatever the memo already holds."""
    testbed.cost_model = kind
    testbed.calibration = "h100"
    cm = CostModel(testbed, workload())
    model = LLAMA["13b"]
    span = cm.decode_span_s(model, batch, batch * 333, num_steps, tp, pp)
    fresh = CostModel(testbed, workload())  # an empty memo: every step computed on its own
    steps = tuple(fresh.decode_step_s(model, batch, batch * 333 + j * batch, tp, pp)
                  for j in range(num_steps))
    assert span == steps
    assert cm.decode_span_s(model, batch, batch * 333, num_steps, tp, pp) is span  # memoised
    assert cm.decode_span_s(model, 0, 0, 3, tp, pp) == (0.0, 0.0, 0.0)


def test_calibrated_spans_are_their_steps_bit_for_bit_on_random_cases(testbed):
    """The calibrated model's spans, short (one scalar loop) and long (one elementwise pass), against
    its steps computed one by one, on random batches, contexts (any total, not a multiple of the
    batch), widths and span lengths, for multi-head, grouped-query, mixture-of-experts and
    latent-attention models."""
    import random

    from harness.costmodel.calibrated import SHORT_SPAN_STEPS
    from harness.real.model import load_llama_config

    testbed.calibration = "h100"
    compute = CostModel(testbed, workload()).compute
    moe, mla = ModelDims.of(load_llama_config("qwen3_30b_a3b")), ModelDims.of(load_llama_config("deepseek_v3"))
    rng = random.Random(0)
    for _ in range(300):
        d = rng.choice([LLAMA["13b"], LLAMA["70b"], moe, mla])
        batch, tp, pp = rng.randint(1, 300), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        ep = rng.choice([1, 2, 4]) if d in (moe, mla) else 1
        context = rng.randint(batch, 3000 * batch)
        num_steps = rng.randint(1, 3 * SHORT_SPAN_STEPS)
        span = compute.decode_span_s(d, batch, context, num_steps, tp, pp, ep)
        steps = [compute.decode_step_s(d, batch, context + j * batch, tp, pp, ep) for j in range(num_steps)]
        assert span == steps, (d.name, batch, context, num_steps, tp, pp, ep)


def test_memoised_op_times_equal_fresh_ones(testbed):
    """The memo is keyed on every argument: interleaved asks with different arguments each get
    the uncached answer of a fresh cost model."""
    testbed.calibration = "h100"
    testbed.cost_model = "calibrated"
    cm = CostModel(testbed, workload())
    model = LLAMA["13b"]
    asks = [("forward_s", (model, 4096, 1024, 8), {"num_layers": 10, "include_head": True}),
            ("forward_s", (model, 4096, 1024, 8), {"num_layers": 10, "include_head": False}),
            ("backward_s", (model, 4096, 1024, 8), {}), ("backward_s", (model, 4096, 1024, 4), {}),
            ("prefill_s", (model, 8192, 8, 1), {"seq_len": 1024}), ("prefill_s", (model, 8192, 8, 1), {}),
            ("decode_step_s", (model, 32, 32 * 700, 8, 2), {})]
    for _ in range(2):
        for name, args, kwargs in asks:
            assert getattr(cm, name)(*args, **kwargs) == getattr(CostModel(testbed, workload()), name)(*args, **kwargs)
