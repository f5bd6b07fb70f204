"""The model and hardware zoo: OPT, Llama-2 / CodeLlama, Llama-3 and Megatron GPT configs
(conf/llama, conf/model) and the A100-40GB / H800 clusters, against closed-form oracles.

Oracles: published parameter counts (the papers' nominal sizes, or the released checkpoints'
exact counts for the bias-free LLaMA family), the GeLU-MLP layer ``4h^2 + 2hf`` weights and
``2 (4h^2 + 2hf) + 4 h context`` FLOPs per token, a tied LM head stored once but computed, and
every model set composing through the harness's Hydra loading and simulating one iteration."""
from __future__ import annotations

import dataclasses
import re

import pytest
from omegaconf import OmegaConf

from harness.core.config import LlamaConfig
from harness.costmodel import llama as L
from harness.costmodel import measured as ms
from harness.costmodel import memory as mem
from harness.costmodel.calibrated import CalibratedCompute, Calibration, _op_work, _vidur_dims
from harness.costmodel.compute import Roofline
from harness.errors import ConfigError
from harness.real.model import check_architecture, check_models_architecture, load_llama_config
from harness.testing import run_config, simulate_iterations

from costmodel_testdata import CONF_DIR, load_cluster
import test_costmodel_cluster_configs as cluster_tests

NEW_LLAMA = ("opt_350m", "opt_1_3b", "opt_6_7b", "opt_13b", "opt_30b", "opt_66b", "opt_175b",
             "llama2_7b", "llama2_13b", "llama2_70b", "codellama_34b",
             "llama3_8b", "llama3_70b", "llama3_405b", "gpt_7b", "gpt_13b", "gpt_30b")
NEW_CLUSTERS = ("a100_40g_8x", "h800_8x", "h20_8x", "b200_8x", "gb200_nvl72")
MODEL_SETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))

# (config, published parameters, relative tolerance).
# OPT: Zhang et al. 2022, Table 1 (nominal sizes; OPT-350M's released checkpoint has 331M with a
# 512-wide embedding we do not model). Llama-2: the released checkpoints (bias-free, so exact up to
# rounding). CodeLlama-34B 33.7B, Llama-3-8B 8.03B, -70B 70.6B, -405B 405.9B (released
# checkpoints; Dubey et al. 2024, Table 3 for the shapes). Megatron GPT 7B/13B/30B: nominal names
# of GPT-3-style shapes (GPT-3's 6.7B is the "7B"), so 5%.
PUBLISHED = [
    ("opt_350m", 350e6, 0.02), ("opt_1_3b", 1.3e9, 0.02), ("opt_6_7b", 6.7e9, 0.02),
    ("opt_13b", 13e9, 0.02), ("opt_30b", 30e9, 0.02), ("opt_66b", 66e9, 0.02),
    ("opt_175b", 175e9, 0.02),
    ("llama2_7b", 6.74e9, 0.002), ("llama2_13b", 13.02e9, 0.002), ("llama2_70b", 68.98e9, 0.002),
    ("codellama_34b", 33.7e9, 0.02), ("llama3_8b", 8.03e9, 0.02), ("llama3_70b", 70.6e9, 0.02),
    ("llama3_405b", 405.9e9, 0.02),
    ("gpt_7b", 7e9, 0.05), ("gpt_13b", 13e9, 0.05), ("gpt_30b", 30e9, 0.05),
]


def llama(name: str) -> LlamaConfig:
    return load_llama_config(name)


def gelu_dims(**over) -> L.ModelDims:
    base = dict(name="g", num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=16,
                ffn_hidden_size=4096, vocab_size=50272, mlp="gelu", tied_embeddings=True,
                learned_positions=True, max_seq_len=2048)
    base.update(over)
    return L.ModelDims(**base)


# -- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_LLAMA)
def test_llama_yaml_is_complete_and_cites_its_source(name):
    text = (CONF_DIR / "llama" / f"{name}.yaml").read_text()
    header = text.split("defaults:")[0]
    assert header.startswith("# ") and re.search(r"et al\. (19|20)\d\d", header)  # a cited paper
    cfg = llama(name)
    assert cfg.name == name
    assert cfg.hidden_size % cfg.num_heads == 0 and cfg.num_heads % cfg.num_kv_heads == 0
    family = name.split("_")[0]
    if family in ("opt", "gpt"):
        assert (cfg.mlp, cfg.tied_embeddings, cfg.learned_positions) == ("gelu", True, True)
        assert cfg.ffn_hidden_size == 4 * cfg.hidden_size and cfg.max_seq_len == 2048
        assert cfg.vocab_size == (50272 if family == "opt" else 50304)
    else:
        assert (cfg.mlp, cfg.tied_embeddings, cfg.learned_positions) == ("swiglu", False, False)


