"""Every system plans and simulates a mixture-of-experts model on the default cluster (32 x 8
H100s), in-process as ``python -m harness`` would (:func:`harness.testing.simulate_iterations`):
``algo=grpo model=qwen3_30b_a3b``. Searches get the small deterministic budgets of
tests/test_systems_plan.py; OpenRLHF gives its pools of the models GRPO does not run to the others
(its refusal names that fix)."""
import pytest

from harness.core.plan import Plan
from harness.testing import simulate_iterations

MOE = ["algo=grpo", "model=qwen3_30b_a3b", "logger=none"]
SYSTEMS = {
    "rlhfuse_base": [],
    "rlhfuse": ["system.fused_search.max_steps=50", "system.migration_frac=0.2"],
    "realhf": ["system.max_steps=5"],
    "verl": [],
    "nemo_rl": [],
    "deepspeed_chat": [],
    "openrlhf": ["system.split.ref=2", "system.split.reward=0", "system.split.actor=4", "system.split.critic=0"],
}


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_system_plans_and_simulates_a_moe_model(system):
    plan, results = simulate_iterations([f"+system={system}", *MOE, *SYSTEMS[system]])
    trace, metrics = results[0]
    assert metrics["perf/samples_per_s"] > 0
    assert {t.name for t in plan.tasks} >= {"gen", "ref", "update_actor"}
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert all(t.allocation.strategy.dp % t.allocation.strategy.ep == 0 for t in plan.tasks)
    # training FLOPs count the active parameters (a tenth of the stored ones): a plausible MFU
    assert 0 < metrics["perf/mfu/actor"] < 1
