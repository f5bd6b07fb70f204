"""Every system plans and simulates a mixture-of-experts model on the default cluster (32 x 8
H100s), in-process as ``python -m harness`` would (:func:`harness.testing.simulate_iterations`):
``algo=grpo model=qwen3_30b_a3b``, and ``algo=dapo`` on the systems that plan fastest. Searches get the small deterministic budgets of
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


# DAPO (no reference model, no reward model: only generation and the actor's training) on the
# systems that plan fastest; OpenRLHF's pools then leave out the reference model too.
DAPO = {"rlhfuse_base": [], "rlhfuse": SYSTEMS["rlhfuse"], "verl": [], "deepspeed_chat": [],
        "openrlhf": ["system.split.ref=0", "system.split.reward=0", "system.split.actor=2", "system.split.critic=0"]}
CASES = [(s, "grpo", extra) for s, extra in SYSTEMS.items()] + [(s, "dapo", extra) for s, extra in DAPO.items()]


@pytest.mark.parametrize(("system", "algo", "extra"), CASES, ids=[f"{s}-{a}" for s, a, _ in CASES])
def test_system_plans_and_simulates_a_moe_model(system, algo, extra):
    plan, results = simulate_iterations([f"+system={system}", f"algo={algo}", *MOE[1:], *extra])
    trace, metrics = results[0]
    assert metrics["perf/samples_per_s"] > 0
    assert {t.name for t in plan.tasks} >= ({"gen", "ref", "update_actor"} if algo == "grpo" else {"gen", "update_actor"})
    assert "ref" not in {t.name for t in plan.tasks} or algo == "grpo"  # DAPO drops the reference model
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert all(t.allocation.strategy.dp % t.allocation.strategy.ep == 0 for t in plan.tasks)
    # training FLOPs count the active parameters (a tenth of the stored ones): a plausible MFU
    assert 0 < metrics["perf/mfu/actor"] < 1