@pytest.mark.parametrize(("name", "published", "rel"), PUBLISHED)
def test_param_counts_match_published_sizes(name, published, rel):
    assert L.num_params(llama(name)) == pytest.approx(published, rel=rel)


def test_bias_free_llama_counts_are_exact():
    """Released checkpoints' exact counts (no biases in the LLaMA family)."""
    assert L.num_params(llama("llama2_7b")) == 6_738_415_616
    assert L.num_params(llama("llama2_13b")) == 13_015_864_320
    assert L.num_params(llama("llama3_8b")) == 8_030_261_248


def test_llama2_70b_has_the_dimensions_of_70b():
    a, b = llama("llama2_70b"), llama("70b")
    assert dataclasses.replace(a, name="70b") == b


@pytest.mark.parametrize("name", ["opt_13b", "gpt_30b", "llama3_70b", "codellama_34b"])
def test_shapes_match_the_papers(name):
    expected = {"opt_13b": (40, 5120, 40, 40, 20480), "gpt_30b": (48, 7168, 56, 56, 28672),
                "llama3_70b": (80, 8192, 64, 8, 28672), "codellama_34b": (48, 8192, 64, 8, 22016)}[name]
    c = llama(name)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.ffn_hidden_size) == expected


# -- architecture fields --------------------------------------------------------------------------


def test_llama_defaults_are_unchanged():
    d = L.ModelDims.of(llama("7b"))
    assert (d.mlp, d.tied_embeddings, d.learned_positions, d.gated_mlp) == ("swiglu", False, False, True)
    assert L.num_params(d) == 6_738_415_616
    assert L.stored_head_params(d) == L.head_params(d) == 32000 * 4096
    assert L.embedding_params(d) == 32000 * 4096


@pytest.mark.parametrize("kind", ["dataclass", "dictconfig", "dict"])
def test_model_dims_read_the_new_fields(kind):
    cfg = llama("opt_1_3b")
    src = {"dataclass": cfg, "dictconfig": OmegaConf.structured(cfg),
           "dict": dataclasses.asdict(cfg)}[kind]
    d = L.ModelDims.of(src)
    assert (d.mlp, d.tied_embeddings, d.learned_positions, d.max_seq_len) == ("gelu", True, True, 2048)


def test_unknown_mlp_is_refused():
    with pytest.raises(ValueError, match="mlp='relu' is not one of swiglu, gelu"):
        L.ModelDims.of(dict(name="x", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=4,
                            ffn_hidden_size=256, mlp="relu"))
    with pytest.raises(ConfigError, match="mlp='relu'"):
        LlamaConfig(name="x", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=256, mlp="relu")
    with pytest.raises(ConfigError, match="mlp='relu'"):
        run_config(["+system=deepspeed_chat", "model=7b", "model.actor.mlp=relu"])


def test_gelu_layer_weights_and_flops():
    h, f = 1024, 4096
    d = gelu_dims(hidden_size=h, ffn_hidden_size=f)
    assert L.matmul_params_per_layer(d) == 4 * h * h + 2 * h * f
    assert L.params_per_layer(d) == 4 * h * h + 2 * h * f + 2 * h
    tokens, ctx = 100, 37.0
    per_token_layer = 2 * (4 * h * h + 2 * h * f) + 4 * h * ctx
    assert L.forward_flops(d, tokens, ctx, include_head=False) == pytest.approx(per_token_layer * tokens * 4)
    # the head GEMM runs though the head is tied: 2 V h per token
    assert (L.forward_flops(d, tokens, ctx) - L.forward_flops(d, tokens, ctx, include_head=False)
            == pytest.approx(2 * 50272 * h * tokens))
    # a SwiGLU model of the same ffn has one more h x f matrix
    swiglu = dataclasses.replace(d, mlp="swiglu")
    assert L.matmul_params_per_layer(swiglu) - L.matmul_params_per_layer(d) == h * f


