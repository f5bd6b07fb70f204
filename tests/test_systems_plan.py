"""Every system x model preset composes, plans, validates and fits on the default cluster."""
import pytest

from harness.memory_check import check_plan_memory
from harness.plan import Plan
from harness.testing import plan_for

SYSTEMS = ["deepspeed_chat", "rlhfuse_base"]
MODELS = ["tiny", "tiny2", "7b", "13b", "33b", "65b", "70b", "13b_33b", "33b_13b", "33b_65b", "65b_33b"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_system_plans_model_on_default_cluster(system, model):
    plan, ctx, _ = plan_for([f"+system={system}", f"model={model}"])
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
