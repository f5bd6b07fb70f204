"""Every system x model preset composes, plans, validates and fits on the default cluster."""
import pytest

from harness.planning.memory import check_plan_memory
from harness.core.plan import Plan
from harness.testing import plan_for

MODELS = ["tiny", "tiny2", "7b", "13b", "33b", "65b", "70b", "13b_33b", "33b_13b", "33b_65b", "65b_33b"]
PAPER_PAIRS = ["13b_33b", "33b_13b", "33b_65b", "65b_33b"]
# Searches get small deterministic budgets here; their quality is checked in their own tests.
FAST = {"realhf": ["system.max_steps=5"],
        "rlhfuse": ["system.fused_search.max_steps=50", "system.migration_frac=0.2"],
        "disaggregated": ["system.gen_nodes=8"]}  # the split search has its own tests
CASES = [(s, m) for s in ("deepspeed_chat", "rlhfuse_base", "realhf_heuristic", "realhf") for m in MODELS] + \
        [("rlhfuse", m) for m in ["tiny", "13b", *PAPER_PAIRS]] + \
        [(s, m) for s in ("interleaved", "disaggregated") for m in ["13b", *PAPER_PAIRS]]
SYSTEMS = ["deepspeed_chat", "rlhfuse_base"]


@pytest.mark.parametrize(("system", "model"), CASES)
def test_system_plans_model_on_default_cluster(system, model):
    # tiny's 512-token context cannot hold hh_rlhf's prompts and answers: its own lengths, the
    # default batch sizes (256 devices)
    workload = (["workload=tiny", "workload.global_batch_size=512", "workload.mini_batch_size=64"]
                if model.startswith("tiny") else [])
    plan, ctx, _ = plan_for([f"+system={system}", f"model={model}", *workload, *FAST.get(system, [])])
    plan.validate(ctx.num_devices)
    report = check_plan_memory(plan, ctx.cost_model, ctx.models, ctx.workload)
    assert max(report.peak_gb.values()) <= ctx.cost_model.hbm_capacity_gb
    assert {t.name for t in plan.tasks} >= {"gen", "ref", "reward", "values", "update_actor", "update_critic"}
    assert plan.devices() == list(range(ctx.num_devices))
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


@pytest.mark.parametrize("system", SYSTEMS)
def test_tiny_models_plan_on_one_node(system):
    plan, ctx, _ = plan_for([f"+system={system}", "model=tiny", "workload=tiny", "cluster=h100_8x",
                             "cluster.num_nodes=1", "cluster.gpus_per_node=4"] + (["system.mini_batch_size=8", "system.generation_batch_size=8"]
                                                       if system == "deepspeed_chat" else []))
    plan.validate(ctx.num_devices)


def test_role_override_changes_one_model():
    _, ctx, _ = plan_for(["+system=deepspeed_chat", "model=13b", "llama@model.critic=33b"])
    assert ctx.models.actor.name == "13b" and ctx.models.critic.name == "33b"
    assert ctx.models.critic.value_head and not ctx.models.actor.value_head