def test_tied_head_is_stored_once_and_learned_positions_add_rows():
    d = gelu_dims()
    untied = dataclasses.replace(d, tied_embeddings=False)
    no_pos = dataclasses.replace(d, learned_positions=False)
    h, v, s = d.hidden_size, d.vocab_size, d.max_seq_len
    assert L.embedding_params(d) == (v + s) * h
    assert L.embedding_params(no_pos) == v * h
    assert L.head_params(d) == L.head_params(untied) == v * h
    assert L.stored_head_params(d) == 0
    assert L.num_params(untied) - L.num_params(d) == v * h
    assert L.num_params(d) == 4 * L.params_per_layer(d) + (v + s) * h + h
    # a value head is never tied
    critic = dataclasses.replace(d, value_head=True)
    assert L.stored_head_params(critic) == L.head_params(critic) == h
    assert L.num_params(critic) == L.num_params(d) + h


def test_tied_head_in_memory_footprints():
    d, untied = gelu_dims(), gelu_dims(tied_embeddings=False)
    gb, v_h = 1e9, d.vocab_size * d.hidden_size
    # one stage holds both ends: counted once in weights and in ZeRO training state
    assert mem.max_stage_params(d, 1) == L.num_params(d)
    assert mem.max_stage_params(untied, 1) - mem.max_stage_params(d, 1) == v_h
    assert mem.weights_gb(d) == pytest.approx(2 * L.num_params(d) / gb)
    assert mem.training_state_gb(d, dp=4, zero_stage=3) == pytest.approx(16 * L.num_params(d) / 4 / gb)
    # pp > 1: the last stage keeps its own copy of the tied matrix (Megatron-LM)
    assert mem.max_stage_params(d, 2) == mem.max_stage_params(untied, 2)


def test_gelu_activations_follow_korthikanti_and_ffn():
    d = gelu_dims(num_heads=16)
    s, b, h, a, t = 1024, 2, d.hidden_size, 16, 2
    sbh = s * b * h
    attention_core = 5 * a * s / (h * t)
    assert mem.activation_bytes_per_layer(d, b, s, t, "none") == pytest.approx(sbh * (10 + 24 / t + attention_core))
    assert mem.activation_bytes_per_layer(d, b, s, t, "selective") == pytest.approx(34 * sbh / t)
    assert mem.activation_bytes_per_layer(d, b, s, t, "full") == pytest.approx(2 * sbh)
    wide = dataclasses.replace(d, ffn_hidden_size=8 * h)  # 8 + 4 f/h and 18 + 4 f/h
    assert mem.activation_bytes_per_layer(wide, b, s, t, "none") == pytest.approx(sbh * (10 + 40 / t + attention_core))
    assert mem.activation_bytes_per_layer(wide, b, s, t, "selective") == pytest.approx(50 * sbh / t)


def test_gelu_activation_io():
    d = gelu_dims()
    h, f = d.hidden_size, d.ffn_hidden_size
    swiglu = dataclasses.replace(d, mlp="swiglu")
    # GeLU MLP: up (h + f), act (2f), down (f + h); SwiGLU: gate/up (h + 2f), act (3f), down (f + h)
    assert L.activation_io_elems_per_token_layer(swiglu) - L.activation_io_elems_per_token_layer(d) == 2 * f
    attention = 2 * h + 2 * (2 * h + 2 * h) + 2 * h + 3 * h
    assert L.activation_io_elems_per_token_layer(d) == attention + 2 * h + (h + f) + 2 * f + (f + h) + 3 * h


def test_roofline_streams_a_tied_head_all_the_same():
    gpu = load_cluster("h100_8x").gpu
    rf = Roofline(gpu)
    d, untied = gelu_dims(), gelu_dims(tied_embeddings=False)
    for cost in (lambda m: rf.decode_step_cost(m, 8, 8 * 300), lambda m: rf.prefill_cost(m, 512),
                 lambda m: rf.forward_cost(m, 512, 256)):
        assert cost(d) == cost(untied)
    # and the GeLU layer is cheaper than a SwiGLU one of the same ffn
    swiglu = dataclasses.replace(d, mlp="swiglu")
    assert rf.forward_cost(d, 512, 256).flops < rf.forward_cost(swiglu, 512, 256).flops


def test_calibrated_op_work_of_a_gelu_mlp_equals_the_profile_analysis():
    d = gelu_dims(hidden_size=5120, num_heads=40, num_kv_heads=40, ffn_hidden_size=20480)
    dims = {"n_embd": 5120, "n_expanded_embd": 20480, "n_head": 40, "n_kv_head": 40, "use_gated_mlp": False}
    for op in ms.OPS:
        for tp in (1, 2, 8):
            for m in (1.0, 37.0, 4096.0):
                got = _op_work(op, _vidur_dims(d), tp, m)
                f_ref, b_ref = ms.op_work(op, dims, tp, m)
                _, w_ref = ms.op_work(op, dims, tp, 1.0)
                assert got == pytest.approx((float(f_ref), float(b_ref), float(w_ref)))


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_calibrated_layer_follows_the_architecture(gpu):
    from harness.costmodel.measured import LAYER_OPS, OP_CLASS

    cc = CalibratedCompute(Calibration.load(gpu), 989.0 if gpu == "h100" else 312.0)
    d = gelu_dims(hidden_size=4096, num_heads=32, num_kv_heads=32, ffn_hidden_size=16384)
    for tp, m in ((1, 1.0), (2, 512.0), (8, 4096.0)):
        expected = sum(cc.cal.law(OP_CLASS[op], tp).seconds(*_op_work(op, _vidur_dims(d), tp, m))
                       for op in LAYER_OPS if op != "attn_rope")  # learned positions: no rope
        assert cc.linear_layer_s(d, tp, m) == pytest.approx(expected)
        rope = dataclasses.replace(d, learned_positions=False)
        assert cc.linear_layer_s(rope, tp, m) > cc.linear_layer_s(d, tp, m)
        assert cc.linear_layer_s(dataclasses.replace(d, mlp="swiglu"), tp, m) > cc.linear_layer_s(d, tp, m)


# -- model sets compose and simulate --------------------------------------------------------------

# Nodes of 8 H100s a DeepSpeed-Chat plan needs to fit (all four models resident, ZeRO-3).
NODES = {"opt_30b_350m": 2, "opt_66b_350m": 4, "opt_175b_350m": 16, "codellama_34b": 4,
         "llama3_70b": 8, "13b_33b": 2, "33b_13b": 2, "33b": 4, "33b_65b": 4, "65b_33b": 4,
         "65b": 8, "70b": 8, "qwen2_5_14b": 2, "qwen2_5_32b": 4, "qwen2_5_72b": 8, "llama3_1_70b": 8,
         "qwen3_32b": 4, "qwen3_30b_a3b": 4, "qwen3_235b_a22b": 96, "deepseek_v3": 64}
# DeepSpeed-Chat's hybrid engine gathers the whole actor on each 8-GPU generation group (168 GB a GPU
# for DeepSeek-V3's 671B), so it cannot run DeepSeek-V3 at any size; RLHFuse-Base searches pipelined
# layouts, here under DAPO (actor only, as NeMo-RL's DeepSeek-V3 DAPO recipe on 64 nodes of 8 H100s).
SYSTEM = {"deepseek_v3": ["+system=rlhfuse_base", "algo=dapo"]}


@pytest.mark.parametrize("model_set", MODEL_SETS)
def test_every_model_set_plans_and_simulates(model_set):
    nodes = NODES.get(model_set, 1)
    plan, results = simulate_iterations([
        *SYSTEM.get(model_set, ["+system=deepspeed_chat"]), f"model={model_set}", "backend=sim", "logger=none",
        "workload=tiny",
        "cluster=h100_8x", f"cluster.num_nodes={nodes}", f"workload.global_batch_size={8 * nodes}"])
    trace, metrics = results[0]
    assert metrics["perf/samples_per_s"] > 0
    assert plan.tasks


NEW_SETS = [s for s in MODEL_SETS if s.startswith(("opt_", "llama2", "llama3", "codellama", "gpt_"))]


@pytest.mark.parametrize("model_set", NEW_SETS)
def test_new_model_sets_compose_with_value_heads(model_set):
    run = run_config(["+system=deepspeed_chat", f"model={model_set}", "backend=sim"])
    m = run.model
    assert not m.actor.value_head and not m.ref.value_head and m.critic.value_head and m.reward.value_head
    assert m.ref == m.actor and m.reward == m.critic
    if model_set.startswith("opt_"):
        assert m.actor.name == model_set[:-len("_350m")] and m.critic.name == "opt_350m"
    else:
        assert m.actor.name == m.critic.name == model_set
    from harness.costmodel import CostModel

    cm = CostModel(run.cluster, run.workload)
    for role in ("actor", "critic"):
        assert cm.forward_s(getattr(m, role), 1024, 1024, tp=8) > 0
        assert cm.decode_step_s(getattr(m, role), 16, 16 * 512, tp=8) > 0


def test_one_role_override_with_a_new_config():
    run = run_config(["+system=deepspeed_chat", "model=llama3_8b", "llama@model.critic=opt_350m"])
    assert run.model.critic.name == "opt_350m" and run.model.critic.mlp == "gelu"


# -- the models and GPUs of today's RL frameworks' published runs ------------------------------------
# (config, the released checkpoint's parameter count (its model card), relative tolerance): the
# LLaMA-style count leaves out Qwen2's q/k/v biases and Qwen3's q/k norms (< 0.1%).
CURRENT = [("qwen2_5_7b", 7.61e9), ("qwen2_5_math_7b", 7.61e9), ("qwen2_5_14b", 14.7e9), ("qwen2_5_32b", 32.5e9),
           ("qwen2_5_72b", 72.7e9), ("qwen3_8b", 8.19e9), ("qwen3_32b", 32.8e9), ("llama3_1_8b", 8.03e9),
           ("llama3_1_70b", 70.6e9)]


@pytest.mark.parametrize(("name", "published"), CURRENT)
def test_current_models_cite_their_config_and_match_their_size(name, published):
    header = (CONF_DIR / "llama" / f"{name}.yaml").read_text().split("defaults:")[0]
    assert "huggingface.co/" in header and "config.json" in header
    cfg = llama(name)
    assert cfg.name == name and cfg.num_heads % cfg.num_kv_heads == 0
    assert (cfg.mlp, cfg.tied_embeddings, cfg.learned_positions) == ("swiglu", False, False)
    assert L.num_params(cfg) == pytest.approx(published, rel=0.01)


def test_llama3_1_is_llama3_with_the_long_context():
    for size in ("8b", "70b"):
        a, b = llama(f"llama3_1_{size}"), llama(f"llama3_{size}")
        assert dataclasses.replace(a, name=b.name, max_seq_len=b.max_seq_len) == b and a.max_seq_len == 131072


# -- clusters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_CLUSTERS)
def test_new_clusters_are_complete_and_compose(name):
    cluster_tests.test_yaml_sets_every_schema_field(name)
    cluster_tests.test_hydra_composes_with_schema_and_overrides(name)


def test_new_clusters_datasheet_numbers():
    a40, a80 = load_cluster("a100_40g_8x"), load_cluster("a100_8x")
    assert (a40.gpu.hbm_gb, a40.gpu.hbm_bandwidth_gbps) == (40.0, 1555.0)
    assert a40.intra_node == a80.intra_node and a40.intra_node.bandwidth_gbps == 300.0  # 600 GB/s bidir
    assert a40.gpu.peak_bf16_tflops == a80.gpu.peak_bf16_tflops and a40.calibration == "a100"
    h800, h100 = load_cluster("h800_8x"), load_cluster("h100_8x")
    assert h800.intra_node.bandwidth_gbps == 200.0  # 400 GB/s bidirectional
    assert h800.gpu.peak_bf16_tflops == h100.gpu.peak_bf16_tflops == 989.0
    assert (h800.gpu.hbm_gb, h800.gpu.hbm_bandwidth_gbps) == (h100.gpu.hbm_gb, h100.gpu.hbm_bandwidth_gbps)
    assert h800.inter_node == h100.inter_node and h800.calibration == "h100"


def test_a100_40g_roofline_decode_is_slower_and_holds_less():
    from harness.costmodel import CostModel
    from costmodel_testdata import workload

    cms = {}
    for name in ("a100_40g_8x", "a100_8x"):
        c = load_cluster(name)
        c.cost_model = "roofline"
        cms[name] = CostModel(c, workload())
    m = llama("opt_6_7b")
    ratio = cms["a100_40g_8x"].decode_step_s(m, 1, 100) / cms["a100_8x"].decode_step_s(m, 1, 100)
    assert ratio == pytest.approx(2039.0 / 1555.0, rel=0.01)  # weight streaming, bandwidth bound
    assert cms["a100_40g_8x"].hbm_capacity_gb == pytest.approx(36.0)


# -- backend=ray refuses what it cannot build ------------------------------------------------------


def test_ray_refuses_non_llama_architectures_naming_the_field():
    run = run_config(["+system=deepspeed_chat", "model=opt_1_3b_350m", "backend=sim"])
    with pytest.raises(ConfigError, match=r"model\.actor\.mlp=gelu, model\.actor\.tied_embeddings=true, "
                                          r"model\.actor\.learned_positions=true"):
        check_models_architecture(run.model)
    with pytest.raises(ConfigError, match="mlp=gelu"):
        check_architecture(run.model.critic)
    from harness.real.checkpoints import resolve_checkpoints

    with pytest.raises(ConfigError, match="backend=ray builds LLaMA modules only"):
        resolve_checkpoints(run.model)  # what RayBackend.__init__ runs first
    one_field = dataclasses.replace(llama("7b"), tied_embeddings=True)
    with pytest.raises(ConfigError, match=r"cannot run tied_embeddings=true;"):
        check_architecture(one_field)
    for name in ("7b", "llama3_8b", "codellama_34b", "tiny"):
        check_architecture(llama(name))  # LLaMA architectures pass


def test_current_gpus_datasheet_numbers_and_roofline():
    """H20, B200 and GB200 have no GPU profiles here: they are timed by the roofline, from their
    datasheet numbers (the YAML files cite them)."""
    expected = {"h20_8x": (148.0, 96.0, 4000.0, 450.0, 8), "b200_8x": (2250.0, 180.0, 7700.0, 900.0, 8),
                "gb200_nvl72": (2500.0, 186.0, 8000.0, 900.0, 72)}
    for name, (tflops, hbm, bw, nvlink, domain) in expected.items():
        c = load_cluster(name)
        assert (c.gpu.peak_bf16_tflops, c.gpu.hbm_gb, c.gpu.hbm_bandwidth_gbps, c.intra_node.bandwidth_gbps,
                c.gpus_per_node) == (tflops, hbm, bw, nvlink, domain)
        assert c.cost_model == "roofline" and c.calibration is None


@pytest.mark.parametrize("cluster", ["h20_8x", "b200_8x", "gb200_nvl72"])
def test_grpo_on_a_current_model_plans_and_simulates_on_current_gpus(cluster):
    plan, results = simulate_iterations(["+system=rlhfuse_base", "algo=grpo", "model=qwen2_5_7b", "logger=none",
                                         f"cluster={cluster}", "cluster.num_nodes=1",
                                         "workload.global_batch_size=64", "workload.mini_batch_size=16"])
    assert results[0][1]["perf/samples_per_s"] > 0 and plan.global_batch_size == 64 * 8


def test_a_head_width_of_its_own_widens_the_attention_not_the_model():
    """Qwen3-32B's 64 heads of 128 make a query projection of 8192 columns on a 5120-wide model: the
    model card's 32.8B parameters (31.2B without the two embedding matrices) need it, and the same
    model with hidden / heads = 80-wide heads would have 2.0B fewer (four 5120 x 3072 matrices per
    layer less, over 64 layers: W_q and W_o lose 5120 x 3072 each, K and V keep 8 x 128)."""
    cfg = llama("qwen3_32b")
    d = L.ModelDims.of(cfg)
    assert (d.head_dim, d.q_dim, d.kv_dim) == (128, 8192, 1024)
    assert L.num_params(cfg) - 2 * 151936 * 5120 == pytest.approx(31.2e9, rel=0.005)
    narrow = dataclasses.replace(d, head_size=0)
    assert narrow.head_dim == 80 and narrow.kv_dim == 640
    widen_q = 64 * 2 * 5120 * (8192 - 5120)  # W_q and W_o
    widen_kv = 64 * 2 * 5120 * (1024 - 640)  # W_k and W_v
    assert L.num_params(d) - L.num_params(narrow) == widen_q + widen_kv
    # attention's FLOPs scale with the query width: 4 x q_dim per key per token per layer
    one_key = L.forward_flops(d, 1, 1.0, include_head=False) - L.forward_flops(d, 1, 0.0, include_head=False)
    assert one_key == 4.0 * 8192 * 64
